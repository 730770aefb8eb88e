package fsm

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	"github.com/quotad/quotad/auth"
)

func revokeCertSHA(der string) *fsmv1.Op {
	h := sha256.Sum256([]byte(der))
	return &fsmv1.Op{Op: &fsmv1.Op_RevokeCert{RevokeCert: &fsmv1.RevokeCert{Sha256: h[:], Subject: der, RevokedBy: "bootstrap", RevokedUnixMs: 99}}}
}

func revokeCertSerial(serial string) *fsmv1.Op {
	return &fsmv1.Op{Op: &fsmv1.Op_RevokeCert{RevokeCert: &fsmv1.RevokeCert{Serial: serial, RevokedBy: "bootstrap"}}}
}

func keyOf(der, serial string) auth.CertKey {
	return auth.CertKey{SHA256: sha256.Sum256([]byte(der)), Serial: serial}
}

// TestRevokeCertByCommandVersion: a RevokeCert in a version 7 entry (which no version 7
// leader could write, and a version 7 node would stop at) is refused and changes nothing,
// the state hash included; in a version 8 entry it is stored.
func TestRevokeCertByCommandVersion(t *testing.T) {
	l := newLog(t)
	l.version = CertRevokeVersion - 1
	err := l.apply(time.Second, revokeCertSHA("leaked")).Ops[0].Other.Err
	if !errors.Is(err, ErrInvalidCertRevoke) || l.f.CertRevoked(keyOf("leaked", "1")) || l.f.AnyCertRevoked() {
		t.Fatalf("version 7 RevokeCert: err %v, revoked %v", err, l.f.CertRevoked(keyOf("leaked", "1")))
	}
	l2 := newLog(t)
	l2.version = CertRevokeVersion - 1
	l2.apply(time.Second)
	if l.f.Hash().Hash != l2.f.Hash().Hash {
		t.Fatal("a refused RevokeCert changed the state hash")
	}
	l.version = CertRevokeVersion
	if err := l.apply(time.Second, revokeCertSHA("leaked")).Ops[0].Other.Err; err != nil {
		t.Fatal(err)
	}
	if !l.f.CertRevoked(keyOf("leaked", "1")) || l.f.CertRevoked(keyOf("other", "1")) {
		t.Fatal("version 8 RevokeCert: the deny-list does not say leaked only")
	}
}

