package sched

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

var t0 = time.Unix(1_000_000, 0)

// at returns t0 + ms milliseconds: tests name their times explicitly.
func at(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

func mustNew(t *testing.T, cfg Config) *Queue {
	t.Helper()
	q, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return q
}

type pusher struct {
	t  *testing.T
	q  *Queue
	id uint64
}

func (p *pusher) push(flow string, weight uint32, class string, when time.Time) uint64 {
	p.t.Helper()
	p.id++
	if err := p.q.Push(Item{ID: p.id, Flow: flow, Weight: weight, Class: class, Cost: 1, Enqueued: when}); err != nil {
		p.t.Fatal(err)
	}
	return p.id
}

// The seed scenario: tenant A keeps 1,000 requests waiting; B and C arrive with one each and
// are served at the very next dispatch (one token interval), however long A's backlog.
func TestSmallTenantsAreServedAtTheNextDispatch(t *testing.T) {
	q := mustNew(t, Config{})
	p := &pusher{t: t, q: q}
	for range 1000 {
		p.push("A", 1, "", at(0))
	}
	for step := 1; step <= 300; step++ { // one dispatch per 100 ms token
		now := at(100 * step)
		var b, c uint64
		if step%7 == 0 {
			b = p.push("B", 1, "", now)
		}
		if step%11 == 0 {
			c = p.push("C", 1, "", now)
		}
		it, ok := q.Next(now, nil)
		if !ok {
			t.Fatal("nothing dispatched with a backlog")
		}
		if it.Flow == "A" {
			p.push("A", 1, "", now) // A keeps its backlog at 1,000
		}
		if b != 0 && c != 0 {
			// Both arrived together: one now, the other at the next token.
			if it.ID != b && it.ID != c {
				t.Fatalf("step %d: dispatched %s while B and C just arrived", step, it.Flow)
			}
			it2, _ := q.Next(now, nil)
			if it2.ID != b && it2.ID != c {
				t.Fatalf("step %d: second dispatch %s, want the other of B/C", step, it2.Flow)
			}
			p.push("A", 1, "", now)
			continue
		}
		if want := max(b, c); want != 0 && it.ID != want {
			t.Fatalf("step %d: dispatched %s (id %d), want the new small tenant's request %d", step, it.Flow, it.ID, want)
		}
	}
}

func shares(t *testing.T, q *Queue, n int, refill func(Item)) map[string]int {
	t.Helper()
	got := map[string]int{}
	for i := range n {
		it, ok := q.Next(at(i), nil)
		if !ok {
			t.Fatalf("dispatch %d: nothing eligible", i)
		}
		got[it.Flow] += int(it.cost())
		if refill != nil {
			refill(it)
		}
	}
	return got
}

func TestBackloggedFlowsShareByWeight(t *testing.T) {
	for _, tc := range []struct {
		weights map[string]uint32
		want    map[string]int // of 400 dispatches
	}{
		{map[string]uint32{"a": 1, "b": 1, "c": 2}, map[string]int{"a": 100, "b": 100, "c": 200}},
		{map[string]uint32{"a": 1, "b": 3}, map[string]int{"a": 100, "b": 300}},
		{map[string]uint32{"a": 0, "b": 1}, map[string]int{"a": 200, "b": 200}}, // 0 means 1
		{map[string]uint32{"lone": 5}, map[string]int{"lone": 400}},
	} {
		t.Run(fmt.Sprint(tc.weights), func(t *testing.T) {
			q := mustNew(t, Config{})
			p := &pusher{t: t, q: q}
			flows := make([]string, 0, len(tc.weights))
			for f := range tc.weights {
				flows = append(flows, f)
			}
			slices.Sort(flows)
			for _, f := range flows {
				for range 10 {
					p.push(f, tc.weights[f], "", at(0))
				}
			}
			got := shares(t, q, 400, func(it Item) { p.push(it.Flow, it.Weight, "", at(0)) })
			for f, w := range tc.want {
				if d := got[f] - w; d < -1 || d > 1 {
					t.Errorf("flow %s got %d of 400, want %d ± 1 (all: %v)", f, got[f], w, got)
				}
			}
		})
	}
}

// Larger costs count: a flow sending cost-4 requests gets a quarter as many dispatches.
func TestSharesCountCostNotRequests(t *testing.T) {
	q := mustNew(t, Config{})
	var id uint64
	push := func(f string, cost uint64) {
		id++
		if err := q.Push(Item{ID: id, Flow: f, Cost: cost, Enqueued: at(0)}); err != nil {
			t.Fatal(err)
		}
	}
	for range 5 {
		push("small", 1)
		push("big", 4)
	}
	got := shares(t, q, 500, func(it Item) { push(it.Flow, it.Cost) })
	if r := float64(got["big"]) / float64(got["small"]); r < 0.95 || r > 1.05 {
		t.Fatalf("cost units big/small = %v (%v), want 1", r, got)
	}
}

func TestIneligibleFlowsAreSkippedWorkConserving(t *testing.T) {
	q := mustNew(t, Config{})
	p := &pusher{t: t, q: q}
	for range 5 {
		p.push("blocked", 1, "", at(0))
		p.push("free", 1, "", at(0))
	}
	notBlocked := func(it Item) bool { return it.Flow != "blocked" }
	for i := range 5 {
		it, ok := q.Next(at(i), notBlocked)
		if !ok || it.Flow != "free" {
			t.Fatalf("dispatch %d: %+v %v, want free's request", i, it, ok)
		}
	}
	if _, ok := q.Next(at(6), notBlocked); ok {
		t.Fatal("dispatched a request that is not eligible")
	}
	// Once unblocked, the flow that was skipped is not punished: it has the smallest tag.
	it, _ := q.Next(at(7), nil)
	if it.Flow != "blocked" {
		t.Fatalf("after unblocking got %s", it.Flow)
	}
}

// An idle flow banks no credit: coming back after a long pause it gets its share, not a burst.
func TestIdleFlowGetsNoBurst(t *testing.T) {
	q := mustNew(t, Config{})
	p := &pusher{t: t, q: q}
	for range 10 {
		p.push("busy", 1, "", at(0))
	}
	shares(t, q, 200, func(it Item) { p.push("busy", 1, "", at(0)) })
	for range 10 {
		p.push("back", 1, "", at(0))
	}
	got := shares(t, q, 100, func(it Item) { p.push(it.Flow, 1, "", at(0)) })
	if got["back"] < 49 || got["back"] > 51 {
		t.Fatalf("returning flow got %d of 100, want 50 ± 1 (%v)", got["back"], got)
	}
}

func interactiveConfig() Config {
	return Config{
		Classes:    []Class{{Name: "interactive", ReservePercent: 10}, {Name: "incremental"}, {Name: "backfill"}},
		AgingAfter: 10 * time.Second,
	}
}

// A reserved class jumps a flood of other work at the next dispatch, even when its tenant is
// the one with the largest fair-queuing tag.
func TestReservedClassIsServedAtTheNextDispatch(t *testing.T) {
	q := mustNew(t, interactiveConfig())
	p := &pusher{t: t, q: q}
	for range 500 {
		p.push("bulk", 1, "backfill", at(0))
	}
	waits := 0
	for step := 1; step <= 1000; step++ {
		now := at(100 * step)
		var ia uint64
		if step%15 == 0 { // interactive demand ~6.7 % < 10 % reserve
			ia = p.push("ui", 1, "interactive", now)
		}
		it, _ := q.Next(now, nil)
		if it.Flow == "bulk" {
			p.push("bulk", 1, "backfill", now)
		}
		if ia != 0 && it.ID != ia {
			waits++
		}
	}
	if waits != 0 {
		t.Fatalf("%d interactive requests waited past the next dispatch", waits)
	}
}

// Under an interactive flood the reserve is a floor, not a cap: each tenant still gets its
// fair share, and backfill keeps progressing.
func TestReserveIsAFloorAndBackfillProgresses(t *testing.T) {
	q := mustNew(t, interactiveConfig())
	p := &pusher{t: t, q: q}
	for range 50 {
		p.push("ui", 1, "interactive", at(0))
		p.push("bulk", 1, "backfill", at(0))
	}
	got := shares(t, q, 1000, func(it Item) { p.push(it.Flow, 1, it.Class, at(0)) })
	if got["bulk"] < 400 {
		t.Fatalf("backfill got %d of 1000 under an interactive flood (%v)", got["bulk"], got)
	}
	// Same tenant, both classes: priority inside the flow, but the reserve keeps interactive
	// at ≥ 10 % and aging keeps backfill alive.
	q = mustNew(t, interactiveConfig())
	p = &pusher{t: t, q: q}
	for range 50 {
		p.push("t", 1, "backfill", at(0))
	}
	for range 50 {
		p.push("t", 1, "interactive", at(0))
	}
	var backfill int
	for step := range 400 {
		now := at(100 * step)
		it, _ := q.Next(now, nil)
		if it.Class == "backfill" {
			backfill++
		}
		p.push("t", 1, it.Class, now)
	}
	if backfill == 0 {
		t.Fatal("aging did not rescue the tenant's own backfill from its interactive stream")
	}
}

func TestAgingServesOldLowPriorityWorkFirst(t *testing.T) {
	q := mustNew(t, Config{Classes: []Class{{Name: "hi"}, {Name: "lo"}}, AgingAfter: time.Second})
	p := &pusher{t: t, q: q}
	old := p.push("t", 1, "lo", at(0))
	p.push("t", 1, "hi", at(500))
	if it, _ := q.Next(at(900), nil); it.Class != "hi" {
		t.Fatalf("before aging: %+v, want hi", it)
	}
	p.push("t", 1, "hi", at(950))
	if it, _ := q.Next(at(1000), nil); it.ID != old {
		t.Fatalf("after aging: %+v, want the old lo request %d", it, old)
	}
}

func TestRemoveRequeueOldest(t *testing.T) {
	q := mustNew(t, Config{})
	p := &pusher{t: t, q: q}
	a := p.push("a", 1, "", at(10))
	b := p.push("b", 1, "", at(20))
	if o, ok := q.Oldest(); !ok || !o.Equal(at(10)) {
		t.Fatalf("Oldest = %v %v", o, ok)
	}
	if !q.Waiting("a") || !q.Waiting("b") || q.Waiting("c") {
		t.Fatal("Waiting: a and b have requests waiting, c none")
	}
	if !q.Remove(a) || q.Remove(a) || q.Len() != 1 {
		t.Fatal("Remove")
	}
	if q.Waiting("a") {
		t.Fatal("Waiting(a) after its only request was removed")
	}
	if o, _ := q.Oldest(); !o.Equal(at(20)) {
		t.Fatalf("Oldest after remove = %v", o)
	}
	it, _ := q.Next(at(30), nil)
	if it.ID != b {
		t.Fatalf("Next = %+v", it)
	}
	c := p.push("b", 1, "", at(25))
	if err := q.Requeue(it); err != nil {
		t.Fatal(err)
	}
	if err := q.Push(Item{ID: c}); err == nil {
		t.Fatal("duplicate push accepted")
	}
	if it2, _ := q.Next(at(40), nil); it2.ID != b {
		t.Fatalf("requeued request not first in its flow: %+v", it2)
	}
	if _, ok := q.Oldest(); !ok {
		t.Fatal("Oldest on non-empty")
	}
	q.Next(at(50), nil)
	if _, ok := q.Oldest(); ok || q.Len() != 0 {
		t.Fatal("queue not empty")
	}
}

func TestConfigValidate(t *testing.T) {
	for _, cfg := range []Config{
		{Classes: []Class{{Name: "a", ReservePercent: 60}, {Name: "b", ReservePercent: 50}}},
		{Classes: []Class{{Name: "a"}, {Name: "a"}}},
		{AgingAfter: -time.Second},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("New(%+v) accepted", cfg)
		}
	}
}

