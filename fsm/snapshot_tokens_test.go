package fsm

import (
	"bytes"
	"encoding/binary"
	"io"
	"slices"
	"testing"
	"time"
)

func accessors(f *FSM) []string {
	var out []string
	for _, t := range f.Tokens() {
		out = append(out, t.Accessor)
	}
	return out
}

// A restore keeps the cluster's current tokens: the saved file's token section is replaced by
// the live FSM's, everything else is kept byte for byte, and the result restores.
func TestWriteSnapshotWithTokens(t *testing.T) {
	saved := newLog(t)
	saved.apply(time.Millisecond, acquire("c1", 1, "acme", 2), createToken("a", "secret-a", "admin"), createToken("b", "secret-b", "reader"))
	data := snapshotBytes(t, saved.f)

	// Its own tokens: the same bytes.
	var same bytes.Buffer
	if n, err := saved.f.WriteSnapshotWithTokens(&same, bytes.NewReader(data)); err != nil || n != int64(same.Len()) || !bytes.Equal(same.Bytes(), data) {
		t.Fatalf("rewriting with the file's own tokens: %d bytes, err %v, equal %v", n, err, bytes.Equal(same.Bytes(), data))
	}

	for _, tc := range []struct {
		name   string
		tokens []string
		format uint32
	}{{"other tokens", []string{"c"}, snapshotFormatTokens}, {"no tokens", nil, snapshotFormat}} {
		t.Run(tc.name, func(t *testing.T) {
			current := newLog(t)
			for _, a := range tc.tokens {
				current.apply(time.Millisecond, createToken(a, "secret-"+a, "admin"))
			}
			var out bytes.Buffer
			if _, err := current.f.WriteSnapshotWithTokens(&out, bytes.NewReader(data)); err != nil {
				t.Fatal(err)
			}
			if got := binary.LittleEndian.Uint32(out.Bytes()[4:]); got != tc.format {
				t.Errorf("format %d, want %d", got, tc.format)
			}
			restored := New(Options{})
			if err := restored.Restore(io.NopCloser(bytes.NewReader(out.Bytes()))); err != nil {
				t.Fatalf("the rewritten snapshot does not restore: %v", err)
			}
			if got := accessors(restored); !slices.Equal(got, tc.tokens) {
				t.Errorf("tokens %v, want the current ones %v", got, tc.tokens)
			}
			if restored.Stats() != saved.f.Stats() || restored.AppliedIndex() != saved.f.AppliedIndex() || restored.Clock() != saved.f.Clock() {
				t.Errorf("state other than tokens changed: %+v applied %d, want %+v applied %d",
					restored.Stats(), restored.AppliedIndex(), saved.f.Stats(), saved.f.AppliedIndex())
			}
		})
	}

	// A damaged file is refused.
	bad := slices.Clone(data)
	bad[len(bad)/2] ^= 0xff
	if _, err := saved.f.WriteSnapshotWithTokens(io.Discard, bytes.NewReader(bad)); err == nil {
		t.Fatal("a corrupt snapshot was rewritten without an error")
	}
}
