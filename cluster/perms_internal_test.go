package cluster

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// secureDataDir tightens a data dir group or other can read, and logs it once; a private one
// is left alone, without a log line.
func TestSecureDataDirLogsTightening(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "node-id"), []byte("node0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	if err := secureDataDir(dir, log); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"data dir was readable by group or other", "was=-rwxr-xr-x", "paths_changed=2"} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("log %q does not say %q", buf.String(), want)
		}
	}
	for path, want := range map[string]os.FileMode{dir: 0o700, filepath.Join(dir, "node-id"): 0o600} {
		if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != want {
			t.Errorf("%s: %v %v, want %v", path, fi.Mode().Perm(), err, want)
		}
	}
	buf.Reset()
	if err := secureDataDir(dir, log); err != nil || buf.Len() != 0 {
		t.Errorf("a private data dir: err %v, log %q", err, buf.String())
	}
}

// An empty data dir that group or other could write (a container volume's mount point, 1777
// in the image so that any --user can write it) is made private with an INFO line, not the
// warning about exposed data: every new container started with that warning, and nothing was
// exposed.
func TestSecureEmptyDataDirNoWarning(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o777|os.ModeSticky); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	if err := secureDataDir(dir, log); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(buf.String(), "level=WARN") || !strings.Contains(buf.String(), "level=INFO msg=\"made the empty data dir private\"") {
		t.Errorf("log %q: want one INFO line, no warning", buf.String())
	}
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("%s: %v %v, want 0700", dir, fi.Mode().Perm(), err)
	}
}
