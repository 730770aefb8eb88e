package fsm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"slices"
	"strings"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	"github.com/quotad/quotad/auth"
)

// The token table: bearer tokens an admin created, stored as their SHA-256 only (the secret
// never enters the log or a snapshot). Every gRPC call with a bearer token looks its hash up,
// so reads must cost nothing: the table is immutable, published through an atomic pointer,
// and replaced whole by the (rare) CreateToken and RevokeToken ops.

var (
	// ErrTokenExists: a CreateToken whose accessor or hash is already stored.
	ErrTokenExists = errors.New("fsm: a token with that accessor or hash exists")
	// ErrTokenNotFound: a RevokeToken of an accessor that is not stored.
	ErrTokenNotFound = errors.New("fsm: no token with that accessor")
	// ErrInvalidToken: a CreateToken that does not describe a usable token.
	ErrInvalidToken = errors.New("fsm: invalid token")
)

// MaxTokens bounds the token table (each token is a few hundred bytes in every replica).
const MaxTokens = 10000

// Token is a stored token: everything but the secret.
type Token struct {
	Accessor    string
	Hash        [32]byte
	Role        auth.Role
	Domains     []string
	Tenant      string
	Description string
	// Created is the leader's wall clock at creation, in Unix milliseconds (carried in the op:
	// the FSM reads no clock).
	Created int64
}

// TokenIdentityPrefix starts the identity name of a call carrying a token: the accessor follows.
const TokenIdentityPrefix = "token:"

// Identity is the identity a call carrying the token has.
func (t *Token) Identity() auth.Identity {
	return auth.Identity{Name: TokenIdentityPrefix + t.Accessor, Role: t.Role, Domains: t.Domains, Tenant: t.Tenant}
}

// tokenSet is one immutable version of the table.
type tokenSet struct {
	byAccessor map[string]*Token
	byHash     map[[32]byte]*Token
}

var emptyTokens = &tokenSet{byAccessor: map[string]*Token{}, byHash: map[[32]byte]*Token{}}

func (s *tokenSet) with(t *Token) *tokenSet {
	n := &tokenSet{byAccessor: make(map[string]*Token, len(s.byAccessor)+1), byHash: make(map[[32]byte]*Token, len(s.byHash)+1)}
	for k, v := range s.byAccessor {
		n.byAccessor[k] = v
	}
	for k, v := range s.byHash {
		n.byHash[k] = v
	}
	n.byAccessor[t.Accessor], n.byHash[t.Hash] = t, t
	return n
}

func (s *tokenSet) without(accessor string) *tokenSet {
	n := &tokenSet{byAccessor: make(map[string]*Token, len(s.byAccessor)), byHash: make(map[[32]byte]*Token, len(s.byHash))}
	for k, v := range s.byAccessor {
		if k != accessor {
			n.byAccessor[k], n.byHash[v.Hash] = v, v
		}
	}
	return n
}

// sorted returns the tokens by accessor.
func (s *tokenSet) sorted() []*Token {
	out := make([]*Token, 0, len(s.byAccessor))
	for _, t := range s.byAccessor {
		out = append(out, t)
	}
	slices.SortFunc(out, func(a, b *Token) int { return strings.Compare(a.Accessor, b.Accessor) })
	return out
}

// TokenByHash returns the token whose hash is h. It takes no lock: safe on every call.
func (f *FSM) TokenByHash(h [32]byte) (Token, bool) {
	t, ok := f.tokens.Load().byHash[h]
	if !ok {
		return Token{}, false
	}
	return *t, true
}

// TokenStored reports whether a token with this accessor is stored (not revoked). It takes no
// lock.
func (f *FSM) TokenStored(accessor string) bool {
	_, ok := f.tokens.Load().byAccessor[accessor]
	return ok
}

// TokensGeneration changes whenever the token table is replaced (a token created or revoked,
// a snapshot restored), so a reader can tell cheaply that tokens it checked may be gone. It
// is this process's count, not replicated state: replicas differ.
func (f *FSM) TokensGeneration() uint64 { return f.tokensGen.Load() }

func (f *FSM) storeTokens(s *tokenSet) {
	f.tokens.Store(s)
	f.tokensGen.Add(1)
}

// Tokens lists the stored tokens by accessor.
func (f *FSM) Tokens() []Token {
	ts := f.tokens.Load().sorted()
	out := make([]Token, len(ts))
	for i, t := range ts {
		out[i] = *t
	}
	return out
}

// applyCreateToken validates and stores a token. Invalid input changes nothing.
func (f *FSM) applyCreateToken(o *fsmv1.CreateToken) error {
	t, err := tokenFromOp(o)
	if err != nil {
		return err
	}
	t.Created = o.CreatedUnixMs
	cur := f.tokens.Load()
	if _, dup := cur.byAccessor[t.Accessor]; dup {
		return fmt.Errorf("%w: accessor %q", ErrTokenExists, t.Accessor)
	}
	if _, dup := cur.byHash[t.Hash]; dup {
		return fmt.Errorf("%w: the same token was stored under another accessor", ErrTokenExists)
	}
	if len(cur.byAccessor) >= MaxTokens {
		return fmt.Errorf("%w: the cluster holds %d tokens, the most it keeps; revoke unused ones (quotad token list / revoke)", ErrInvalidToken, MaxTokens)
	}
	f.storeTokens(cur.with(t))
	return nil
}

