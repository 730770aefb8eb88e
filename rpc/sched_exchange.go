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
	key       string // the contended bucket's key (its queue's)
	cost      uint64
	newcomer  bool
	fsmMoment int64 // the FSM's moment (leader time, ns)
	moment    int64 // when it is answered: fsmMoment, or another held grant's after an exchange
	answered  bool  // its holder has answered (or gave up): no longer exchangeable
	changed   chan struct{}
}

// holdSet is the exchangeable grants held on this leader, by contended bucket key.
type holdSet struct {
	mu    sync.Mutex
	byKey map[string]map[*heldGrant]struct{}
	// exchanges counts exchanges made (tests, diagnostics).
	exchanges uint64
}

// add registers a held grant; newcomers take the earliest eligible moment before theirs.
func (h *holdSet) add(key string, cost uint64, moment int64, newcomer bool) *heldGrant {
	g := &heldGrant{key: key, cost: cost, newcomer: newcomer, fsmMoment: moment, moment: moment, changed: make(chan struct{}, 1)}
	h.mu.Lock()
	defer h.mu.Unlock()
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
			if o.newcomer || o.answered || o.cost != cost || o.moment >= g.moment ||
				g.moment-o.fsmMoment > int64(fairExchangeMax) {
				continue
			}
			if best == nil || o.moment < best.moment {
				best = o
			}
		}
		if best != nil {
			g.moment, best.moment = best.moment, g.moment
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

// claim reports whether g may be answered at leader time now (its moment has come), and if
// so takes it out of the set; otherwise it returns how long to wait.
func (h *holdSet) claim(g *heldGrant, now int64) (bool, time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if now < g.moment {
		return false, time.Duration(g.moment - now)
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
	wall0 := time.Now()
	g := f.holds.add(w.relKey, w.cost, moment, w.newcomer)
	for {
		// Leader time from one reading and the monotonic clock: it keeps counting if this
		// node stops leading meanwhile (the answer is still due at its moment).
		ok, wait := f.holds.claim(g, now0+int64(time.Since(wall0)))
		if ok {
			return g.moment, nil
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-g.changed:
			t.Stop()
		case <-ctx.Done():
			t.Stop()
			f.holds.drop(g)
			return g.moment, f.s.applyError(ctx.Err())
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
