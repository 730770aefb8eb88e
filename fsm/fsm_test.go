package fsm

import (
	"bytes"
	"encoding/json"
	"io"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/quota"
)

var testLimits = &quota.Limits{Domains: []quota.Domain{{
	Name: "provider",
	Rate: &quota.Rate{Unit: time.Second, RequestsPerUnit: 10, Burst: 5},
	Descriptors: []quota.Node{{
		Key:         "tenant",
		Rate:        &quota.Rate{Unit: time.Second, RequestsPerUnit: 2, Burst: 3},
		Concurrency: &quota.Concurrency{MaxInFlight: 2, LeaseTTL: 5 * time.Second},
	}},
}}}

// log feeds commands to an FSM as raft would, with consecutive indexes.
type log struct {
	t     *testing.T
	f     *FSM
	index uint64
	// version, if set, is written into the commands instead of CommandVersion (what an
	// older leader's entries look like).
	version uint32
}

func (l *log) apply(ts time.Duration, ops ...*fsmv1.Op) *Result {
	l.t.Helper()
	cmd := &fsmv1.Command{Ts: int64(ts), Ops: ops}
	data, err := Encode(cmd)
	if l.version != 0 && err == nil {
		cmd.Version = l.version
		data, err = proto.Marshal(cmd)
	}
	if err != nil {
		l.t.Fatal(err)
	}
	l.index++
	out := l.f.Apply(&raft.Log{Index: l.index, Term: 1, Type: raft.LogCommand, Data: data})
	res, ok := out.(*Result)
	if !ok {
		l.t.Fatalf("Apply returned %T", out)
	}
	return res
}

func setLimits(t *testing.T, l *quota.Limits) *fsmv1.Op {
	data, err := json.Marshal(l)
	if err != nil {
		t.Fatal(err)
	}
	return &fsmv1.Op{Op: &fsmv1.Op_SetLimits{SetLimits: &fsmv1.SetLimits{LimitsJson: data}}}
}

func acquire(client string, id uint64, tenant string, cost uint64) *fsmv1.Op {
	return &fsmv1.Op{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{ClientId: client, Admission: &quotadv1.Admission{
		RequestId: id, Domain: "provider", Cost: cost,
		Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tenant}},
	}}}}
}

func newLog(t *testing.T) *log {
	l := &log{t: t, f: New(Options{DedupWindow: 10 * time.Second})}
	if r := l.apply(0, setLimits(t, testLimits)); r.Ops[0].Other.Err != nil {
		t.Fatal(r.Ops[0].Other.Err)
	}
	return l
}

func TestRetryReturnsOriginalDecisionDebitedOnce(t *testing.T) {
	l := newLog(t)
	first := l.apply(time.Millisecond, acquire("c1", 1, "acme", 2)).Ops[0]
	if !first.Decision.Admitted || first.Duplicate {
		t.Fatalf("first acquire: %+v", first)
	}
	retry := l.apply(2*time.Millisecond, acquire("c1", 1, "acme", 2)).Ops[0]
	if !retry.Duplicate || retry.Decision.LeaseID != first.Decision.LeaseID || retry.Decision.Remaining != first.Decision.Remaining {
		t.Fatalf("retry got %+v, want the original %+v", retry, first)
	}
	// Only one debit: tenant burst 3 - 2 = 1 left, so cost 1 passes and a further cost 1 fails.
	if d := l.apply(3*time.Millisecond, acquire("c1", 2, "acme", 1)).Ops[0].Decision; !d.Admitted {
		t.Fatalf("second distinct request denied (%s): the retry was debited twice", d.Reason)
	}
	// Another client with the same request ID is a different request.
	if d := l.apply(4*time.Millisecond, acquire("c2", 1, "acme", 1)).Ops[0].Decision; d.Admitted {
		t.Fatalf("bucket should be empty, got %+v", d)
	}
}

func TestDedupExpiresByFSMTime(t *testing.T) {
	l := newLog(t)
	l.apply(time.Second, acquire("c1", 7, "acme", 1))
	if got := l.f.Stats().DedupEntries; got != 1 {
		t.Fatalf("dedup entries = %d, want 1", got)
	}
	r := l.apply(12*time.Second, acquire("c1", 7, "acme", 1)).Ops[0]
	if r.Duplicate {
		t.Fatal("a retry after the dedup window was answered from the table")
	}
}

func TestTimeNeverGoesBackwards(t *testing.T) {
	l := newLog(t)
	l.apply(10*time.Second, acquire("c1", 1, "acme", 3))
	// A stale timestamp (e.g. from a leader whose clock lags) is applied at the FSM clock and
	// refills nothing.
	d := l.apply(time.Second, acquire("c1", 2, "acme", 1)).Ops[0].Decision
	if d.Admitted {
		t.Fatalf("stale timestamp refilled the bucket: %+v", d)
	}
	if got := l.f.Clock(); got != int64(10*time.Second) {
		t.Fatalf("clock = %v, want 10s", time.Duration(got))
	}
}