func (f *FSM) applyRevokeToken(o *fsmv1.RevokeToken) error {
	cur := f.tokens.Load()
	if _, ok := cur.byAccessor[o.Accessor]; !ok {
		return fmt.Errorf("%w %q", ErrTokenNotFound, o.Accessor)
	}
	f.storeTokens(cur.without(o.Accessor))
	return nil
}

// Bounds of a token's fields.
const (
	maxTokenField   = 256
	maxTokenDomains = 64
)

// tokenFromOp checks a CreateToken op: replicas agree on the answer because it depends on the
// op alone.
func tokenFromOp(o *fsmv1.CreateToken) (*Token, error) {
	role, err := auth.ParseRole(o.Role)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidToken, err)
	}
	t := &Token{Accessor: o.Accessor, Role: role, Domains: slices.Clone(o.Domains), Tenant: o.Tenant, Description: o.Description}
	switch {
	case o.Accessor == "" || len(o.Accessor) > maxTokenField:
		return nil, fmt.Errorf("%w: accessor is %d bytes; want 1 to %d", ErrInvalidToken, len(o.Accessor), maxTokenField)
	case len(o.Hash) != len(t.Hash):
		return nil, fmt.Errorf("%w: hash is %d bytes; want %d (SHA-256)", ErrInvalidToken, len(o.Hash), len(t.Hash))
	case len(o.Tenant) > maxTokenField || len(o.Description) > maxTokenField:
		return nil, fmt.Errorf("%w: tenant and description must be at most %d bytes", ErrInvalidToken, maxTokenField)
	case role == auth.RoleWorker && len(o.Domains) == 0:
		return nil, fmt.Errorf("%w: a worker token needs at least one domain (\"*\" for all)", ErrInvalidToken)
	case role != auth.RoleWorker && (len(o.Domains) > 0 || o.Tenant != ""):
		return nil, fmt.Errorf("%w: domains and tenant scope workers only; a token of role %s may not have them", ErrInvalidToken, role)
	case len(o.Domains) > maxTokenDomains:
		return nil, fmt.Errorf("%w: %d domains; at most %d (or \"*\")", ErrInvalidToken, len(o.Domains), maxTokenDomains)
	}
	for i, d := range o.Domains {
		if d == "" || len(d) > maxTokenField {
			return nil, fmt.Errorf("%w: domains[%d] is %d bytes; want 1 to %d", ErrInvalidToken, i, len(d), maxTokenField)
		}
	}
	copy(t.Hash[:], o.Hash)
	return t, nil
}

// appendTokens encodes the token section of a snapshot (sorted by accessor, so the bytes are
// a function of the table).
func (s *tokenSet) appendTo(b []byte) []byte {
	ts := s.sorted()
	b = binary.AppendUvarint(b, uint64(len(ts)))
	for _, t := range ts {
		b = appendString(b, t.Accessor)
		b = append(b, t.Hash[:]...)
		b = appendString(b, string(t.Role))
		b = binary.AppendUvarint(b, uint64(len(t.Domains)))
		for _, d := range t.Domains {
			b = appendString(b, d)
		}
		b = appendString(b, t.Tenant)
		b = appendString(b, t.Description)
		b = binary.AppendVarint(b, t.Created)
	}
	return b
}

// hashInto folds the tokens into the state hash, as the snapshot writes them.
func (s *tokenSet) hashInto(h hash.Hash64) {
	if len(s.byAccessor) > 0 { // folded in only when present: a state without tokens hashes as before
		h.Write(s.appendTo(nil))
	}
}

// decodeTokens reads a token section, validating each token as CreateToken would.
func decodeTokens(b []byte) (*tokenSet, error) {
	fail := func(format string, args ...any) (*tokenSet, error) {
		return nil, fmt.Errorf("fsm: snapshot tokens section malformed: "+format, args...)
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
	b = b[k:]
	set := &tokenSet{byAccessor: make(map[string]*Token, n), byHash: make(map[[32]byte]*Token, n)}
	for i := uint64(0); i < n; i++ {
		o := &fsmv1.CreateToken{}
		var ok bool
		if o.Accessor, ok = str(); !ok || len(b) < 32 {
			return fail("token #%d truncated", i)
		}
		o.Hash, b = slices.Clone(b[:32]), b[32:]
		if o.Role, ok = str(); !ok {
			return fail("token #%d truncated", i)
		}
		nd, k := binary.Uvarint(b)
		if k <= 0 || nd > uint64(len(b)) {
			return fail("token #%d: bad domain count", i)
		}
		b = b[k:]
		for j := uint64(0); j < nd; j++ {
			d, ok := str()
			if !ok {
				return fail("token #%d truncated", i)
			}
			o.Domains = append(o.Domains, d)
		}
		if o.Tenant, ok = str(); !ok {
			return fail("token #%d truncated", i)
		}
		if o.Description, ok = str(); !ok {
			return fail("token #%d truncated", i)
		}
		created, k := binary.Varint(b)
		if k <= 0 {
			return fail("token #%d truncated", i)
		}
		b = b[k:]
		t, err := tokenFromOp(o)
		if err != nil {
			return fail("token #%d: %v", i, err)
		}
		if _, dup := set.byAccessor[t.Accessor]; dup {
			return fail("token %q appears twice", t.Accessor)
		}
		if _, dup := set.byHash[t.Hash]; dup {
			return fail("token %q: hash appears twice", t.Accessor)
		}
		t.Created = created
		set.byAccessor[t.Accessor], set.byHash[t.Hash] = t, t
	}
	if len(b) != 0 {
		return fail("%d trailing bytes", len(b))
	}
	return set, nil
}
