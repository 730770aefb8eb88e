// Package backup is the file format of `quotad snapshot save/inspect/restore`: a header line
// (JSON) that says where the state comes from and how to check it, then the state machine's
// snapshot exactly as Raft stored it on the leader.
//
//	QUOTAD-SNAPSHOT 1\n
//	{"cluster_id":"…","index":1234,"term":3,"size":5678,"sha256":"…",…}\n
//	<size bytes: an fsm snapshot (fsm/snapshot.go)>
//
// Reading a file checks the magic line, the size and the SHA-256 of the state; Decode also
// decodes the state into a state machine, so that a file is known good before a cluster is
// asked to take it.
package backup

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/internal/buildinfo"
)

// Magic is the first line of a snapshot file.
const Magic = "QUOTAD-SNAPSHOT 1\n"

// maxHeader bounds the header line.
const maxHeader = 64 << 10

// Header describes a saved snapshot.
type Header struct {
	// ClusterID is the ID of the cluster it was saved from; Leader the node that saved it.
	ClusterID string `json:"cluster_id"`
	Leader    string `json:"leader"`
	// Index and Term are the Raft index and term of the last entry the state includes.
	Index uint64 `json:"index"`
	Term  uint64 `json:"term"`
	// Size is the length of the state in bytes; SHA256 its hex checksum.
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"`
	// RaftSnapshotVersion is hashicorp/raft's snapshot version (raft.SnapshotVersion).
	RaftSnapshotVersion int `json:"raft_snapshot_version"`
	// CommandVersion is the fsm.CommandVersion of the build that saved it; QuotadVersion that
	// build's version.
	CommandVersion int       `json:"command_version"`
	QuotadVersion  string    `json:"quotad_version"`
	CreatedAt      time.Time `json:"created_at"`
}

// Marshal returns the header as the JSON of a file's second line.
func (h Header) Marshal() []byte {
	b, _ := json.Marshal(h) // a struct of plain fields: cannot fail
	return b
}

// ParseHeader reads a header sent by Save (one JSON object).
func ParseHeader(b []byte) (Header, error) {
	var h Header
	if err := json.Unmarshal(b, &h); err != nil {
		return h, fmt.Errorf("snapshot header: %w", err)
	}
	if h.Size <= 0 || len(h.SHA256) != 64 {
		return h, fmt.Errorf("snapshot header: size %d and sha256 %q: not a quotad snapshot header", h.Size, h.SHA256)
	}
	return h, nil
}

// Verifier checks that a stream of state bytes has the header's size and checksum.
type Verifier struct {
	h   Header
	sum hash.Hash
	n   int64
}

// NewVerifier returns a Verifier for h.
func NewVerifier(h Header) *Verifier { return &Verifier{h: h, sum: sha256.New()} }

// Write counts and hashes p.
func (v *Verifier) Write(p []byte) (int, error) {
	v.n += int64(len(p))
	if v.n > v.h.Size {
		return 0, fmt.Errorf("snapshot: more than the %d bytes the header announces", v.h.Size)
	}
	return v.sum.Write(p)
}

// Check reports whether everything written matches the header.
func (v *Verifier) Check() error {
	if v.n != v.h.Size {
		return fmt.Errorf("snapshot: %d bytes of state, the header announces %d: the file is truncated", v.n, v.h.Size)
	}
	if got := hex.EncodeToString(v.sum.Sum(nil)); got != v.h.SHA256 {
		return fmt.Errorf("snapshot: state checksum %s, the header says %s: the file is corrupt", got, v.h.SHA256)
	}
	return nil
}

// WriteFile writes a snapshot file to path: the header, then state, which must match the
// header's size and checksum (checked as it is copied). It writes path+".part" and renames it
// only when everything checked out, so path is never a partial file. An existing file at path
// is replaced (SaveWith can refuse one).
func WriteFile(path string, h Header, state io.Reader) error {
	return writeFile(path, h, state, true)
}

// CheckNew reports an error if path exists (`quotad snapshot save` refuses to overwrite a
// file unless --force).
func CheckNew(path string) error {
	_, err := os.Lstat(path)
	switch {
	case err == nil:
		return existsError(path)
	case errors.Is(err, fs.ErrNotExist):
		return nil
	}
	return err
}

func existsError(path string) error {
	return fmt.Errorf("snapshot: %s already exists; nothing was saved: give another file name, or --force to replace it", path)
}

func writeFile(path string, h Header, state io.Reader, replace bool) (err error) {
	tmp := path + ".part"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(tmp)
		}
	}()
	w := bufio.NewWriterSize(f, 1<<20)
	if _, err = w.WriteString(Magic); err != nil {
		return err
	}
	if _, err = w.Write(append(h.Marshal(), '\n')); err != nil {
		return err
	}
	v := NewVerifier(h)
	if _, err = io.Copy(io.MultiWriter(w, v), state); err != nil {
		return err
	}
	if err = v.Check(); err != nil {
		return err
	}
	if err = w.Flush(); err != nil {
		return err
	}
	if err = f.Sync(); err != nil {
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	if err = place(tmp, path, replace); err != nil {
		return err
	}
	if d, err := os.Open(filepath.Dir(path)); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}

