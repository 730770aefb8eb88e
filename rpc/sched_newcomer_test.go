package rpc

import (
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/config"
	"github.com/quotad/quotad/fsm"
)

// clockNode stands in for the leader's cluster node where only its clock is read: Now is
// the leader's FSM time, fixed by the test. Any other method panics (nil Node).
type clockNode struct {
	Node
	now int64
}

func (n *clockNode) Now() (int64, error) { return n.now, nil }

const newcomerLimits = `
domain: d
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1}
descriptors:
  - key: tenant
---
domain: e
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1}
descriptors:
  - key: tenant
`

// laneFair is a scheduler (no pump) over a real FSM whose limits were applied at leader time
// ts, the leader's clock standing at ts, and a waiting lane whose one commit slot is taken:
// what the scheduler submits stays queued in f.prop, in the order submitted.
func laneFair(t *testing.T, ts int64) *fair {
	t.Helper()
	f := fairWithLimits(t, newcomerLimits, ts)
	f.s.node = &clockNode{now: ts}
	f.horizon = fairHorizonInitial
	f.prop = newOrderedProposer(f.s.node, ProposerConfig{MaxBatch: 1024, MaxInflight: 1})
	f.prop.slots <- struct{}{} // never freed: nothing is committed (clockNode cannot)
	t.Cleanup(f.prop.close)
	return f
}

// fairWithLimits is newTestFair (no pump) whose real FSM has applied limitsYAML in log entry 1
// at leader time ts.
func fairWithLimits(t *testing.T, limitsYAML string, ts int64) *fair {
	t.Helper()
	f := newTestFair()
	lim, err := config.Parse("limits", []byte(limitsYAML))
	if err != nil {
		t.Fatal(err)
	}
	lj, err := json.Marshal(lim)
	if err != nil {
		t.Fatal(err)
	}
	op, err := fsm.EncodeOp(&fsmv1.Op{Op: &fsmv1.Op_SetLimits{SetLimits: &fsmv1.SetLimits{LimitsJson: lj}}})
	if err != nil {
		t.Fatal(err)
	}
	f.s.fsm.Apply(&raft.Log{Index: 1, Type: raft.LogCommand, Data: fsm.EncodeEntry(ts, [][]byte{op})})
	return f
}

// arrive queues a waiting admission of tenant on domain as wait does (read its path, queue
// it on the contended bucket, and if its flow had nothing waiting let it release itself,
// all under one hold of f.mu) and reports whether it released itself. Unlike wait it never
// goes straight to the FSM when the buckets can pay now: every request here is queued.
func arrive(t *testing.T, f *fair, id uint64, domain, tenant string) (*waiter, bool) {
	t.Helper()
	adm := &quotadv1.Admission{RequestId: id, Domain: domain, Cost: 1, MaxWaitMs: 5000,
		Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tenant}}}
	w := &waiter{owner: "o", clientID: "c", adm: adm, cost: 1, pathKey: pathKey(adm), arrived: time.Now(),
		ready: make(chan struct{}, 1), failed: make(chan struct{})}
	es := entries(adm.Descriptors)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refreshApplied()
	v, err := f.readPath(domain, es)
	if err != nil {
		t.Fatal(err)
	}
	w.setKeys(v)
	q := f.queueOn(v)
	if q == nil {
		_, blocking := f.admitAt(v, w.cost, false)
		q = f.newQueue(domain, v, es, max(blocking, 0), time.Now())
	}
	if !f.push(q, w, v, es, false) {
		return w, false
	}
	w.newcomer = true
	return w, f.releaseNewcomerLocked(v.now, time.Now(), w, v)
}

// outboxIDs lists the request IDs of the released, unsubmitted batches, batch by batch.
func outboxIDs(f *fair) [][]uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out [][]uint64
	for _, b := range f.outbox {
		var ids []uint64
		for _, w := range b {
			ids = append(ids, w.adm.RequestId)
		}
		out = append(out, ids)
	}
	return out
}

func (f *fair) queued(domain string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, q := range f.queues {
		if q.domain == domain {
			n += q.q.Len()
		}
	}
	return n
}