// refundAnswer is the part of an OtherResult a Refund sets.
type refundAnswer struct {
	refunded uint64
	outcome  RefundOutcome
	kept     int
}

func answerOf(r *OtherResult) refundAnswer {
	return refundAnswer{r.Refunded, r.RefundOutcome, r.BucketsKept}
}

func TestRefundOnceViaDedupRecord(t *testing.T) {
	l := newLog(t)
	l.apply(time.Millisecond, acquire("c1", 1, "acme", 3))
	refund := func(id uint64) *fsmv1.Op {
		return &fsmv1.Op{Op: &fsmv1.Op_Refund{Refund: &fsmv1.Refund{ClientId: "c1", RequestId: id}}}
	}
	want := func(ts time.Duration, op *fsmv1.Op, w refundAnswer) {
		t.Helper()
		if r := answerOf(l.apply(ts, op).Ops[0].Other); r != w {
			t.Fatalf("refund: %+v, want %+v", r, w)
		}
	}
	want(time.Millisecond, refund(1), refundAnswer{3, RefundRefunded, 0})
	want(3*time.Millisecond, refund(1), refundAnswer{0, RefundAlreadyRefunded, 0})
	want(4*time.Millisecond, refund(99), refundAnswer{0, RefundNotFound, 0})
	l.apply(5*time.Millisecond, acquire("c1", 2, "acme", 3))
	if d := l.apply(5*time.Millisecond, acquire("c1", 3, "acme", 1)).Ops[0].Decision; d.Admitted || d.Reason == quota.ReasonInvalid {
		t.Fatalf("a third lease of a tenant with max_in_flight 2: %+v, want a denial", d)
	}
	want(5*time.Millisecond, refund(3), refundAnswer{0, RefundNotAdmitted, 0})
}

// An admission that took no rate tokens (a concurrency-only domain: permits, no bucket) is
// answered nothing_to_refund with refunded 0, the first time and after — not "refunded" with
// its cost. The state changes as it did before the answer existed: the dedup record is marked
// refunded and the clock advances (the hash of a replica that answered "refunded" is the same).
func TestRefundOfConcurrencyOnlyAdmissionRefundsNothing(t *testing.T) {
	l := newLog(t)
	lim := *testLimits
	lim.Domains = append(append([]quota.Domain(nil), testLimits.Domains...), quota.Domain{Name: "slots",
		Concurrency: &quota.Concurrency{MaxInFlight: 2, LeaseTTL: 5 * time.Second}})
	if r := l.apply(time.Millisecond, setLimits(t, &lim)); r.Ops[0].Other.Err != nil {
		t.Fatal(r.Ops[0].Other.Err)
	}
	slot := &fsmv1.Op{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{ClientId: "c1", Admission: &quotadv1.Admission{RequestId: 1, Domain: "slots"}}}}
	if d := l.apply(2*time.Millisecond, slot).Ops[0].Decision; !d.Admitted || d.LeaseID == 0 {
		t.Fatalf("slots acquire: %+v, want admitted with a lease", d)
	}
	refund := &fsmv1.Op{Op: &fsmv1.Op_Refund{Refund: &fsmv1.Refund{ClientId: "c1", RequestId: 1}}}
	for i, ts := range []time.Duration{3 * time.Millisecond, 4 * time.Millisecond} {
		if got := answerOf(l.apply(ts, refund).Ops[0].Other); got != (refundAnswer{0, RefundNothingToRefund, 0}) {
			t.Fatalf("refund #%d of a concurrency-only admission: %+v, want nothing_to_refund, refunded 0", i+1, got)
		}
		if seq, ok := l.f.dedup.lookup("c1", 1); !ok || !l.f.dedup.refunded(seq) {
			t.Fatalf("refund #%d: the dedup record is not marked refunded (the state must change as before)", i+1)
		}
		if got := l.f.Clock(); got != int64(ts) {
			t.Fatalf("refund #%d: clock %v, want %v (Engine.Refund advances it, as before)", i+1, time.Duration(got), ts)
		}
	}
}