// TestRevokeCerts: by fingerprint and by serial; a duplicate and invalid ops change nothing
// (nor the generation); the deny-list travels in snapshots (format 3) and the state hash; a
// state without revocations keeps writing the older formats.
func TestRevokeCerts(t *testing.T) {
	l := newLog(t)
	l.apply(time.Second, createToken("a", "secret-a", "admin"))
	if b := snapshotBytes(t, l.f); binary.LittleEndian.Uint32(b[4:]) != snapshotFormatTokens {
		t.Fatal("a state with tokens and no revoked certificate must write format 2")
	}
	noCerts := l.f.Hash().Hash
	for _, op := range []*fsmv1.Op{revokeCertSHA("leaked"), revokeCertSerial("1f")} {
		if err := l.apply(time.Second, op).Ops[0].Other.Err; err != nil {
			t.Fatal(err)
		}
	}
	gen := l.f.CertsGeneration()
	for name, op := range map[string]*fsmv1.Op{
		"duplicate sha": revokeCertSHA("leaked"), "duplicate serial": revokeCertSerial("1f"),
		"both":         {Op: &fsmv1.Op_RevokeCert{RevokeCert: &fsmv1.RevokeCert{Sha256: make([]byte, 32), Serial: "1"}}},
		"neither":      {Op: &fsmv1.Op_RevokeCert{RevokeCert: &fsmv1.RevokeCert{}}},
		"short sha":    {Op: &fsmv1.Op_RevokeCert{RevokeCert: &fsmv1.RevokeCert{Sha256: make([]byte, 31)}}},
		"serial 0-led": revokeCertSerial("01f"), "serial upper": revokeCertSerial("1F"),
	} {
		if err := l.apply(time.Second, op).Ops[0].Other.Err; err == nil {
			t.Errorf("%s: applied", name)
		} else if name[:3] == "dup" != errors.Is(err, ErrCertRevoked) {
			t.Errorf("%s: %v", name, err)
		}
	}
	if l.f.CertsGeneration() != gen || len(l.f.RevokedCerts()) != 2 {
		t.Fatalf("refused revokes changed the deny-list: %+v", l.f.RevokedCerts())
	}
	for _, tc := range []struct {
		k    auth.CertKey
		want bool
	}{{keyOf("leaked", "99"), true}, {keyOf("other", "1f"), true}, {keyOf("other", "1e"), false}, {keyOf("other", ""), false}} {
		if got := l.f.CertRevoked(tc.k); got != tc.want {
			t.Errorf("CertRevoked(%x…, serial %q) = %v", tc.k.SHA256[:4], tc.k.Serial, got)
		}
	}
	if l.f.Hash().Hash == noCerts {
		t.Fatal("the state hash does not cover the deny-list")
	}
	b := snapshotBytes(t, l.f)
	if binary.LittleEndian.Uint32(b[4:]) != snapshotFormatCerts {
		t.Fatal("a state with revoked certificates must write format 3")
	}
	r := New(Options{})
	if err := r.Restore(io.NopCloser(bytes.NewReader(b))); err != nil {
		t.Fatal(err)
	}
	if r.Hash() != l.f.Hash() || !r.CertRevoked(keyOf("leaked", "")) || len(r.Tokens()) != 1 {
		t.Fatalf("restored: %+v, want %+v", r.Hash(), l.f.Hash())
	}
	got := r.RevokedCerts()
	if got[1].Subject != "leaked" || got[1].RevokedBy != "bootstrap" || got[1].RevokedAt != 99 || got[0].Serial != "1f" { // by name: serial:… before sha256:…
		t.Fatalf("restored entries %+v", got)
	}
	// Revoked certificates but no token: format 3 with an empty tokens section.
	m := newLog(t)
	m.apply(time.Second, revokeCertSerial("abc"))
	r2 := New(Options{})
	if err := r2.Restore(io.NopCloser(bytes.NewReader(snapshotBytes(t, m.f)))); err != nil || r2.Hash() != m.f.Hash() || len(r2.Tokens()) != 0 {
		t.Fatalf("certs without tokens: %v", err)
	}
}

// TestRestoreKeepsRevokedCerts: the file a restore installs (WriteRestoreSnapshot) holds the
// cluster's revoked certificates and the file's, whether or not tokens are kept: a restore
// never takes a revoke back.
func TestRestoreKeepsRevokedCerts(t *testing.T) {
	saved := newLog(t)
	saved.apply(time.Second, revokeCertSerial("aa"), createToken("a", "secret-a", "admin"))
	file := snapshotBytes(t, saved.f)
	current := newLog(t)
	current.apply(time.Second, revokeCertSHA("leaked"))
	for _, keep := range []bool{true, false} {
		var out bytes.Buffer
		if _, err := current.f.WriteRestoreSnapshot(&out, bytes.NewReader(file), RestoreRewrite{KeepTokens: keep}); err != nil {
			t.Fatal(err)
		}
		r := New(Options{})
		if err := r.Restore(io.NopCloser(&out)); err != nil {
			t.Fatal(err)
		}
		if !r.CertRevoked(keyOf("leaked", "")) || !r.CertRevoked(keyOf("x", "aa")) || len(r.RevokedCerts()) != 2 {
			t.Errorf("keep tokens %v: restored deny-list %+v, want the current and the file's", keep, r.RevokedCerts())
		}
		if len(r.Tokens()) != map[bool]int{true: 0, false: 1}[keep] {
			t.Errorf("keep tokens %v: tokens %v", keep, accessors(r))
		}
	}
	// And a file from before revocations (format 1) onto a cluster with some.
	old := newLog(t)
	var out bytes.Buffer
	if _, err := current.f.WriteRestoreSnapshot(&out, bytes.NewReader(snapshotBytes(t, old.f)), RestoreRewrite{KeepTokens: true}); err != nil {
		t.Fatal(err)
	}
	r := New(Options{})
	if err := r.Restore(io.NopCloser(&out)); err != nil || !r.CertRevoked(keyOf("leaked", "")) {
		t.Fatalf("format 1 file: err %v, deny-list %+v", err, r.RevokedCerts())
	}
}

