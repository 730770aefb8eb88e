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