// The same calls make the same choices (no map order reaches an output).
func TestDeterministic(t *testing.T) {
	run := func() []uint64 {
		q := mustNew(t, interactiveConfig())
		r := rand.New(rand.NewPCG(1, 2))
		var out []uint64
		id := uint64(0)
		classes := []string{"interactive", "incremental", "backfill", ""}
		for step := range 3000 {
			for range r.IntN(3) {
				id++
				_ = q.Push(Item{ID: id, Flow: fmt.Sprint("f", r.IntN(20)), Weight: uint32(r.IntN(4)),
					Class: classes[r.IntN(4)], Cost: uint64(1 + r.IntN(3)), Enqueued: at(step)})
			}
			if r.IntN(10) == 0 && id > 0 {
				q.Remove(uint64(1 + r.IntN(int(id))))
			}
			if it, ok := q.Next(at(step), func(it Item) bool { return it.Flow != "f3" || step%2 == 0 }); ok {
				out = append(out, it.ID)
			}
		}
		return out
	}
	a, b := run(), run()
	if !slices.Equal(a, b) {
		t.Fatal("two identical runs dispatched differently")
	}
}

func TestMaxMinVersusProportional(t *testing.T) {
	// Capacity 10/s; A asks 100/s, B and C 1/s each.
	mm := MaxMinShares(10, []float64{100, 1, 1}, nil)
	if math.Abs(mm[0]-8) > 1e-9 || mm[1] != 1 || mm[2] != 1 {
		t.Fatalf("max-min = %v, want [8 1 1]", mm)
	}
	pr := ProportionalShares(10, []float64{100, 1, 1})
	if pr[1] > 0.1 || pr[0] < 9.7 {
		t.Fatalf("proportional = %v: small tenants should be nearly starved", pr)
	}
	w := MaxMinShares(12, []float64{100, 100, 100}, []uint32{1, 1, 2})
	if math.Abs(w[0]-3) > 1e-9 || math.Abs(w[2]-6) > 1e-9 {
		t.Fatalf("weighted max-min = %v, want [3 3 6]", w)
	}
	if s := MaxMinShares(10, []float64{2, 3}, nil); s[0] != 2 || s[1] != 3 {
		t.Fatalf("under capacity = %v, want demands", s)
	}
}

