package rpc

import (
	"fmt"
	"testing"
	"time"

	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/quota"
)

// newTestFair is a scheduler without a pump, metrics or Raft node: enough to drive queues and
// usage records by hand with explicit times.
func newTestFair() *fair {
	return &fair{
		s:           &Server{fsm: fsm.New(fsm.Options{})},
		queues:      make(map[string]*fairQueue),
		waiters:     make(map[uint64]*waiter),
		queuedPaths: make(map[string]int),
		pending:     make(map[string]uint64),
		pendingConc: make(map[string]uint64),
		inflight:    make(map[*relBatch]struct{}),
		applied:     make(map[string]uint64),
		appliedConc: make(map[string]uint64),
		relFlows:    make(map[string]int),
		usage:       make(map[string]*shareWindow),
	}
}

// contend runs one waiting admission of tenant, contended on its own per-tenant bucket, through
// the scheduler at now, as wait, pass and decide do: a queue is made, the waiter pushed, picked,
// its queue dropped once empty, and its admission recorded. It returns the bucket key.
func contend(t testing.TB, f *fair, tenant string, now time.Time) string {
	t.Helper()
	es := []quota.Entry{{Key: "tenant", Value: tenant}}
	v := &pathView{
		levels: []quota.BucketStatus{
			{Scope: quota.ScopeDomain, Key: quota.BucketKey("fair")},
			{Scope: "tenant", Key: quota.BucketKey("fair", es...), Limit: 10, Burst: 10, Window: time.Second},
		},
		nodes: make([]*quota.Node, 2),
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	q := f.newQueue("fair", v, es, 1, now)
	w := &waiter{cost: 1, arrived: now}
	f.push(q, w, v, es, false)
	it, ok := q.q.Next(now, nil)
	if !ok || it.ID != w.id {
		t.Fatalf("the queue of %s picked %+v, %v; want its one waiter %d", tenant, it, ok, w.id)
	}
	f.dropWaiter(w)
	delete(f.queues, q.key) // pass drops an emptied queue
	f.recordAdmission(w, now.Add(time.Millisecond))
	return q.key
}

// TestSchedUsageStaysBoundedAcrossManyTenants: 100k short-lived tenants, each contended once
// on its own bucket at 100 a second, leave the usage records of about the last three windows
// (30 s, 3000 tenants), not one per tenant ever seen.
func TestSchedUsageStaysBoundedAcrossManyTenants(t *testing.T) {
	const (
		tenants = 100_000
		every   = 10 * time.Millisecond
	)
	bound := int(3*fairShareWindow/every) + 1
	f := newTestFair()
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	most := 0
	for i := range tenants {
		contend(t, f, "t"+itoa(uint64(i)), t0.Add(time.Duration(i)*every))
		most = max(most, len(f.usage))
	}
	if most > bound {
		t.Fatalf("%d usage records after %d tenants (at most %d at once), want at most %d", len(f.usage), tenants, most, bound)
	}
	if len(f.queues) != 0 || len(f.waiters) != 0 {
		t.Fatalf("%d queues, %d waiters left", len(f.queues), len(f.waiters))
	}
}

// TestSchedUsageOfReturningTenantReadsAsIfKept: a tenant returning after gaps shorter and
// longer than the usage windows reads exactly the same (what FairView and the largest-share
// gauge show) whether its idle record was pruned meanwhile or kept. Scheduling decisions never
// read these records, so they cannot differ.
func TestSchedUsageOfReturningTenantReadsAsIfKept(t *testing.T) {
	pruned, kept := newTestFair(), newTestFair()
	kept.usageSwept = time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC) // never due: the reference keeps every record

	t0 := time.Date(2025, 1, 1, 0, 0, 3, 0, time.UTC) // not on a window boundary
	// Offsets of the returning tenant's admissions: back to back, then gaps of under one,
	// between one and two, and over two windows, off the window grid.
	var back []time.Duration
	at := time.Duration(0)
	for _, gap := range []time.Duration{0, 100 * time.Millisecond, 4 * time.Second, 13 * time.Second,
		17 * time.Second, 19900 * time.Millisecond, 21 * time.Second, 35 * time.Second, 3 * time.Second, 95 * time.Second} {
		at += gap
		back = append(back, at)
	}
	end := at + 3*fairShareWindow
	key := quota.BucketKey("fair", quota.Entry{Key: "tenant", Value: "r"})
	var prunedAway int
	for step, next := time.Duration(0), 0; step <= end; step += 250 * time.Millisecond {
		now := t0.Add(step)
		for next < len(back) && back[next] <= step {
			for _, f := range []*fair{pruned, kept} {
				contend(t, f, "r", t0.Add(back[next]))
			}
			next++
		}
		// Other tenants churn, so pruned sweeps its records as it would in service.
		for _, f := range []*fair{pruned, kept} {
			contend(t, f, "churn"+itoa(uint64(step/time.Second)), now)
		}
		if pruned.usage[key] == nil && kept.usage[key] != nil {
			prunedAway++
		}
		if got, want := reading(pruned, key, now), reading(kept, key, now); got != want {
			t.Fatalf("at +%v the returning tenant reads\n%s\nwith pruning, and\n%s\nwith its record kept", step, got, want)
		}
	}
	if prunedAway == 0 {
		t.Fatal("the returning tenant's record was never pruned: the test compared nothing")
	}
	if len(pruned.usage) >= len(kept.usage) {
		t.Fatalf("pruned holds %d records, kept %d", len(pruned.usage), len(kept.usage))
	}
}

// reading is what FairView reports for a bucket (its window and flows), or "absent".
func reading(f *fair, key string, now time.Time) string {
	u := f.usage[key]
	if u == nil || (f.queues[key] == nil && u.idle(now)) {
		return "absent"
	}
	fl, total := u.flows(now)
	return fmt.Sprintf("window %v from %v total %d flows %+v", u.length, u.started, total, fl) // maps print sorted
}
