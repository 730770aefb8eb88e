package fsm

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"testing"
	"time"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/quota"
)

func ownedAcquire(owner, client string, id uint64, tenant string) *fsmv1.Op {
	op := acquire(client, id, tenant, 1)
	op.GetAcquire().Owner = owner
	return op
}

func release(owner string, lease uint64) *fsmv1.Op {
	return &fsmv1.Op{Op: &fsmv1.Op_Release{Release: &fsmv1.Release{LeaseId: lease, Owner: owner}}}
}

func refund(owner, client string, id uint64) *fsmv1.Op {
	return &fsmv1.Op{Op: &fsmv1.Op_Refund{Refund: &fsmv1.Refund{ClientId: client, RequestId: id, Owner: owner}}}
}

// TestOwnersNamespaceRequestsAndLeases: the same (client_id, request_id) of two owners are
// two decisions; one owner can neither refund nor release what the other took; the empty
// owner (admin) may release any lease.
func TestOwnersNamespaceRequestsAndLeases(t *testing.T) {
	l := newLog(t)
	a := l.apply(time.Millisecond, ownedAcquire("token:alice", "c", 1, "acme")).Ops[0]
	b := l.apply(2*time.Millisecond, ownedAcquire("token:bob", "c", 1, "acme")).Ops[0]
	if !a.Decision.Admitted || !b.Decision.Admitted || b.Duplicate || a.Decision.LeaseID == b.Decision.LeaseID {
		t.Fatalf("two owners, one request ID: %+v %+v; want two decisions", a, b)
	}
	if r := l.apply(3*time.Millisecond, ownedAcquire("token:alice", "c", 1, "acme")).Ops[0]; !r.Duplicate || r.Decision.LeaseID != a.Decision.LeaseID {
		t.Fatalf("alice's retry: %+v", r)
	}
	before := l.f.Hash().Hash
	// Bob's request is the last debit, so it can be refunded — by bob only.
	if r := l.apply(3*time.Millisecond, refund("token:mallory", "c", 1)).Ops[0].Other; r.Refunded != 0 || r.RefundOutcome != RefundNotFound {
		t.Fatalf("mallory refunded bob's request: %+v", r)
	}
	r := l.apply(3*time.Millisecond, release("token:mallory", a.Decision.LeaseID)).Ops[0].Other
	if r.Released || !errors.Is(r.Err, quota.ErrNotOwner) {
		t.Fatalf("mallory released alice's lease: %+v", r)
	}
	if l.f.Hash().Hash != before {
		t.Fatal("refused refund and release changed state")
	}
	if r := l.apply(4*time.Millisecond, refund("token:bob", "c", 1)).Ops[0].Other; r.Refunded != 1 || r.RefundOutcome != RefundRefunded {
		t.Fatalf("bob's own refund: %+v", r)
	}
	if r := l.apply(4*time.Millisecond, release("token:alice", a.Decision.LeaseID)).Ops[0].Other; !r.Released || r.Err != nil {
		t.Fatalf("alice's own release: %+v", r)
	}
	if r := l.apply(4*time.Millisecond, release("", b.Decision.LeaseID)).Ops[0].Other; !r.Released || r.Err != nil {
		t.Fatalf("admin release of bob's lease: %+v", r)
	}
	if !l.f.Remembers("token:bob", "c", 1) || l.f.Remembers("token:carol", "c", 1) || l.f.Remembers("", "c", 1) {
		t.Fatal("Remembers ignores the owner")
	}
}

// TestOwnedAcquireEncoding: the fast encoder writes what proto.Marshal writes, and the fast
// decoder reads the owner.
func TestOwnedAcquireEncoding(t *testing.T) {
	adm := &quotadv1.Admission{RequestId: 7, Domain: "provider", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}}
	want, err := EncodeOp(&fsmv1.Op{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{ClientId: "c", Admission: adm, Owner: "token:alice"}}})
	if err != nil {
		t.Fatal(err)
	}
	got := AppendOwnedAcquireOp(nil, "token:alice", "c", adm)
	if !bytes.Equal(got, want) {
		t.Fatalf("AppendOwnedAcquireOp = %x, proto.Marshal = %x", got, want)
	}
	if n := len(got) - len(AppendAcquireOp(nil, "c", adm)); n != 2+len("token:alice") {
		t.Fatalf("the owner costs %d bytes per op", n)
	}
	acq, ok, err := splitOp(got)
	var a acquireOp
	var it internTable
	if err != nil || !ok || decodeAcquire(acq, &a, it.get) != nil || a.req.Owner != "token:alice" || a.clientID != ownedClient("token:alice", "c") {
		t.Fatalf("decoded %+v (%v)", a, err)
	}
}

func createToken(accessor string, secret string, role string, domains ...string) *fsmv1.Op {
	h := auth.HashToken(secret)
	return &fsmv1.Op{Op: &fsmv1.Op_CreateToken{CreateToken: &fsmv1.CreateToken{Accessor: accessor, Hash: h[:], Role: role, Domains: domains, CreatedUnixMs: 1234}}}
}