// Peek names what Next would dispatch, under the same eligibility, and changes nothing.
func TestPeekIsNextWithoutDispatching(t *testing.T) {
	q := mustNew(t, Config{})
	p := &pusher{t: t, q: q}
	for range 3 {
		p.push("A", 1, "", at(0))
	}
	if _, ok := q.Next(at(1), nil); !ok {
		t.Fatal("nothing dispatched")
	}
	b := p.push("B", 1, "", at(2)) // a newcomer goes ahead of A's backlog
	notB := func(it Item) bool { return it.Flow != "B" }
	for _, el := range []func(Item) bool{nil, notB} {
		peek, ok := q.Peek(at(3), el)
		n := q.Len()
		next, ok2 := q.Next(at(3), el)
		if !ok || !ok2 || peek.ID != next.ID || n != q.Len()+1 {
			t.Fatalf("Peek %+v %v, then Next %+v %v (length %d → %d): Peek must name Next's pick and leave it queued", peek, ok, next, ok2, n, q.Len())
		}
		if el == nil && peek.ID != b {
			t.Fatalf("Peek picked %+v, want the newcomer B (%d)", peek, b)
		}
	}
	if _, ok := q.Peek(at(4), func(Item) bool { return false }); ok {
		t.Fatal("Peek found an item none of which is eligible")
	}
}
