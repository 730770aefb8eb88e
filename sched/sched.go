// Package sched is quotad's fair scheduler for admissions waiting on one contended bucket: it
// decides which waiting request may spend the next unit the bucket frees.
//
// It is a pure algorithm. Time is always an argument (now), it starts no goroutine, reads no
// clock, does no IO, and its choices depend only on the calls made (never on map order), so a
// Queue driven by the same calls makes the same choices — tests use explicit times, as with
// golang.org/x/time/rate. It never decides whether capacity exists: the caller (the leader's
// rpc layer) asks it for the next request only when the bucket can pay for one, and the
// replicated state machine re-checks every admission it is given.
//
// # Policy
//
// Flows. Waiting requests belong to flows (tenants). A flow has a weight (0 means 1). Among
// flows the Queue is weighted fair (start-time fair queuing by virtual finish tag): each
// dispatch advances the flow's tag by cost/weight, and the flow with the smallest tag after
// its next request goes first, so backlogged flows receive capacity in proportion to their
// weights. A flow that was idle starts at the current virtual time: it gets no credit for
// idleness (no hoarded burst) but waits behind nobody's backlog — a tenant with one request is
// served within one dispatch of any tenant with a thousand. The Queue is work-conserving: a
// flow whose next request is not eligible (its own inner limit is exhausted) is skipped, and
// idle flows' shares go to the others.
//
// A flow that stays backlogged but is skipped as not eligible keeps its start tag, so once
// eligible it is served first until it has caught up — bounded by its own inner limit, which
// is what made it ineligible.
//
// Max-min fairness. Under congestion this yields the weighted max-min fair allocation of the
// bucket's rate: a tenant that asks less than its weighted share gets all it asks, the rest is
// split among the heavier tenants by weight, so the largest consumers are cut first. Compare
// proportional shedding (every tenant loses the same fraction of its demand): there a tenant
// sending 90 % of the demand keeps 90 % of the capacity and small tenants lose requests they
// could have had without hurting anyone. MaxMinShares and ProportionalShares compute both.
//
// Work classes. Classes are listed in priority order, each with a reserved percentage of the
// dispatched capacity. A class with a reserve earns credit of ReservePercent of every unit
// dispatched (banked up to Config.ReserveBurst units while it has nothing waiting); while it
// has credit for its next request, that request goes first ("reserve lane"), so an
// interactive class with a 10 % reserve is served at the next free unit even under a flood of
// backfill. Beyond their reserves classes share the flows' fair shares (reserves are floors,
// not caps); an idle class's reserve is borrowed by everyone else. Within one flow, requests
// are served by class priority, except that a request that has waited Config.AgingAfter is
// served first (oldest first), so a tenant's old low-priority work is never starved by its
// own stream of high-priority work.
//
// Batches. Queue.Batch dispatches, in this same order, every request the caller predicts can
// be admitted by a given time: the leader releases a bucket's grants ahead of time, as many
// as reach the replicated log before the bucket could pay them, and the state machine gives
// each its own moment (a scheduled grant), so grants flow at the bucket's rate whatever the
// commit latency. Bucket.ReadyAfter is that prediction for one token bucket.
//
// A Queue is not safe for concurrent use. The zero value is not usable; call New.
package sched

import (
	"fmt"
	"math"
	"strings"
	"time"
)

// vscale makes virtual-time increments integers: a dispatch of cost c by a flow of weight w
// advances its tag by c·vscale/w.
const vscale = 1 << 20

// Class is one work class with a reserved share of the dispatched capacity.
type Class struct {
	Name string
	// ReservePercent of dispatched units is kept for this class while it has waiting work.
	ReservePercent uint32
}

// Config configures a Queue. The zero value is one implicit class, no aging.
type Config struct {
	// Classes in priority order (highest first). A request naming no listed class belongs to
	// an implicit class after all of them, without reserve.
	Classes []Class
	// AgingAfter: a request that has waited this long is served before its flow's other
	// requests, oldest first, whatever its class. 0 disables aging.
	AgingAfter time.Duration
	// ReserveBurst is how many units of reserve credit a class can bank while idle (0: 1).
	// It bounds how many reserved requests can jump ahead at once after a quiet period.
	ReserveBurst uint64
}

// Validate reports a configuration the Queue cannot honour.
func (c Config) Validate() error {
	sum := uint32(0)
	seen := map[string]bool{}
	for _, cl := range c.Classes {
		if seen[cl.Name] {
			return fmt.Errorf("sched: work class %q is listed twice", cl.Name)
		}
		seen[cl.Name] = true
		sum += cl.ReservePercent
	}
	if sum > 100 {
		return fmt.Errorf("sched: work class reserves add up to %d%%; they must not exceed 100%%", sum)
	}
	if c.AgingAfter < 0 {
		return fmt.Errorf("sched: AgingAfter %v is negative", c.AgingAfter)
	}
	return nil
}