// The user trial: the domain ceiling (10/s, burst 5) refills between the spend and the refund
// and takes nothing back; the tenant's bucket (2/s, burst 3) gets its unit. The answer is the
// cost (the old one, the least any bucket took back, was 0). A bucket another admission
// debited since keeps the units, and the answer counts it.
func TestRefundAnswersCostWhenCeilingRefilled(t *testing.T) {
	l := newLog(t)
	status := func() []quota.BucketStatus { // as of the last entry
		st, err := l.f.Status("provider", []quota.Entry{{Key: "tenant", Value: "acme"}})
		if err != nil || len(st) != 2 {
			t.Fatalf("status: %+v %v", st, err)
		}
		return st
	}
	l.apply(time.Millisecond, acquire("c1", 1, "acme", 1))
	// By 200 ms the ceiling is full again (4 + 10/s × 199 ms) and the tenant holds 2.4.
	r := l.apply(200*time.Millisecond, &fsmv1.Op{Op: &fsmv1.Op_Refund{Refund: &fsmv1.Refund{ClientId: "c1", RequestId: 1}}}).Ops[0].Other
	if got := answerOf(r); got != (refundAnswer{1, RefundRefunded, 0}) {
		t.Fatalf("refund: %+v, want refunded 1, no bucket kept", got)
	}
	if st := status(); st[0].Remaining != 5 || st[1].Remaining != 3 {
		t.Fatalf("after the refund: %+v; want the ceiling at 5, the tenant at 3", st)
	}
	l.apply(300*time.Millisecond, acquire("c1", 2, "acme", 1), acquire("c1", 3, "globex", 1))
	r = l.apply(300*time.Millisecond, &fsmv1.Op{Op: &fsmv1.Op_Refund{Refund: &fsmv1.Refund{ClientId: "c1", RequestId: 2}}}).Ops[0].Other
	if got := answerOf(r); got != (refundAnswer{1, RefundRefunded, 1}) {
		t.Fatalf("refund after globex debited the ceiling: %+v, want refunded 1 with 1 bucket kept", got)
	}
}

func TestInvalidLimitsChangeNothing(t *testing.T) {
	l := newLog(t)
	before := l.f.Hash()
	bad := &quota.Limits{Domains: []quota.Domain{{Name: "x", Rate: &quota.Rate{Unit: time.Second}}}}
	r := l.apply(0, setLimits(t, bad)).Ops[0] // same instant: only the refused change could alter state
	if r.Other.Err == nil {
		t.Fatal("limits with requests_per_unit 0 were accepted")
	}
	after := l.f.Hash()
	if after.Hash != before.Hash || l.f.Limits().Version != 1 {
		t.Fatalf("state changed by refused limits: %+v -> %+v", before, after)
	}
}

func TestUnknownCommandVersionStops(t *testing.T) {
	f := New(Options{})
	data, _ := Encode(&fsmv1.Command{})
	// Rewrite the version field to one from the future.
	future := append([]byte{}, data...)
	future = append(future, 0x08, 0x63) // field 1 varint 99 (last one wins)
	defer func() {
		if recover() == nil {
			t.Fatal("an entry with a future command version was applied")
		}
	}()
	f.Apply(&raft.Log{Index: 1, Type: raft.LogCommand, Data: future})
}

type memSink struct {
	bytes.Buffer
	cancelled bool
}

func (s *memSink) ID() string    { return "mem" }
func (s *memSink) Cancel() error { s.cancelled = true; return nil }
func (s *memSink) Close() error  { return nil }

func snapshotBytes(t *testing.T, f *FSM) []byte {
	t.Helper()
	snap, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	var sink memSink
	if err := snap.Persist(&sink); err != nil {
		t.Fatal(err)
	}
	snap.Release()
	return sink.Bytes()
}

func TestSnapshotRestoreReplacesState(t *testing.T) {
	l := newLog(t)
	l.apply(time.Millisecond, acquire("c1", 1, "acme", 2), acquire("c1", 2, "beta", 1))
	want := l.f.Hash()
	data := snapshotBytes(t, l.f)

	// Restore into an FSM that has diverged: restore must replace, not merge.
	other := newLog(t)
	other.apply(time.Hour, acquire("zz", 5, "gamma", 3))
	if err := other.f.Restore(io.NopCloser(bytes.NewReader(data))); err != nil {
		t.Fatal(err)
	}
	if got := other.f.Hash(); got != want {
		t.Fatalf("restored hash %+v, want %+v", got, want)
	}
	// The dedup table came along: a retry of c1/1 is a duplicate on the restored replica.
	other.index = l.index
	r := other.apply(2*time.Millisecond, acquire("c1", 1, "acme", 2)).Ops[0]
	if !r.Duplicate {
		t.Fatal("restored FSM lost the dedup table")
	}

	// A corrupt snapshot is refused and leaves state alone.
	data[len(data)/2] ^= 0xff
	before := other.f.Hash()
	if err := other.f.Restore(io.NopCloser(bytes.NewReader(data))); err == nil {
		t.Fatal("a corrupt snapshot was restored")
	}
	if other.f.Hash() != before {
		t.Fatal("a refused snapshot changed state")
	}
}

