package backup

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/raft"

	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/internal/buildinfo"
)

// state returns the snapshot bytes of an FSM with one token.
func state(t *testing.T) []byte {
	t.Helper()
	f := fsm.New(fsm.Options{})
	snap, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	sink := &memSink{}
	if err := snap.Persist(sink); err != nil {
		t.Fatal(err)
	}
	return sink.Bytes()
}

type memSink struct{ bytes.Buffer }

func (m *memSink) ID() string    { return "mem" }
func (m *memSink) Cancel() error { return nil }
func (m *memSink) Close() error  { return nil }

var _ raft.SnapshotSink = (*memSink)(nil)

func header(b []byte) Header {
	h := NewHasher()
	h.Write(b)
	return Header{ClusterID: "c1", Index: 7, Term: 2, Size: int64(len(b)), SHA256: h.Hex(), RaftSnapshotVersion: 1, CommandVersion: fsm.CommandVersion}
}

func TestWriteInspectAndDamage(t *testing.T) {
	b := state(t)
	dir := t.TempDir()
	good := filepath.Join(dir, "good.snap")
	if err := WriteFile(good, header(b), bytes.NewReader(b)); err != nil {
		t.Fatal(err)
	}
	info, err := Inspect(good)
	if err != nil || !info.ChecksumOK || info.Index != 7 || info.ClusterID != "c1" {
		t.Fatalf("inspect: %+v %v", info, err)
	}
	// WriteFile refuses state that does not match the header, and leaves no file.
	bad := filepath.Join(dir, "bad.snap")
	if err := WriteFile(bad, header(b), bytes.NewReader(b[:len(b)-1])); err == nil {
		t.Fatal("short state written")
	}
	if _, err := os.Stat(bad); !os.IsNotExist(err) {
		t.Fatalf("a refused write left %s (%v)", bad, err)
	}
	if _, err := os.Stat(bad + ".part"); !os.IsNotExist(err) {
		t.Fatalf("a refused write left its .part file")
	}
	file, _ := os.ReadFile(good)
	for name, tc := range map[string]struct {
		data []byte
		want string
	}{
		"truncated":  {file[:len(file)-3], "truncated"},
		"flipped":    {flip(file, len(file)-5), "corrupt"},
		"trailing":   {append(append([]byte(nil), file...), 'x'), "after the state"},
		"not a file": {[]byte("hello\n"), "not a quotad snapshot"},
		"no header":  {[]byte(Magic + "{}\n"), "not a quotad snapshot header"},
	} {
		p := filepath.Join(dir, name)
		_ = os.WriteFile(p, tc.data, 0o600)
		if _, err := Inspect(p); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error with %q", name, err, tc.want)
		}
	}
}

func flip(b []byte, i int) []byte {
	c := append([]byte(nil), b...)
	c[i] ^= 0x40
	return c
}

// The header names the build as `quotad version` does (internal/buildinfo), not what
// debug.ReadBuildInfo says of the module ("(devel)" for every build from a checkout).
func TestBuildVersionIsQuotadVersion(t *testing.T) {
	if got, want := BuildVersion(), buildinfo.Get().Short(); got != want {
		t.Fatalf("BuildVersion() = %q, want %q (what quotad version prints)", got, want)
	}
	if strings.Contains(BuildVersion(), "(devel)") {
		t.Fatalf("BuildVersion() = %q: the Go module placeholder, not quotad's version", BuildVersion())
	}
}

// TestWriteRefusesExisting: without replace, a file that appears at path while the state is
// copied is kept (the hard link does not replace it) and no .part is left; WriteFile (and
// SaveWith --force) replace it.
func TestWriteRefusesExisting(t *testing.T) {
	b := state(t)
	file := filepath.Join(t.TempDir(), "s.snap")
	if err := CheckNew(file); err != nil {
		t.Fatalf("CheckNew on a missing file: %v", err)
	}
	if err := os.WriteFile(file, []byte("precious"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := CheckNew(file); err == nil || !strings.Contains(err.Error(), "already exists") || !strings.Contains(err.Error(), "--force") {
		t.Fatalf("CheckNew on an existing file: %v", err)
	}
	if err := writeFile(file, header(b), bytes.NewReader(b), false); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Fatalf("writeFile without replace over an existing file: %v", err)
	}
	if got, _ := os.ReadFile(file); string(got) != "precious" {
		t.Fatalf("the existing file was changed: %q", got)
	}
	if _, err := os.Stat(file + ".part"); !os.IsNotExist(err) {
		t.Fatalf("%s.part left behind: %v", file, err)
	}
	if err := WriteFile(file, header(b), bytes.NewReader(b)); err != nil {
		t.Fatal(err)
	}
	if _, err := Inspect(file); err != nil {
		t.Fatalf("replaced file: %v", err)
	}
	fresh := filepath.Join(t.TempDir(), "new.snap")
	if err := writeFile(fresh, header(b), bytes.NewReader(b), false); err != nil {
		t.Fatal(err)
	}
	if _, err := Inspect(fresh); err != nil {
		t.Fatalf("new file: %v", err)
	}
	if _, err := os.Stat(fresh + ".part"); !os.IsNotExist(err) {
		t.Fatalf("%s.part left behind: %v", fresh, err)
	}
}