// Item is one waiting request.
type Item struct {
	// ID is the caller's handle, unique among the Queue's items.
	ID uint64
	// Flow identifies the tenant the request belongs to.
	Flow string
	// Weight is the flow's share weight (0 means 1). The latest Push sets the flow's weight.
	Weight uint32
	// Class is the request's work class name ("" or unknown: the implicit last class).
	Class string
	// Cost in units (0 means 1).
	Cost uint64
	// Enqueued is when the request started waiting (for aging and Oldest).
	Enqueued time.Time
}

func (it *Item) cost() uint64 { return max(it.Cost, 1) }

type entry struct {
	Item
	seq     uint64 // arrival order, breaks ties
	class   int
	removed bool
}

type flow struct {
	name   string
	weight uint64
	start  uint64     // virtual start tag of its next dispatch (set when it becomes backlogged)
	finish uint64     // virtual finish tag of its last dispatch
	fifo   [][]*entry // per class index, FIFO
	n      int        // live entries
	// fresh: backlogged since its start was set to the virtual time, not dispatched since.
	fresh bool
}

func (f *flow) head(c int) *entry {
	q := f.fifo[c]
	for len(q) > 0 && q[0].removed {
		q[0] = nil
		q = q[1:]
	}
	f.fifo[c] = q
	if len(q) == 0 {
		return nil
	}
	return q[0]
}

// Queue holds the requests waiting on one contended bucket and picks which goes next.
type Queue struct {
	cfg     Config
	classes map[string]int
	credit  []uint64 // per class, units·vscale
	vtime   uint64
	seq     uint64
	flows   map[string]*flow
	order   []*flow // flows in creation order: deterministic iteration
	items   map[uint64]*entry
}

// New returns an empty Queue. It returns an error if cfg is invalid.
func New(cfg Config) (*Queue, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.ReserveBurst == 0 {
		cfg.ReserveBurst = 1
	}
	q := &Queue{
		cfg:     cfg,
		classes: make(map[string]int, len(cfg.Classes)),
		credit:  make([]uint64, len(cfg.Classes)+1),
		flows:   make(map[string]*flow),
		items:   make(map[uint64]*entry),
	}
	for i, c := range cfg.Classes {
		q.classes[c.Name] = i
		if c.ReservePercent > 0 {
			q.credit[i] = cfg.ReserveBurst * vscale // a quiet class starts with its bank full
		}
	}
	return q, nil
}

// Len returns the number of waiting requests.
func (q *Queue) Len() int { return len(q.items) }

// Has reports whether the request id is waiting.
func (q *Queue) Has(id uint64) bool { _, ok := q.items[id]; return ok }

// Push adds a waiting request. It returns an error if its ID is already waiting.
func (q *Queue) Push(it Item) error {
	if _, dup := q.items[it.ID]; dup {
		return fmt.Errorf("sched: request %d is already waiting", it.ID)
	}
	q.push(it, false)
	return nil
}

// Requeue puts a request that was dispatched but could not be admitted back at the head of
// its flow's class, keeping its Enqueued time. Its flow has already been charged for it.
func (q *Queue) Requeue(it Item) error {
	if _, dup := q.items[it.ID]; dup {
		return fmt.Errorf("sched: request %d is already waiting", it.ID)
	}
	q.push(it, true)
	return nil
}

// Waiting reports whether flow has requests waiting.
func (q *Queue) Waiting(flow string) bool {
	f := q.flows[flow]
	return f != nil && f.n > 0
}

// HasClass reports whether name is one of the configured classes (not the implicit one).
func (q *Queue) HasClass(name string) bool {
	_, ok := q.classes[name]
	return ok
}

func (q *Queue) push(it Item, front bool) {
	f := q.flows[it.Flow]
	if f == nil {
		f = &flow{name: it.Flow, finish: q.vtime, fifo: make([][]*entry, len(q.credit))}
		q.flows[it.Flow] = f
		q.order = append(q.order, f)
	}
	f.weight = uint64(max(it.Weight, 1))
	c, ok := q.classes[it.Class]
	if !ok {
		c = len(q.cfg.Classes)
	}
	if f.n == 0 {
		// Newly backlogged: start at the virtual time, or later if its last dispatch finished
		// later (no credit for idleness, no penalty beyond its own last request).
		f.start = max(f.finish, q.vtime)
		f.fresh = true
	}
	q.seq++
	e := &entry{Item: it, seq: q.seq, class: c}
	if front {
		f.fifo[c] = append([]*entry{e}, f.fifo[c]...)
	} else {
		f.fifo[c] = append(f.fifo[c], e)
	}
	f.n++
	q.items[it.ID] = e
}