// A newcomer (its flow has nothing waiting) releases itself — only itself, into an entry of
// its own, ahead of the backlogged flow as WFQ orders it — and leaves every other waiter,
// on its bucket and on others, to the pump; a flow with a grant in flight is no newcomer
// for this and waits for the pump. (A whole pass per arrival was O(queues) under f.mu; a
// heavy tenant whose waiters were all released came back as a "newcomer" thousands of times
// a second at 10,000/s, each an entry of its own.)
func TestSchedNewcomerReleasesOnlyItself(t *testing.T) {
	ts := int64(10 * time.Second)
	f := laneFair(t, ts)

	// H's first request finds the bucket full and nobody waiting: it releases itself.
	if _, self := arrive(t, f, 1, "d", "H"); !self {
		t.Fatal("the first request of H on an idle bucket did not release itself")
	}
	// H's next request: H has nothing waiting but a grant in flight — not self-released,
	// though the fair order serves it next and the bucket pays it 1 ms later.
	if _, self := arrive(t, f, 2, "d", "H"); self {
		t.Fatal("a request of H, whose grant is in flight, released itself: only a flow with no grant in flight may")
	}
	for id := uint64(3); id <= 50; id++ {
		if _, self := arrive(t, f, id, "d", "H"); self {
			t.Fatalf("H's request %d, behind H's own waiters, released itself", id)
		}
	}
	// E on the other domain: its first request released itself, its second waits (in flight).
	if _, self := arrive(t, f, 101, "e", "E"); !self {
		t.Fatal("the first request of E on an idle bucket did not release itself")
	}
	if _, self := arrive(t, f, 102, "e", "E"); self {
		t.Fatal("E's second request released itself while its first is in flight")
	}
	// The pump releases H's waiters due within the horizon (10 ms at 1000/s).
	f.mu.Lock()
	f.passLocked(ts, time.Now())
	f.mu.Unlock()
	ob := outboxIDs(f)
	if len(ob) != 4 || !slices.Equal(ob[0], []uint64{1}) || !slices.Equal(ob[1], []uint64{101}) {
		t.Fatalf("released batches %v, want [1] [101] then the pump's batches of d and e", ob)
	}
	hWaiting, eWaiting := f.queued("d"), f.queued("e")
	if hWaiting == 0 || hWaiting == 49 || eWaiting != 0 {
		t.Fatalf("after the pump's pass %d of H wait (want some released, some left), %d of E (want 0)", hWaiting, eWaiting)
	}
	// Another request of E arrives (E has one in flight): it waits for the pump, queued.
	if _, self := arrive(t, f, 103, "e", "E"); self || f.queued("e") != 1 {
		t.Fatalf("E's third request released itself (%v) or is not queued (%d)", self, f.queued("e"))
	}

	// N arrives: a new flow, so WFQ serves it before H's backlog; it releases itself alone.
	n0 := len(outboxIDs(f))
	if _, self := arrive(t, f, 200, "d", "N"); !self {
		t.Fatal("newcomer N did not release itself ahead of H's backlog")
	}
	ob = outboxIDs(f)
	if len(ob) != n0+1 || !slices.Equal(ob[n0], []uint64{200}) {
		t.Fatalf("N's arrival released %v, want exactly [200]", ob[n0:])
	}
	if got := f.queued("d"); got != hWaiting {
		t.Fatalf("N's arrival changed H's waiters: %d, were %d (they are the pump's)", got, hWaiting)
	}
	if got := f.queued("e"); got != 1 {
		t.Fatalf("N's arrival released E's waiter on another bucket (%d left): it is the pump's", got)
	}
	// N again while its first is in flight: it waits for the pump.
	if _, self := arrive(t, f, 201, "d", "N"); self {
		t.Fatal("N's second request released itself while N's first is in flight")
	}
}

// Batches reach the waiting lane in the order they were released, also when two releases
// overlap: the pump's pass releases H's grants, and before it has submitted them a
// newcomer's release (its moment after H's grants) submits first. Each submitting its own
// batches, N's entry came before H's (the FSM then gives N the earlier slots and H's grants
// later ones than predicted, past their waits at worst); with the outbox, N's flush submits
// H's batch first.
func TestSchedBatchesReachTheLaneInReleaseOrder(t *testing.T) {
	ts := int64(10 * time.Second)
	f := laneFair(t, ts)
	// H's waiters queue behind H's first (in flight, so none releases itself).
	for id := uint64(1); id <= 6; id++ {
		arrive(t, f, id, "d", "H")
	}
	f.mu.Lock()
	f.outbox = nil // H's first, as if submitted long ago
	f.mu.Unlock()

	paused, resume := make(chan struct{}), make(chan struct{})
	calls := 0
	hook := func() {
		calls++ // only the first caller runs concurrently with nothing else touching calls
		if calls == 1 {
			close(paused)
			<-resume
		}
	}
	fairReleasedHook.Store(&hook)
	t.Cleanup(func() { fairReleasedHook.Store(nil) })
	pumped := make(chan struct{})
	go func() {
		defer close(pumped)
		f.pass(-1) // releases H's 5 waiters, then pauses before flushing
	}()
	select {
	case <-paused:
	case <-time.After(5 * time.Second):
		t.Fatal("the pump's pass never released anything")
	}
	// N arrives while the pass's batch is released but not submitted, and flushes.
	w, self := arrive(t, f, 100, "d", "N")
	if !self {
		t.Fatal("newcomer N did not release itself")
	}
	hook()
	f.flush()
	close(resume)
	<-pumped

	var order []uint64
	f.prop.mu.Lock()
	for _, op := range f.prop.queue {
		if op.c == w.call {
			order = append(order, 100)
		} else {
			order = append(order, 0)
		}
	}
	f.prop.mu.Unlock()
	want := []uint64{0, 0, 0, 0, 0, 100}
	if !slices.Equal(order, want) {
		t.Fatalf("the waiting lane got %v (0: H's grants released by the pass, 100: N released after them), want %v", order, want)
	}
	if got := fmt.Sprint(f.queued("d")); got != "0" {
		t.Fatalf("%s still queued, want every waiter released", got)
	}
}
