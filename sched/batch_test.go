package sched

import (
	"container/heap"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// frontier is the simplest shared bucket for Batch: the next unit is free at free, one unit
// every per.
type frontier struct {
	free time.Time
	per  time.Duration
}

func (f *frontier) slot(it Item) Slot {
	return Slot{At: f.free.Add(time.Duration(it.cost()-1) * f.per)}
}
func (f *frontier) take(it Item) { f.free = f.free.Add(time.Duration(it.cost()) * f.per) }

// randomQueue builds the same queue for every seed: flows with weights, classes, costs.
func randomQueue(t *testing.T, seed uint64) *Queue {
	r := rand.New(rand.NewPCG(seed, 7))
	q := mustNew(t, Config{Classes: []Class{{Name: "interactive", ReservePercent: 10}, {Name: "bulk"}}, AgingAfter: time.Second})
	for id := uint64(1); id <= 300; id++ {
		flow := fmt.Sprint("f", r.IntN(6))
		if err := q.Push(Item{ID: id, Flow: flow, Weight: uint32(1 + len(flow)%3), Class: []string{"", "interactive", "bulk"}[r.IntN(3)],
			Cost: uint64(1 + r.IntN(3)), Enqueued: at(r.IntN(2000))}); err != nil {
			t.Fatal(err)
		}
	}
	return q
}

// A batch is exactly the sequence successive Next calls dispatch, cut where the shared bucket
// cannot pay by until.
func TestBatchIsTheFairOrderCutAtTheHorizon(t *testing.T) {
	for seed := range uint64(20) {
		a, b := randomQueue(t, seed), randomQueue(t, seed)
		now := at(2500)
		fa := &frontier{free: now, per: time.Millisecond}
		until := now.Add(40 * time.Millisecond)
		batch, next := a.Batch(now, until, fa.slot, fa.take)
		fb := &frontier{free: now, per: time.Millisecond}
		var want []Item
		for {
			it, ok := b.Next(now, nil)
			if !ok || fb.slot(it).At.After(until) {
				break
			}
			fb.take(it)
			want = append(want, it)
		}
		if !slices.EqualFunc(batch, want, func(x, y Item) bool { return x.ID == y.ID }) {
			t.Fatalf("seed %d: batch %v differs from the Next sequence %v", seed, ids(batch), ids(want))
		}
		var cost uint64
		for _, it := range batch {
			cost += it.cost()
		}
		if cost < 38 || cost > 41 || next.IsZero() || !next.After(until) {
			t.Fatalf("seed %d: batch of cost %d (want the 40ms horizon filled), next %v", seed, cost, next.Sub(now))
		}
	}
}

func ids(its []Item) []uint64 {
	out := make([]uint64, len(its))
	for i, it := range its {
		out[i] = it.ID
	}
	return out
}

// When the shared bucket binds, the batch stops at the fair head even if a cheaper request of
// another flow would fit: a large request is not starved by small ones slipping in. A flow
// held back by its own limit is skipped (work conservation) and its time reported.
func TestBatchStopsAtTheSharedBucketSkipsOwnLimits(t *testing.T) {
	q := mustNew(t, Config{})
	now := at(0)
	// big (weight 5, cost 5) and small (weight 1, cost 1) both finish at tag 1; big came first.
	_ = q.Push(Item{ID: 1, Flow: "big", Weight: 5, Cost: 5, Enqueued: now})
	_ = q.Push(Item{ID: 2, Flow: "small", Cost: 1, Enqueued: now})
	_ = q.Push(Item{ID: 3, Flow: "small", Cost: 1, Enqueued: now})
	f := &frontier{free: now, per: time.Millisecond}
	batch, next := q.Batch(now, now.Add(3*time.Millisecond), f.slot, f.take)
	// big is the fair head and its 5 units end at 4 ms > 3 ms: stop there, although small's
	// requests would fit.
	if len(batch) != 0 || !next.Equal(now.Add(4*time.Millisecond)) {
		t.Fatalf("batch %v next %v, want none and big's slot at 4ms", ids(batch), next.Sub(now))
	}
	batch, _ = q.Batch(now, now.Add(4*time.Millisecond), f.slot, f.take)
	if len(batch) != 1 || batch[0].ID != 1 {
		t.Fatalf("batch %v, want big first once it fits", ids(batch))
	}

	q = mustNew(t, Config{})
	_ = q.Push(Item{ID: 1, Flow: "capped", Enqueued: now})
	_ = q.Push(Item{ID: 2, Flow: "free", Enqueued: now})
	_ = q.Push(Item{ID: 3, Flow: "free", Enqueued: now})
	f = &frontier{free: now, per: time.Millisecond}
	own := func(it Item) Slot {
		if it.Flow == "capped" {
			return Slot{At: now.Add(time.Second), Own: true} // its tenant bucket is empty
		}
		return f.slot(it)
	}
	batch, next = q.Batch(now, now.Add(10*time.Millisecond), own, f.take)
	if len(batch) != 2 || batch[0].ID != 2 || batch[1].ID != 3 || !next.Equal(now.Add(time.Second)) {
		t.Fatalf("batch %v next %v, want [2 3] and the capped flow's time", ids(batch), next.Sub(now))
	}
}

// A tenant that arrives while two heavy tenants' grants are being batched starts at the
// virtual time: it is in the very next batch, among its first two grants.
func TestBatchPlacesNewTenantAtVirtualTime(t *testing.T) {
	q := mustNew(t, Config{})
	p := &pusher{t: t, q: q}
	for range 400 {
		p.push("A", 1, "", at(0))
	}
	for range 100 {
		p.push("B", 1, "", at(0))
	}
	f := &frontier{free: at(0), per: time.Millisecond}
	for step := range 50 {
		now := at(10 * step)
		if step%5 == 3 {
			id := p.push(fmt.Sprint("small", step), 1, "", now)
			batch, _ := q.Batch(now, now.Add(10*time.Millisecond), f.slot, f.take)
			if i := slices.Index(ids(batch), id); i < 0 || i > 1 {
				t.Fatalf("step %d: new tenant's request at position %d of the next batch %v", step, i, ids(batch))
			}
			continue
		}
		q.Batch(now, now.Add(10*time.Millisecond), f.slot, f.take)
	}
}

func TestBucketReadyAfter(t *testing.T) {
	b := Bucket{Limit: 1000, Window: time.Second, Burst: 1, ResetAfter: 300 * time.Microsecond}
	for _, c := range []struct {
		need uint64
		want time.Duration
	}{{0, 0}, {1, 300 * time.Microsecond}, {2, 1300 * time.Microsecond}, {11, 10300 * time.Microsecond}} {
		if got := b.ReadyAfter(c.need); got != c.want {
			t.Fatalf("ReadyAfter(%d) = %v, want %v", c.need, got, c.want)
		}
	}
	full := Bucket{Limit: 10, Window: time.Second, Burst: 5}
	if full.ReadyAfter(5) != 0 || full.ReadyAfter(6) != 100*time.Millisecond {
		t.Fatalf("full bucket: %v %v", full.ReadyAfter(5), full.ReadyAfter(6))
	}
	if (Bucket{}).ReadyAfter(100) != 0 {
		t.Fatal("a bucket without a rate holds a request back")
	}
}

// The pacing loop in a discrete-event model of the leader and the replicated log: a burst-1
// bucket of R/s decided by scheduled grants (the FSM's rule), entries that take a random
// commit time with at most two in flight (the proposer), and the leader's pump, which on
// every event batches what the bucket can pay within the horizon. Tenant A keeps 400
// requests waiting, B 100; small tenants send one request at random moments (1 % of the rate
// in all, so two rarely meet: each would wait for the other). At every rate
// the bucket stays busy, A and B share exactly, and small tenants wait about a token interval
// plus the time a grant takes through the log.
func TestBatchPacingSimulation(t *testing.T) {
	for _, rate := range []float64{10, 100, 1000, 10000} {
		t.Run(fmt.Sprint(rate), func(t *testing.T) {
			r := simulate(t, rate, 3*time.Millisecond, 7)
			interval := time.Duration(float64(time.Second) / rate)
			t.Logf("rate %.0f: utilization %.4f, A:B %.3f, small p99 %v (%.1f intervals), commit max %v",
				rate, r.util, r.ratio, r.smallP99, float64(r.smallP99)/float64(interval), r.commitMax)
			if r.util < 0.99 {
				t.Errorf("utilization %.4f < 0.99", r.util)
			}
			if math.Abs(r.ratio-1) > 0.02 {
				t.Errorf("A:B %.3f, want 1", r.ratio)
			}
			// A grant waits for an entry (at most one commit, two in flight) and its commit.
			if lim := 2*interval + 2*r.commitMax; r.smallP99 > lim {
				t.Errorf("small tenants' wait p99 %v > 2 intervals + 2 commits (%v)", r.smallP99, lim)
			}
		})
	}
}

type simResult struct {
	util, ratio         float64
	smallP99, commitMax time.Duration
}

type simEvent struct {
	at   int64
	kind int // 0 commit, 1 small arrival, 2 pump timer, 3 answer
	its  []Item
	slot []int64
}

type simEvents []*simEvent

func (h simEvents) Len() int           { return len(h) }
func (h simEvents) Less(i, j int) bool { return h[i].at < h[j].at }
func (h simEvents) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *simEvents) Push(x any)        { *h = append(*h, x.(*simEvent)) }
func (h *simEvents) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

