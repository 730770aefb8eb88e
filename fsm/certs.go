package fsm

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"slices"
	"strings"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	"github.com/quotad/quotad/auth"
)

// The certificate deny-list: certificates an admin revoked (command version 8). A node checks
// every call of a certificate caller against it (two map lookups, keyed by what the node
// computed once per connection: auth.CertKey), so, like the token table, it is immutable,
// published through an atomic pointer and replaced whole by the (rare) RevokeCert op and by
// a restore. Entries are never removed: a revoke is final (the certificate ends at its expiry
// anyway; issue a new one).

var (
	// ErrCertRevoked: a RevokeCert of a certificate already on the deny-list (nothing changed).
	ErrCertRevoked = errors.New("fsm: the certificate is already revoked")
	// ErrInvalidCertRevoke: a RevokeCert that names no certificate, or one that needs a newer
	// command version than its entry's.
	ErrInvalidCertRevoke = errors.New("fsm: invalid certificate revoke")
	// ErrCertDenyListFull: a RevokeCert, or a restore, that would put more than
	// MaxRevokedCerts certificates on the deny-list (nothing changed). Entries are never
	// dropped, so this is final for the cluster: cut further certificates off by replacing
	// the CA.
	ErrCertDenyListFull = errors.New("fsm: the certificate deny-list is full")
)

// CertRevokeVersion is the first command version whose nodes apply RevokeCert and enforce the
// deny-list. A leader writes RevokeCert only once every node advertises it (rpc RevokeCert).
const CertRevokeVersion = 8

// MaxRevokedCerts bounds the deny-list (a few hundred bytes per entry in every replica).
const MaxRevokedCerts = 10000

// RevokedCert is one entry of the deny-list. Exactly one of SHA256 (revoked by fingerprint or
// by its file) and Serial (revoked by serial number) names the certificate; the other fields
// describe it.
type RevokedCert struct {
	SHA256  [32]byte
	HasSHA  bool
	Serial  string // matched: set only for a revoke by serial
	Subject string
	// SerialInfo is the serial of a certificate revoked by its file: shown, not matched.
	SerialInfo string
	NotAfter   int64 // Unix ms, 0 if unknown
	RevokedBy  string
	RevokedAt  int64 // the leader's wall clock, Unix ms (carried in the op)
	Reason     string
}

// key is the entry's name: "sha256:<hex>" or "serial:<hex>" (also its sort order).
func (c *RevokedCert) key() string {
	if c.HasSHA {
		return "sha256:" + hex.EncodeToString(c.SHA256[:])
	}
	return "serial:" + c.Serial
}

// certSet is one immutable version of the deny-list.
type certSet struct {
	bySHA    map[[32]byte]*RevokedCert
	bySerial map[string]*RevokedCert
}

var emptyCerts = &certSet{bySHA: map[[32]byte]*RevokedCert{}, bySerial: map[string]*RevokedCert{}}

func (s *certSet) len() int { return len(s.bySHA) + len(s.bySerial) }

// find returns the stored entry of the same name as c.
func (s *certSet) find(c *RevokedCert) (*RevokedCert, bool) {
	if c.HasSHA {
		e, ok := s.bySHA[c.SHA256]
		return e, ok
	}
	e, ok := s.bySerial[c.Serial]
	return e, ok
}

func (s *certSet) with(cs ...*RevokedCert) *certSet {
	n := &certSet{bySHA: make(map[[32]byte]*RevokedCert, len(s.bySHA)+len(cs)), bySerial: make(map[string]*RevokedCert, len(s.bySerial)+len(cs))}
	for k, v := range s.bySHA {
		n.bySHA[k] = v
	}
	for k, v := range s.bySerial {
		n.bySerial[k] = v
	}
	for _, c := range cs {
		if _, dup := n.find(c); dup {
			continue // the first kept: the earlier revoke
		}
		if c.HasSHA {
			n.bySHA[c.SHA256] = c
		} else {
			n.bySerial[c.Serial] = c
		}
	}
	return n
}

// sorted returns the entries by name.
func (s *certSet) sorted() []*RevokedCert {
	out := make([]*RevokedCert, 0, s.len())
	for _, c := range s.bySHA {
		out = append(out, c)
	}
	for _, c := range s.bySerial {
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b *RevokedCert) int { return strings.Compare(a.key(), b.key()) })
	return out
}