// TestTokens: create, look up by hash, refuse invalid and duplicate tokens without a change,
// revoke; tokens travel in snapshots (format 2) and in the state hash; a state without tokens
// still writes format 1.
func TestTokens(t *testing.T) {
	l := newLog(t)
	if b := snapshotBytes(t, l.f); binary.LittleEndian.Uint32(b[4:]) != snapshotFormat {
		t.Fatal("a state without tokens must write snapshot format 1")
	}
	empty := l.f.Hash().Hash
	res := l.apply(time.Second, createToken("acc1", "secret1", "worker", "provider"), createToken("acc2", "secret2", "admin"),
		createToken("acc3", "secret3", "worker"), createToken("acc1", "other", "reader"), createToken("acc4", "secret1", "reader"),
		createToken("acc5", "secret5", "server"), createToken("acc6", "secret6", "reader", "provider"))
	for i, wantErr := range []error{nil, nil, ErrInvalidToken, ErrTokenExists, ErrTokenExists, ErrInvalidToken, ErrInvalidToken} {
		if err := res.Ops[i].Other.Err; !errors.Is(err, wantErr) || (wantErr == nil && err != nil) {
			t.Fatalf("create #%d: %v, want %v", i, err, wantErr)
		}
	}
	tok, ok := l.f.TokenByHash(auth.HashToken("secret1"))
	if !ok || tok.Accessor != "acc1" || tok.Role != auth.RoleWorker || tok.Created != 1234 {
		t.Fatalf("lookup: %+v %v", tok, ok)
	}
	if id := tok.Identity(); id.Name != "token:acc1" || !id.MayUseDomain("provider") || id.MayUseDomain("other") {
		t.Fatalf("identity %v", id)
	}
	if ts := l.f.Tokens(); len(ts) != 2 || ts[0].Accessor != "acc1" || ts[1].Accessor != "acc2" {
		t.Fatalf("list: %+v", ts)
	}
	withTokens := l.f.Hash()
	if withTokens.Hash == empty {
		t.Fatal("tokens are not in the state hash")
	}

	// Snapshot and restore into a fresh FSM.
	data := snapshotBytes(t, l.f)
	if binary.LittleEndian.Uint32(data[4:]) != snapshotFormatTokens {
		t.Fatal("tokens must be written as snapshot format 2")
	}
	r := New(Options{})
	if err := r.Restore(io.NopCloser(bytes.NewReader(data))); err != nil {
		t.Fatal(err)
	}
	if r.Hash() != withTokens {
		t.Fatal("restored hash differs")
	}
	if _, ok := r.TokenByHash(auth.HashToken("secret2")); !ok {
		t.Fatal("restore lost a token")
	}
	// A damaged tokens section is refused, and the FSM keeps its state.
	bad := bytes.Clone(data)
	engineLen := binary.LittleEndian.Uint64(bad[snapshotHeader-8:])
	bad[snapshotHeader+int(engineLen)+8] = 0x7f // the token count
	if err := r.Restore(io.NopCloser(bytes.NewReader(bad))); err == nil {
		t.Fatal("restored a damaged tokens section")
	}
	if r.Hash() != withTokens {
		t.Fatal("a refused restore changed state")
	}

	// Revoke.
	res = l.apply(2*time.Second, &fsmv1.Op{Op: &fsmv1.Op_RevokeToken{RevokeToken: &fsmv1.RevokeToken{Accessor: "acc1"}}},
		&fsmv1.Op{Op: &fsmv1.Op_RevokeToken{RevokeToken: &fsmv1.RevokeToken{Accessor: "acc1"}}})
	if res.Ops[0].Other.Err != nil || !errors.Is(res.Ops[1].Other.Err, ErrTokenNotFound) {
		t.Fatalf("revoke: %v, %v", res.Ops[0].Other.Err, res.Ops[1].Other.Err)
	}
	if _, ok := l.f.TokenByHash(auth.HashToken("secret1")); ok {
		t.Fatal("a revoked token is still found")
	}
}

func TestLiftPause(t *testing.T) {
	l := newLog(t)
	fb := &fsmv1.Op{Op: &fsmv1.Op_Feedback{Feedback: &fsmv1.Feedback{Domain: "provider", StatusCode: 429, RetryAfterNs: int64(time.Minute), Reason: "global"}}}
	lift := &fsmv1.Op{Op: &fsmv1.Op_LiftPause{LiftPause: &fsmv1.LiftPause{Domain: "provider"}}}
	if r := l.apply(time.Second, fb).Ops[0].Other; r.PausedFor != time.Minute {
		t.Fatalf("feedback: %+v", r)
	}
	if d := l.apply(time.Second, acquire("c", 1, "acme", 1)).Ops[0].Decision; d.Reason != quota.ReasonPaused {
		t.Fatalf("paused domain admitted: %+v", d)
	}
	if r := l.apply(2*time.Second, lift, lift).Ops; !r[0].Other.Lifted || r[1].Other.Lifted {
		t.Fatalf("lift: %+v %+v", r[0].Other, r[1].Other)
	}
	if d := l.apply(2*time.Second, acquire("c", 2, "acme", 1)).Ops[0].Decision; !d.Admitted {
		t.Fatalf("after lift: %+v", d)
	}
	bad := &fsmv1.Op{Op: &fsmv1.Op_LiftPause{LiftPause: &fsmv1.LiftPause{Domain: "nope"}}}
	if r := l.apply(2*time.Second, bad).Ops[0].Other; r.Err == nil {
		t.Fatal("lift in an unknown domain")
	}
}