func simulate(t *testing.T, rate float64, commit time.Duration, seed uint64) simResult {
	rng := rand.New(rand.NewPCG(seed, seed))
	per := float64(time.Second) / rate
	interval := time.Duration(per)
	horizon := commit * 3 / 2 // the longest a released grant waits for its entry (the slowest commit)
	dur := int64(max(3*time.Second, 10000*interval))
	q := mustNew(t, Config{AgingAfter: time.Hour})
	base := t0
	wall := func(ns int64) time.Time { return base.Add(time.Duration(ns)) }

	// The FSM's bucket (burst 1): tokens as of last, scheduled grants (quota.Engine's rule).
	tokens, last := 1.0, int64(0)
	grant := func(now int64) (int64, bool) {
		if now > last {
			tokens, last = math.Min(1, tokens+float64(now-last)/per), now
		}
		if tokens >= 1 {
			tokens--
			return max(now, last), true
		}
		slot := last + int64(math.Ceil((1-tokens)*per))
		if slot-now > int64(time.Second) {
			return 0, false
		}
		tokens, last = 0, slot
		return slot, true
	}
	// The leader's view: the FSM state as of the last commit it saw, and cost released since.
	var clock int64
	reading := func() Bucket {
		full := last + int64((1-tokens)*per)
		return Bucket{Limit: uint64(rate), Window: time.Second, Burst: 1, ResetAfter: time.Duration(max(0, full-clock))}
	}
	var pending uint64
	var queued []Item // released, waiting for an entry
	inflight := 0     // entries committing (at most two)
	var ev simEvents
	var id uint64
	enqueued := map[uint64]int64{}
	push := func(flow string, now int64) {
		id++
		enqueued[id] = now
		_ = q.Push(Item{ID: id, Flow: flow, Enqueued: wall(now)})
	}
	for range 400 {
		push("A", 0)
	}
	for range 100 {
		push("B", 0)
	}
	heap.Push(&ev, &simEvent{at: int64(rng.ExpFloat64() * 100 * per), kind: 1})
	var commitMax time.Duration
	cut := func(now int64) {
		for inflight < 2 && len(queued) > 0 {
			inflight++
			e := &simEvent{kind: 0, its: queued}
			for range queued { // the FSM decides at the entry's stamp, in order
				s, ok := grant(now)
				if !ok {
					t.Fatalf("the FSM refused a released grant at %v", time.Duration(now))
				}
				e.slot = append(e.slot, s)
			}
			c := commit/2 + time.Duration(rng.Int64N(int64(commit))) // 1.5 ms .. 4.5 ms
			commitMax = max(commitMax, c)
			e.at = now + int64(c)
			heap.Push(&ev, e)
			queued = nil
		}
	}
	timerAt := int64(-1)
	pump := func(now int64) {
		b := reading()
		batch, next := q.Batch(wall(now), wall(now+int64(horizon)), func(it Item) Slot {
			return Slot{At: wall(clock + int64(b.ReadyAfter(it.cost()+pending)))}
		}, func(it Item) { pending += it.cost() })
		queued = append(queued, batch...)
		cut(now)
		if !next.IsZero() {
			if w := int64(next.Sub(base)) - int64(horizon); timerAt < now || w < timerAt {
				timerAt = max(w, now+1)
				heap.Push(&ev, &simEvent{at: timerAt, kind: 2})
			}
		}
	}
	var admitted = map[string]int{}
	var small []time.Duration
	var granted int
	warm := dur / 10
	pump(0)
	for len(ev) > 0 {
		e := heap.Pop(&ev).(*simEvent)
		now := e.at
		if now > dur {
			break
		}
		switch e.kind {
		case 0: // committed: the leader sees the state, answers are held until their slot
			inflight--
			clock = now
			for i, it := range e.its {
				pending -= it.cost()
				heap.Push(&ev, &simEvent{at: max(now, e.slot[i]), kind: 3, its: []Item{it}, slot: []int64{e.slot[i]}})
			}
		case 1:
			push(fmt.Sprint("small", rng.IntN(6)), now)
			heap.Push(&ev, &simEvent{at: now + int64(rng.ExpFloat64()*100*per), kind: 1})
		case 3:
			it := e.its[0]
			if e.slot[0] >= warm {
				granted++
				admitted[it.Flow]++
				if it.Flow != "A" && it.Flow != "B" {
					small = append(small, time.Duration(now-enqueued[it.ID]))
				}
			}
			delete(enqueued, it.ID)
			if it.Flow == "A" || it.Flow == "B" {
				push(it.Flow, now) // closed loop: the worker asks again
			}
		}
		pump(now)
	}
	slices.Sort(small)
	p99 := time.Duration(0)
	if len(small) > 0 {
		p99 = small[min(len(small)-1, int(0.99*float64(len(small))))]
	}
	return simResult{util: float64(granted) / (rate * float64(dur-warm) / float64(time.Second)),
		ratio: float64(admitted["A"]) / float64(admitted["B"]), smallP99: p99, commitMax: commitMax}
}