// manyCerts is a deny-list of n certificates named by fingerprint (prefix, i).
func manyCerts(prefix string, n int) *certSet {
	cs := make([]*RevokedCert, n)
	for i := range cs {
		cs[i] = &RevokedCert{HasSHA: true, SHA256: sha256.Sum256(fmt.Appendf(nil, "%s%d", prefix, i))}
	}
	return emptyCerts.with(cs...)
}

// TestCertDenyListCap: at MaxRevokedCerts a revoke is refused ErrCertDenyListFull (not
// "invalid"), changing nothing, with a remedy that works (replace the CA; the list is never
// pruned); a restore whose union of the cluster's and the file's deny-lists exceeds the cap
// is refused before anything is written (before, repeated restores grew the list without
// bound), and a snapshot whose certificates section claims more than the cap does not decode.
func TestCertDenyListCap(t *testing.T) {
	l := newLog(t)
	l.f.storeCerts(manyCerts("a", MaxRevokedCerts-1))
	if err := l.apply(time.Second, revokeCertSerial("1f")).Ops[0].Other.Err; err != nil {
		t.Fatalf("the last place: %v", err)
	}
	gen := l.f.CertsGeneration()
	err := l.apply(time.Second, revokeCertSerial("2f")).Ops[0].Other.Err
	if !errors.Is(err, ErrCertDenyListFull) || errors.Is(err, ErrInvalidCertRevoke) || !strings.Contains(err.Error(), "replace the CA") ||
		strings.Contains(err.Error(), "to drop them") {
		t.Fatalf("a revoke past the cap: %v", err)
	}
	if l.f.RevokedCertCount() != MaxRevokedCerts || l.f.CertsGeneration() != gen || l.f.CertRevoked(keyOf("x", "2f")) {
		t.Fatalf("a refused revoke changed the deny-list: %d entries", l.f.RevokedCertCount())
	}

	current := newLog(t)
	current.f.storeCerts(manyCerts("a", MaxRevokedCerts/2+1))
	disjoint, overlapping := newLog(t), newLog(t)
	disjoint.f.storeCerts(manyCerts("b", MaxRevokedCerts/2))
	overlapping.f.storeCerts(manyCerts("a", MaxRevokedCerts/2+1).with(manyCerts("c", 10).sorted()...))
	var out bytes.Buffer
	_, err = current.f.WriteRestoreSnapshot(&out, bytes.NewReader(snapshotBytes(t, disjoint.f)), RestoreRewrite{KeepTokens: true})
	if !errors.Is(err, ErrCertDenyListFull) || !strings.Contains(err.Error(), fmt.Sprint(MaxRevokedCerts+1)) {
		t.Fatalf("a restore past the cap: %v", err)
	}
	out.Reset()
	if _, err := current.f.WriteRestoreSnapshot(&out, bytes.NewReader(snapshotBytes(t, overlapping.f)), RestoreRewrite{KeepTokens: true}); err != nil {
		t.Fatalf("a restore within the cap (the file's entries mostly the cluster's): %v", err)
	}
	r := New(Options{})
	if err := r.Restore(io.NopCloser(&out)); err != nil || r.RevokedCertCount() != MaxRevokedCerts/2+11 {
		t.Fatalf("restored within the cap: %v, %d entries", err, r.RevokedCertCount())
	}

	over := newLog(t)
	over.f.storeCerts(manyCerts("a", MaxRevokedCerts+1))
	if err := New(Options{}).Restore(io.NopCloser(bytes.NewReader(snapshotBytes(t, over.f)))); err == nil || !strings.Contains(err.Error(), "at most") {
		t.Fatalf("a snapshot past the cap decoded: %v", err)
	}
}
