package rpc

import (
	"context"
	"sync"
	"time"
)

// Moment exchange: a newcomer takes the bucket's next held moment.
//
// Grants are released a horizon ahead of their moments (so a burst-1 bucket loses no units
// while an entry waits for its commit), and each one's answer is held on the leader until
// its moment. A newcomer — a tenant with nothing waiting, which WFQ serves before the
// backlogged flows — is released at once, but its entry lands behind the grants already
// released, so the FSM gives it the moment after theirs: it waited out the horizon's lead
// (traced at 1000/s: p50 3–4 ms, p99 7–12 ms of a small tenant's wait, the largest part).
//
// The grants held on this leader for the same contended bucket are interchangeable there:
// the FSM has debited each, and which caller is told first is the leader's choice. So when a
// newcomer's grant is applied with moment M while another held grant of the same cost on the
// same queue has an earlier moment M', the newcomer takes M' and the other takes M. The set
// of moments answered on the contended bucket — and on every level above it, which all of the
// queue's waiters share — is unchanged, so the bucket's bound holds exactly as the FSM
// decided it. Levels below the contended one belong to each caller (a tenant's own limit, a
// consumer's): an exchange would move a grant against one of those, so only grants with no
// rate limit below the contended level are exchanged. Concurrency permits are taken when the
// entry is applied, whatever the moment.
//
// A grant is moved later by at most fairExchangeMax from its FSM moment. A retry of a request
// (the same request ID, answered from the FSM's dedup table, here or on a new leader) does not
// know of the exchange, so an admitted duplicate whose grant was scheduled is held
// fairExchangeMax longer than its FSM moment says (hold): never before the moment an
// exchange may have given the original.
const fairExchangeMax = 25 * time.Millisecond

// heldGrant is one scheduled grant whose answer this leader holds until moment.
type heldGrant struct {
	key      string // the contended bucket's key (its queue's)
	cost     uint64
	newcomer bool
	// fsmAt is the FSM's moment as a local (monotonic) time, mapped from leader time when
	// the grant was registered; at is when it is answered: fsmAt, or another held grant's
	// after an exchange. Local times, not leader times: a node that lost and regained
	// leadership counts leader time from a new base (the election gap is not credited), so
	// moments of two terms are not comparable, while their local instants are.
	fsmAt, at time.Time
	answered  bool // its holder has answered (or gave up): no longer exchangeable
	changed   chan struct{}
}

// holdSet is the exchangeable grants held on this leader, by contended bucket key.
type holdSet struct {
	mu    sync.Mutex
	byKey map[string]map[*heldGrant]struct{}
	// exchanges counts exchanges made (tests, diagnostics).
	exchanges uint64
	// anchorNs and anchorAt are one reading of leader time and the local clock at the same
	// moment: grants map their moments to local instants through it, so that within one
	// anchor the mapping is exact and exchanged moments stay exactly the FSM's. It is taken
	// anew when leader time and the local clock disagree by more than a millisecond (a new
	// term counts leader time from a new base).
	anchorNs int64
	anchorAt time.Time
}

// localLocked maps leader time moment to a local instant, given a reading of leader time
// now0 taken at local time at. h.mu held.
func (h *holdSet) localLocked(now0 int64, at time.Time, moment int64) time.Time {
	if h.anchorAt.IsZero() || absNs(now0-(h.anchorNs+int64(at.Sub(h.anchorAt)))) > int64(time.Millisecond) {
		h.anchorNs, h.anchorAt = now0, at
	}
	return h.anchorAt.Add(time.Duration(moment - h.anchorNs))
}

func absNs(d int64) int64 {
	if d < 0 {
		return -d
	}
	return d
}