// Remove drops a waiting request (its wait ended or it was cancelled). It reports whether it
// was waiting.
func (q *Queue) Remove(id uint64) bool {
	e, ok := q.items[id]
	if !ok {
		return false
	}
	e.removed = true
	delete(q.items, id)
	q.flows[e.Flow].n--
	q.prune()
	return true
}

// prune forgets empty flows whose finish tag the virtual time has passed (they would start
// at the virtual time anyway), and resets virtual time when nothing waits.
func (q *Queue) prune() {
	kept := q.order[:0]
	for _, f := range q.order {
		if f.n == 0 && (f.finish <= q.vtime || len(q.items) == 0) {
			delete(q.flows, f.name)
			continue
		}
		kept = append(kept, f)
	}
	clear(q.order[len(kept):])
	q.order = kept
	if len(q.items) == 0 && len(q.order) == 0 {
		q.vtime = 0
	}
}

// candidate is the next request of a flow and the tag it would finish at.
type candidate struct {
	f   *flow
	e   *entry
	tag uint64
}

func (q *Queue) tag(f *flow, e *entry) uint64 {
	start := f.start
	inc := e.cost() * vscale / f.weight
	if inc == 0 {
		inc = 1
	}
	if start > math.MaxUint64-inc {
		return math.MaxUint64
	}
	return start + inc
}

// better orders candidates by finish tag. On a tie a newly backlogged flow goes first: its
// start is the virtual time, which no backlogged flow's start is below, so WFQ places it
// ahead of them (a backlogged flow ties with it only by having started exactly there). Then
// arrival order.
func better(a, b candidate) bool {
	if b.e == nil {
		return true
	}
	if a.tag != b.tag {
		return a.tag < b.tag
	}
	if a.f.fresh != b.f.fresh {
		return a.f.fresh
	}
	return a.e.seq < b.e.seq
}

// flowHead returns the flow's next eligible request in the shared lane: aged requests first
// (oldest first), then class priority. Only the head of each class FIFO is considered.
func (q *Queue) flowHead(f *flow, now time.Time, eligible func(Item) bool) *entry {
	var aged, best *entry
	for c := range f.fifo {
		e := f.head(c)
		if e == nil || !eligible(e.Item) {
			continue
		}
		if q.cfg.AgingAfter > 0 && now.Sub(e.Enqueued) >= q.cfg.AgingAfter {
			if aged == nil || e.Enqueued.Before(aged.Enqueued) || (e.Enqueued.Equal(aged.Enqueued) && e.seq < aged.seq) {
				aged = e
			}
			continue
		}
		if best == nil {
			best = e // classes are scanned in priority order
		}
	}
	if aged != nil {
		return aged
	}
	return best
}

// Next picks the request to dispatch now among those for which eligible reports true (the
// caller's check that every other limit on the request's path could admit it now), removes
// it and returns it. ok is false when no waiting request is eligible. eligible must not
// change the Queue and may be called several times per request.
func (q *Queue) Next(now time.Time, eligible func(Item) bool) (Item, bool) {
	best, reserve := q.pick(now, eligible)
	if best.e == nil {
		return Item{}, false
	}
	return q.commit(best, reserve), true
}

// Peek returns the request Next would dispatch now among those eligible, without
// dispatching it; ok is false when none is eligible.
func (q *Queue) Peek(now time.Time, eligible func(Item) bool) (Item, bool) {
	best, _ := q.pick(now, eligible)
	if best.e == nil {
		return Item{}, false
	}
	return best.e.Item, true
}

// pick returns the candidate Next would dispatch, and the reserve class it would be charged
// to (-1: the shared lane), without changing the Queue.
func (q *Queue) pick(now time.Time, eligible func(Item) bool) (candidate, int) {
	if len(q.items) == 0 {
		return candidate{}, -1
	}
	if eligible == nil {
		eligible = func(Item) bool { return true }
	}
	// Reserve lane: a class with credit for its next request goes first, highest priority
	// class first; among its flows, the fair order.
	for c, cl := range q.cfg.Classes {
		if cl.ReservePercent == 0 {
			continue
		}
		var best candidate
		for _, f := range q.order {
			if f.n == 0 {
				continue
			}
			e := f.head(c)
			if e == nil || e.cost()*vscale > q.credit[c] || !eligible(e.Item) {
				continue
			}
			if cand := (candidate{f, e, q.tag(f, e)}); better(cand, best) {
				best = cand
			}
		}
		if best.e != nil {
			return best, c
		}
	}
	var best candidate
	for _, f := range q.order {
		if f.n == 0 {
			continue
		}
		e := q.flowHead(f, now, eligible)
		if e == nil {
			continue
		}
		if cand := (candidate{f, e, q.tag(f, e)}); better(cand, best) {
			best = cand
		}
	}
	return best, -1
}

