package rpc

import (
	"testing"
	"time"

	"github.com/hashicorp/raft"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/quota"
)

// A released grant the FSM has applied but whose answer the pump has not handled yet is in
// both the FSM's state and f.pending; counted twice, the next grant was predicted one unit
// late (at 10,000/s a millisecond of such lateness held back 10 grants). refreshApplied takes
// it out of the prediction as soon as the FSM remembers the batch's admission.
func TestSchedPendingTheFSMAppliedIsNotCountedTwice(t *testing.T) {
	f := fairWithLimits(t, "domain: d\nrate_limit: {unit: second, requests_per_unit: 1000, burst: 1}\n", 0)

	// The pump released request 7 (pending 1) in a batch; its entry is applied at ts.
	key := quota.BucketKey("d")
	f.pending[key] = 1
	rb := &relBatch{owner: "o", clientID: "c", requestID: 7, rate: map[string]uint64{key: 1}, conc: map[string]uint64{}}
	f.inflight[rb] = struct{}{}
	f.refreshApplied() // not applied yet: still pending
	if f.applied[key] != 0 {
		t.Fatalf("counted as applied before the FSM applied it: %v", f.applied)
	}
	ts := int64(10 * time.Second)
	adm := &quotadv1.Admission{RequestId: 7, Domain: "d", Cost: 1, MaxWaitMs: 1000}
	f.s.fsm.Apply(&raft.Log{Index: 2, Type: raft.LogCommand, Data: fsm.EncodeEntry(ts, [][]byte{fsm.AppendOwnedAcquireOp(nil, "o", "c", adm)})})

	view := func() *pathView {
		st, err := f.s.fsm.Status("d", nil)
		if err != nil {
			t.Fatal(err)
		}
		return &pathView{clock: f.s.fsm.Clock(), now: ts, levels: st, nodes: make([]*quota.Node, len(st))}
	}
	// The FSM's bucket: its one token went to request 7 at ts; the next accrues 1 ms later.
	want := ts + int64(time.Millisecond)
	if got := f.levelAt(view(), 0, 1, false); got != want+int64(time.Millisecond) {
		t.Fatalf("before refreshApplied: next grant at %v after ts, want 2 ms (the applied grant counted twice, as the FSM answered nothing yet)", time.Duration(got-ts))
	}
	f.refreshApplied()
	if got := f.levelAt(view(), 0, 1, false); got != want {
		t.Fatalf("the next grant is predicted %v after ts, want 1 ms: an applied grant still counted as pending too", time.Duration(got-ts))
	}
	// Its answer handled: out of both.
	f.forget(rb)
	f.release([]string{key}, nil, 1)
	if got := f.levelAt(view(), 0, 1, false); got != want || len(f.applied) != 0 || len(f.pending) != 0 {
		t.Fatalf("after the answer: at %v after ts, applied %v, pending %v", time.Duration(got-ts), f.applied, f.pending)
	}
}