// place moves the finished tmp to path: a rename, or without replace a hard link (which fails
// if path exists) and the removal of tmp. A file system without hard links gets a check and a
// rename.
func place(tmp, path string, replace bool) error {
	if replace {
		return os.Rename(tmp, path)
	}
	err := os.Link(tmp, path)
	switch {
	case err == nil:
		return os.Remove(tmp)
	case errors.Is(err, fs.ErrExist):
		return existsError(path)
	}
	if err := CheckNew(path); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// File is an open snapshot file: its header and a reader of its state (exactly Header.Size
// bytes; reading past them is an error).
type File struct {
	Header Header
	f      *os.File
	state  io.Reader
}

// Open opens a snapshot file and reads its header.
func Open(path string) (*File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	br := bufio.NewReaderSize(f, 1<<20)
	magic := make([]byte, len(Magic))
	if _, err := io.ReadFull(br, magic); err != nil || string(magic) != Magic {
		f.Close()
		return nil, fmt.Errorf("%s: not a quotad snapshot file (it does not start with %q; make one with `quotad snapshot save`)", path, Magic[:len(Magic)-1])
	}
	line, err := readLine(br)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: snapshot header: %w", path, err)
	}
	h, err := ParseHeader(line)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &File{Header: h, f: f, state: io.MultiReader(io.LimitReader(br, h.Size), &trailing{r: br})}, nil
}

func readLine(br *bufio.Reader) ([]byte, error) {
	var line []byte
	for {
		part, isPrefix, err := br.ReadLine()
		if err != nil {
			return nil, err
		}
		line = append(line, part...)
		if len(line) > maxHeader {
			return nil, errors.New("longer than 64 KiB")
		}
		if !isPrefix {
			return line, nil
		}
	}
}

// trailing fails, from then on, once anything follows the state.
type trailing struct {
	r   io.Reader
	err error
}

func (t *trailing) Read(p []byte) (int, error) {
	if t.err == nil {
		var b [1]byte
		if n, _ := t.r.Read(b[:]); n > 0 {
			t.err = errors.New("snapshot: bytes after the state the header announces: the file is corrupt")
		} else {
			t.err = io.EOF
		}
	}
	return 0, t.err
}

// State returns the reader of the state bytes.
func (f *File) State() io.Reader { return f.state }

// Close closes the file.
func (f *File) Close() error { return f.f.Close() }

// Info is what `quotad snapshot inspect` reports.
type Info struct {
	Header
	LimitsVersion uint64   `json:"limits_version"`
	Domains       []string `json:"domains"`
	Buckets       int      `json:"buckets"`
	Leases        int      `json:"leases"`
	Pauses        int      `json:"pauses"`
	DedupEntries  int      `json:"dedup_entries"`
	Tokens        int      `json:"tokens"`
	FSMClockNs    int64    `json:"fsm_clock_ns"`
	ChecksumOK    bool     `json:"checksum_ok"`
}

// Decode reads state (as sent with h), checking its size and checksum, and decodes it into a
// new state machine.
func Decode(h Header, state io.Reader) (*fsm.FSM, error) {
	v := NewVerifier(h)
	f := fsm.New(fsm.Options{})
	if err := f.Restore(io.NopCloser(io.TeeReader(state, v))); err != nil {
		if cerr := v.Check(); cerr != nil {
			return nil, cerr // a damaged file, first
		}
		return nil, fmt.Errorf("snapshot: the state does not decode: %w", err)
	}
	// Restore reads to the end of the state; anything left is read here for the check.
	if _, err := io.Copy(v, state); err != nil {
		return nil, err
	}
	if err := v.Check(); err != nil {
		return nil, err
	}
	return f, nil
}

// Describe returns the Info of a decoded state.
func Describe(h Header, f *fsm.FSM) Info {
	st := f.Stats()
	info := Info{Header: h, LimitsVersion: f.Limits().Version, Buckets: st.Buckets, Leases: st.Leases,
		Pauses: st.Pauses, DedupEntries: st.DedupEntries, Tokens: len(f.Tokens()), FSMClockNs: f.Clock(), ChecksumOK: true}
	for _, d := range f.Limits().Domains {
		info.Domains = append(info.Domains, d.Name)
	}
	return info
}

// Inspect opens, checks and decodes the snapshot file at path.
func Inspect(path string) (Info, error) {
	file, err := Open(path)
	if err != nil {
		return Info{}, err
	}
	defer file.Close()
	f, err := Decode(file.Header, file.State())
	if err != nil {
		return Info{Header: file.Header}, fmt.Errorf("%s: %w", path, err)
	}
	return Describe(file.Header, f), nil
}

// Hasher computes the checksum a header carries.
type Hasher struct{ hash.Hash }

// NewHasher returns an empty Hasher.
func NewHasher() Hasher { return Hasher{sha256.New()} }

// Hex returns the checksum of what was written, as the header writes it.
func (h Hasher) Hex() string { return hex.EncodeToString(h.Sum(nil)) }

// BuildVersion names the running build as `quotad version` does (internal/buildinfo: the
// version and commit stamped by make build, else what the Go toolchain recorded), without the
// Go version: "v1.4.0 (commit 1a2b3c)".
func BuildVersion() string { return buildinfo.Get().Short() }