// CertRevoked reports whether the certificate k is on the deny-list: by its fingerprint, or
// by its serial. It takes no lock (two map lookups): safe on every call.
func (f *FSM) CertRevoked(k auth.CertKey) bool {
	s := f.certs.Load()
	if len(s.bySHA) == 0 && len(s.bySerial) == 0 {
		return false
	}
	if _, ok := s.bySHA[k.SHA256]; ok {
		return true
	}
	_, ok := s.bySerial[k.Serial]
	return ok && k.Serial != ""
}

// AnyCertRevoked reports whether the deny-list holds any entry. It takes no lock.
func (f *FSM) AnyCertRevoked() bool { return f.certs.Load().len() > 0 }

// CertsGeneration changes whenever the deny-list is replaced (a revoke, a restore): a reader
// can tell cheaply that certificates it checked may be revoked since. This process's count,
// not replicated state.
func (f *FSM) CertsGeneration() uint64 { return f.certsGen.Load() }

func (f *FSM) storeCerts(s *certSet) {
	f.certs.Store(s)
	f.certsGen.Add(1)
}

// RevokedCerts lists the deny-list by name ("serial:<hex>" before "sha256:<hex>").
func (f *FSM) RevokedCerts() []RevokedCert {
	cs := f.certs.Load().sorted()
	out := make([]RevokedCert, len(cs))
	for i, c := range cs {
		out[i] = *c
	}
	return out
}

// RevokedCertOf returns the stored entry that names the same certificate as o (what a revoke
// of o would find already there).
func (f *FSM) RevokedCertOf(o *fsmv1.RevokeCert) (RevokedCert, bool) {
	c, err := certFromOp(o)
	if err != nil {
		return RevokedCert{}, false
	}
	e, ok := f.certs.Load().find(c)
	if !ok {
		return RevokedCert{}, false
	}
	return *e, true
}

// applyRevokeCert validates and stores a revoke. Invalid input, a revoke already stored and
// an entry older than CertRevokeVersion change nothing.
func (f *FSM) applyRevokeCert(o *fsmv1.RevokeCert) error {
	if f.scratch.version < CertRevokeVersion {
		return fmt.Errorf("%w: RevokeCert in a version %d entry; it needs command version %d", ErrInvalidCertRevoke, f.scratch.version, CertRevokeVersion)
	}
	c, err := certFromOp(o)
	if err != nil {
		return err
	}
	cur := f.certs.Load()
	if _, dup := cur.find(c); dup {
		return fmt.Errorf("%w: %s", ErrCertRevoked, c.key())
	}
	if cur.len() >= MaxRevokedCerts {
		return DenyListFull(cur.len())
	}
	f.storeCerts(cur.with(c))
	return nil
}

// DenyListFull is the refusal (ErrCertDenyListFull) of a revoke onto a deny-list of n entries.
func DenyListFull(n int) error {
	return fmt.Errorf("%w: it holds %d certificates, the most it keeps, and entries are never dropped; nothing changed — to cut this certificate off, replace the CA (docs/security.md, Rotating the CA without downtime)", ErrCertDenyListFull, n)
}

// RevokedCertCount is the number of entries on the deny-list. It takes no lock.
func (f *FSM) RevokedCertCount() int { return f.certs.Load().len() }

// certFromOp checks a RevokeCert op: replicas agree on the answer because it depends on the
// op alone.
func certFromOp(o *fsmv1.RevokeCert) (*RevokedCert, error) {
	c := &RevokedCert{Serial: o.Serial, Subject: o.Subject, SerialInfo: o.SerialInfo, NotAfter: o.NotAfterUnixMs,
		RevokedBy: o.RevokedBy, RevokedAt: o.RevokedUnixMs, Reason: o.Reason}
	switch {
	case (len(o.Sha256) == 0) == (o.Serial == ""):
		return nil, fmt.Errorf("%w: name the certificate by exactly one of its SHA-256 and its serial", ErrInvalidCertRevoke)
	case len(o.Sha256) != 0 && len(o.Sha256) != len(c.SHA256):
		return nil, fmt.Errorf("%w: sha256 is %d bytes; want %d", ErrInvalidCertRevoke, len(o.Sha256), len(c.SHA256))
	case o.Serial != "" && !canonicalSerial(o.Serial):
		return nil, fmt.Errorf("%w: serial %.80q is not lower-case hex without leading zeros", ErrInvalidCertRevoke, o.Serial)
	case len(o.Subject) > maxTokenField || len(o.SerialInfo) > maxTokenField || len(o.RevokedBy) > maxTokenField || len(o.Reason) > maxTokenField:
		return nil, fmt.Errorf("%w: subject, serial, revoked_by and reason must be at most %d bytes", ErrInvalidCertRevoke, maxTokenField)
	}
	if len(o.Sha256) != 0 {
		c.HasSHA = true
		copy(c.SHA256[:], o.Sha256)
	}
	return c, nil
}