// add registers a held grant; newcomers take the earliest eligible moment before theirs.
// now0 is a reading of leader time taken at local time at; moment is the grant's, in leader time.
func (h *holdSet) add(key string, cost uint64, now0 int64, at time.Time, moment int64, newcomer bool) *heldGrant {
	h.mu.Lock()
	defer h.mu.Unlock()
	fsmAt := h.localLocked(now0, at, moment)
	g := &heldGrant{key: key, cost: cost, newcomer: newcomer, fsmAt: fsmAt, at: fsmAt, changed: make(chan struct{}, 1)}
	if h.byKey == nil {
		h.byKey = make(map[string]map[*heldGrant]struct{})
	}
	set := h.byKey[key]
	if set == nil {
		set = make(map[*heldGrant]struct{})
		h.byKey[key] = set
	}
	if newcomer {
		var best *heldGrant
		for o := range set {
			if o.newcomer || o.answered || o.cost != cost || !o.at.Before(g.at) ||
				g.at.Sub(o.fsmAt) > fairExchangeMax {
				continue
			}
			if best == nil || o.at.Before(best.at) {
				best = o
			}
		}
		if best != nil {
			g.at, best.at = best.at, g.at
			h.exchanges++
			select {
			case best.changed <- struct{}{}:
			default:
			}
		}
	}
	set[g] = struct{}{}
	return g
}

// claim reports whether g may be answered now (its moment has come), and if so takes it out
// of the set; otherwise it returns how long to wait.
func (h *holdSet) claim(g *heldGrant, now time.Time) (bool, time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if now.Before(g.at) {
		return false, g.at.Sub(now)
	}
	h.dropLocked(g)
	return true, 0
}

// drop takes g out of the set without answering it (its caller left).
func (h *holdSet) drop(g *heldGrant) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.dropLocked(g)
}

func (h *holdSet) dropLocked(g *heldGrant) {
	g.answered = true
	if set := h.byKey[g.key]; set != nil {
		delete(set, g)
		if len(set) == 0 {
			delete(h.byKey, g.key)
		}
	}
}

// count is how many exchanges were made.
func (h *holdSet) count() uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.exchanges
}

// holdExchangeable holds a scheduled grant r of waiter w like hold, registered so that a
// newcomer may take its moment or it a later one's (see fairExchangeMax). It returns the
// leader time the answer was due at (for traces).
func (f *fair) holdExchangeable(ctx context.Context, w *waiter, r proposalResult) (int64, error) {
	moment := r.ts + int64(r.res.Decision.RetryAfter)
	now0, err := f.s.node.Now()
	if err != nil {
		return moment, f.hold(ctx, r) // no longer the leader: nothing to exchange with
	}
	// The moment as a local instant (the monotonic clock runs on if this node stops
	// leading meanwhile: the answer is still due then).
	g := f.holds.add(w.relKey, w.cost, now0, time.Now(), moment, w.newcomer)
	held := func() int64 { return moment + int64(g.at.Sub(g.fsmAt)) } // in leader time, for traces
	for {
		ok, wait := f.holds.claim(g, time.Now())
		if ok {
			return held(), nil
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-g.changed:
			t.Stop()
		case <-ctx.Done():
			t.Stop()
			f.holds.drop(g)
			return held(), f.s.applyError(ctx.Err())
		}
	}
}

// exchangeable reports whether w's grant r may take part in moment exchanges: a scheduled
// grant (held) decided afresh, of a waiter whose path has no rate limit below its queue's
// contended level — as of the limits the FSM decided it under: limitsVersion, read after r
// was applied, is the one w's path was read under (versions only grow, so no change came
// between). A waiter noted its path when it last queued, maybe seconds before its release;
// a limit of its tenant's own applied meanwhile (the FSM enforces it) made it move grants
// against that limit (TestExchangeSkipsWaitersQueuedBeforeALimitChange).
func (w *waiter) exchangeable(r proposalResult, limitsVersion uint64) bool {
	d := r.res.Decision
	return d.Admitted && d.RetryAfter > 0 && !r.res.Duplicate && r.ts > 0 && w.relKey != "" && w.rateMax <= w.relLevel &&
		w.limitsVersion == limitsVersion
}