func (q *Queue) commit(c candidate, reserve int) Item {
	if reserve >= 0 {
		q.credit[reserve] -= c.e.cost() * vscale
	}
	return q.dispatch(c)
}

// Slot is when a waiting request could be admitted, as the caller predicts it (Batch).
type Slot struct {
	// At is the earliest time every limit on the request's path can pay for it, given the
	// requests dispatched before it.
	At time.Time
	// Own is set when At is held back by a limit of the request's own (its tenant's bucket,
	// a concurrency cap below the queue's bucket), not by the bucket the Queue shares out:
	// other flows may go first (work conservation). When the shared bucket is what binds,
	// every flow waits for it in the fair order, so a large request is not starved by small
	// ones slipping in ahead of it.
	Own bool
}

// Batch dispatches, in the order successive Next calls would, every waiting request whose
// predicted admission time is at most until, and returns them. It is how the leader fills a
// bucket's pace ahead of time: until is now plus how long a grant takes to reach the log, and
// the replicated state machine gives each grant of the batch its own moment (a scheduled
// grant), so the batch can go into one log entry.
//
// slot predicts a request's admission; it is called before each dispatch, after take was
// called for every request dispatched before (take updates the caller's prediction, e.g. the
// cost already released to the bucket). The batch stops at the first request in fair order
// that the shared bucket cannot pay by until; requests held back by their own limits are
// skipped. next is the earliest predicted time among the requests left waiting that were
// looked at (zero if none): when to call Batch again.
func (q *Queue) Batch(now, until time.Time, slot func(Item) Slot, take func(Item)) (batch []Item, next time.Time) {
	note := func(t time.Time) {
		if next.IsZero() || t.Before(next) {
			next = t
		}
	}
	for {
		var head Slot
		best, reserve := q.pick(now, func(it Item) bool {
			s := slot(it)
			if s.Own && s.At.After(until) {
				note(s.At)
				return false
			}
			return true
		})
		if best.e == nil {
			return batch, next
		}
		head = slot(best.e.Item)
		if head.At.After(until) {
			note(head.At)
			return batch, next
		}
		it := q.commit(best, reserve)
		batch = append(batch, it)
		if take != nil {
			take(it)
		}
	}
}

func (q *Queue) dispatch(c candidate) Item {
	cost := c.e.cost()
	q.vtime = max(q.vtime, c.f.start) // start tag of the request now in service
	c.f.finish = c.tag
	c.f.start = c.tag
	c.f.fresh = false
	for i, cl := range q.cfg.Classes {
		if cl.ReservePercent == 0 {
			continue
		}
		limit := max(q.cfg.ReserveBurst, cost) * vscale
		earn := cost * vscale / 100 * uint64(cl.ReservePercent)
		q.credit[i] = min(limit, q.credit[i]+earn)
	}
	c.e.removed = true
	delete(q.items, c.e.ID)
	c.f.n--
	q.prune()
	return c.e.Item
}

// Oldest returns the Enqueued time of the longest-waiting request; ok is false when empty.
func (q *Queue) Oldest() (t time.Time, ok bool) {
	for _, f := range q.order {
		for c := range f.fifo {
			if e := f.head(c); e != nil && (!ok || e.Enqueued.Before(t)) {
				t, ok = e.Enqueued, true
			}
		}
	}
	return t, ok
}

// FlowStat describes one flow's waiting requests.
type FlowStat struct {
	Flow    string
	Weight  uint32
	Waiting int
	// WaitingCost sums the waiting requests' costs.
	WaitingCost uint64
	// Oldest is the Enqueued time of its longest-waiting request.
	Oldest time.Time
	// ByClass counts waiting requests by class name ("" for the implicit class).
	ByClass map[string]int
}

// Flows describes the flows with waiting requests, in the order they first appeared.
func (q *Queue) Flows() []FlowStat {
	var out []FlowStat
	for _, f := range q.order {
		if f.n == 0 {
			continue
		}
		fs := FlowStat{Flow: f.name, Weight: uint32(f.weight), ByClass: map[string]int{}}
		for c, fifo := range f.fifo {
			name := ""
			if c < len(q.cfg.Classes) {
				name = q.cfg.Classes[c].Name
			}
			for _, e := range fifo {
				if e.removed {
					continue
				}
				fs.Waiting++
				fs.WaitingCost += e.cost()
				fs.ByClass[name]++
				if fs.Oldest.IsZero() || e.Enqueued.Before(fs.Oldest) {
					fs.Oldest = e.Enqueued
				}
			}
		}
		out = append(out, fs)
	}
	return out
}

// String summarises the queue for debugging: flows, their tags and waiting counts.
func (q *Queue) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "vtime=%d", q.vtime)
	for _, f := range q.order {
		fmt.Fprintf(&b, " %s(w=%d,finish=%d,n=%d)", f.name, f.weight, f.finish, f.n)
	}
	return b.String()
}