func canonicalSerial(s string) bool {
	if s == "" || len(s) > 64 || s[0] == '0' {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !(s[i] >= '0' && s[i] <= '9' || s[i] >= 'a' && s[i] <= 'f') {
			return false
		}
	}
	return true
}

// appendTo encodes the certificates section of a snapshot (sorted by name, so the bytes are a
// function of the deny-list).
func (s *certSet) appendTo(b []byte) []byte {
	cs := s.sorted()
	b = binary.AppendUvarint(b, uint64(len(cs)))
	for _, c := range cs {
		sha := []byte(nil)
		if c.HasSHA {
			sha = c.SHA256[:]
		}
		b = appendString(b, string(sha))
		for _, f := range []string{c.Serial, c.Subject, c.SerialInfo, c.RevokedBy, c.Reason} {
			b = appendString(b, f)
		}
		b = binary.AppendVarint(b, c.NotAfter)
		b = binary.AppendVarint(b, c.RevokedAt)
	}
	return b
}

// hashInto folds the deny-list into the state hash, as the snapshot writes it.
func (s *certSet) hashInto(h hash.Hash64) {
	if s.len() > 0 { // folded in only when present: a state without revocations hashes as before
		h.Write([]byte("certs"))
		h.Write(s.appendTo(nil))
	}
}

// decodeCerts reads a certificates section, validating each entry as RevokeCert would.
func decodeCerts(b []byte) (*certSet, error) {
	fail := func(format string, args ...any) (*certSet, error) {
		return nil, fmt.Errorf("fsm: snapshot certificates section malformed: "+format, args...)
	}
	str := func() (string, bool) {
		n, k := binary.Uvarint(b)
		if k <= 0 || n > uint64(len(b)-k) {
			return "", false
		}
		s := string(b[k : k+int(n)])
		b = b[k+int(n):]
		return s, true
	}
	n, k := binary.Uvarint(b)
	if k <= 0 || n > uint64(len(b)) {
		return fail("bad count")
	}
	if n > MaxRevokedCerts {
		return fail("%d certificates; a deny-list holds at most %d", n, MaxRevokedCerts)
	}
	b = b[k:]
	var cs []*RevokedCert
	for i := uint64(0); i < n; i++ {
		o := &fsmv1.RevokeCert{}
		sha, ok := str()
		if ok && sha != "" {
			o.Sha256 = []byte(sha)
		}
		for _, p := range []*string{&o.Serial, &o.Subject, &o.SerialInfo, &o.RevokedBy, &o.Reason} {
			if ok {
				*p, ok = str()
			}
		}
		if !ok {
			return fail("certificate #%d truncated", i)
		}
		var k1, k2 int
		o.NotAfterUnixMs, k1 = binary.Varint(b)
		if k1 > 0 {
			o.RevokedUnixMs, k2 = binary.Varint(b[k1:])
		}
		if k1 <= 0 || k2 <= 0 {
			return fail("certificate #%d truncated", i)
		}
		b = b[k1+k2:]
		c, err := certFromOp(o)
		if err != nil {
			return fail("certificate #%d: %v", i, err)
		}
		cs = append(cs, c)
	}
	if len(b) != 0 {
		return fail("%d trailing bytes", len(b))
	}
	set := emptyCerts.with(cs...)
	if set.len() != len(cs) {
		return fail("a certificate appears twice")
	}
	return set, nil
}

// unionCerts is the deny-list a restore installs: the cluster's current one and the file's
// (encoded sections; nil is empty). A restore never takes a revoke back.
func unionCerts(current *certSet, file []byte) ([]byte, error) {
	if file == nil {
		if current.len() == 0 {
			return nil, nil
		}
		return current.appendTo(nil), nil
	}
	fs, err := decodeCerts(file)
	if err != nil {
		return nil, err
	}
	u := current.with(fs.sorted()...)
	if u.len() > MaxRevokedCerts {
		return nil, fmt.Errorf("%w: the restore would hold %d revoked certificates (the cluster's %d and the file's %d, %d of them in both), more than the %d it keeps; a restore never drops a revoke, so nothing was restored — restore a file whose revocations the cluster already holds, or rebuild the cluster",
			ErrCertDenyListFull, u.len(), current.len(), fs.len(), current.len()+fs.len()-u.len(), MaxRevokedCerts)
	}
	if u.len() == 0 {
		return nil, nil
	}
	return u.appendTo(nil), nil
}