func TestReplicasAgree(t *testing.T) {
	a, b := newLog(t), newLog(t)
	for i := uint64(1); i <= 200; i++ {
		ts := time.Duration(i) * 37 * time.Millisecond
		ops := []*fsmv1.Op{acquire("c", i, []string{"a", "b", "c"}[i%3], 1+i%2)}
		if i%10 == 0 {
			ops = append(ops, &fsmv1.Op{Op: &fsmv1.Op_Release{Release: &fsmv1.Release{LeaseId: i / 2}}})
		}
		a.apply(ts, ops...)
		b.apply(ts, ops...)
		if ha, hb := a.f.Hash(), b.f.Hash(); ha != hb {
			t.Fatalf("replicas diverged at entry %d: %+v vs %+v", i, ha, hb)
		}
	}
}

func TestWaitingDenialsAreNotRemembered(t *testing.T) {
	l := newLog(t)
	l.apply(time.Millisecond, acquire("c1", 1, "acme", 3)) // tenant bucket (burst 3) now empty
	// Cost 3 at 2/s: payable 1.5 s later, beyond MaxScheduleAhead, so refused.
	waiting := acquire("c1", 2, "acme", 3)
	waiting.GetAcquire().Admission.MaxWaitMs = 5000
	if d := l.apply(2*time.Millisecond, waiting).Ops[0]; d.Decision.Admitted || d.Duplicate || d.Decision.RetryAfter != 1499*time.Millisecond {
		t.Fatalf("first try of the waiting admission: %+v, want a fresh denial", d)
	}
	// The scheduler re-proposes the same request ID once the bucket can pay within
	// MaxScheduleAhead: it is decided afresh, admitted as a scheduled grant taking effect when
	// the bucket holds 3 again, and from then on remembered.
	r := l.apply(time.Second, waiting).Ops[0]
	if r.Duplicate || !r.Decision.Admitted || r.Decision.RetryAfter != 501*time.Millisecond {
		t.Fatalf("re-proposed waiting admission: %+v, want admitted afresh, taking effect after 501ms", r)
	}
	if again := l.apply(1100*time.Millisecond, waiting).Ops[0]; !again.Duplicate || again.Decision.LeaseID != r.Decision.LeaseID {
		t.Fatalf("retry after admission: %+v, want the remembered admission", again)
	}
}

// Scheduled grants are a version-2 rule: the same waiting admission in a version-1 entry (an
// older leader's) is decided as that leader decided it, refused; in a version-2 entry it is a
// grant taking effect when the bucket can pay; one that may not wait is refused either way.
func TestScheduledGrantsOnlyInVersion2Entries(t *testing.T) {
	for _, v := range []uint32{1, 2} {
		l := newLog(t)
		l.version = v
		l.apply(time.Millisecond, acquire("c1", 1, "acme", 3)) // tenant bucket (2/s) empty
		plain := acquire("c1", 2, "acme", 1)
		waiting := acquire("c1", 3, "acme", 1)
		waiting.GetAcquire().Admission.MaxWaitMs = 5000
		res := l.apply(2*time.Millisecond, plain, waiting)
		if d := res.Ops[0].Decision; d.Admitted {
			t.Fatalf("version %d: a non-waiting admission was granted: %+v", v, d)
		}
		d := res.Ops[1].Decision
		if v == 1 && d.Admitted {
			t.Fatalf("version 1 entry: waiting admission granted %+v, want refused as before", d)
		}
		if v == 2 && (!d.Admitted || d.RetryAfter != 499*time.Millisecond) {
			t.Fatalf("version 2 entry: waiting admission %+v, want a grant taking effect after 499ms", d)
		}
	}
}

func TestUnknownOpStops(t *testing.T) {
	l := newLog(t)
	defer func() {
		if recover() == nil {
			t.Fatal("an op this build does not know was skipped instead of stopping the replica")
		}
	}()
	l.apply(time.Millisecond, &fsmv1.Op{}) // no known oneof set: what a newer op looks like here
}

// Idle tick entries (no ops) move the FSM clock every time, not only at sweeps: a new leader's
// base, Status and lease expiry follow the last committed timestamp.
func TestTicksAdvanceTheClock(t *testing.T) {
	l := newLog(t)
	for _, ts := range []time.Duration{2 * time.Second, 2500 * time.Millisecond, 2900 * time.Millisecond} {
		l.apply(ts)
		if got := time.Duration(l.f.Clock()); got != ts {
			t.Fatalf("after a tick at %v the clock is %v", ts, got)
		}
	}
}
