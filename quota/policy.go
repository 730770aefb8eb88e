package quota

// Replicated policy on top of the buckets: provider feedback (pauses scoped to what the
// provider named), adaptive limits (AIMD between a floor and the configured rate) and retry
// budgets. Like the rest of the package it is a function of its inputs and the FSM clock.

import (
	"fmt"
	"math/bits"
	"slices"
	"strings"
	"time"
)

// Provider statuses Feedback accepts.
const (
	StatusTooManyRequests    = 429
	StatusServiceUnavailable = 503
)

// MaxMaxKeys bounds a domain's max_keys (a bucket takes ~80 bytes: 2^30 of them, ~80 GB,
// is already more than any node holds).
const MaxMaxKeys = 1 << 30

// MaxResumeJitter bounds a domain's resume_jitter.
const MaxResumeJitter = time.Hour

// adaptiveParams is an Adaptive in micro-units per Unit of the level's rate.
type adaptiveParams struct {
	floor, ceil, inc uint64
	keepPercent      uint64 // DecreasePercent: the share kept on a decrease, 1..99
	window           time.Duration
}

func newAdaptiveParams(where string, a *Adaptive, r *rateParams) (*adaptiveParams, error) {
	if a == nil {
		return nil, nil
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s: adaptive.%s", ErrInvalidLimits, where, fmt.Sprintf(format, args...))
	}
	switch {
	case r == nil:
		return nil, fmt.Errorf("%w: %s: adaptive needs a rate_limit (its requests_per_unit is the ceiling); add one or remove adaptive", ErrInvalidLimits, where)
	case a.Floor == 0 || a.Floor > r.rpu:
		return nil, bad("floor must be between 1 and the requests_per_unit %d (got %d)", r.rpu, a.Floor)
	case a.DecreasePercent == 0 || a.DecreasePercent >= 100:
		return nil, bad("decrease_percent must be between 1 and 99 (got %d): the percentage of the rate kept on a confirmed rate limit", a.DecreasePercent)
	case a.Increase == 0 || a.Increase > r.rpu:
		return nil, bad("increase must be between 1 and the requests_per_unit %d (got %d)", r.rpu, a.Increase)
	case a.StableWindow <= 0:
		return nil, bad("stable_window must be > 0 (got %v); e.g. 5s", a.StableWindow)
	}
	return &adaptiveParams{
		floor:       a.Floor * microPerUnit,
		ceil:        r.rpuMicro,
		inc:         a.Increase * microPerUnit,
		keepPercent: uint64(a.DecreasePercent),
		window:      a.StableWindow,
	}, nil
}

// adaptState is the effective rate of one adaptive bucket key while it is below its ceiling
// (absent: at the ceiling). The rate is base until since, then grows by inc after every full
// window: rateAt is a pure function of the state, so increases need no commands.
type adaptState struct {
	lvl          *level
	base         uint64 // micro-units per Unit
	since        Time   // increases count from here (the later of the last decrease and the provider's reset)
	lastDecrease Time   // at most one decrease per window
}

// rateAt returns the effective rate at t, in micro-units per Unit.
func (a *adaptState) rateAt(t Time) uint64 {
	p := a.lvl.adaptive
	if a.base >= p.ceil {
		return p.ceil
	}
	if t <= a.since {
		return a.base
	}
	n := uint64(t-a.since) / uint64(p.window)
	if n > (p.ceil-a.base)/p.inc {
		return p.ceil
	}
	return a.base + n*p.inc
}

// withRate returns r refilling at rateMicro micro-units per Unit, same capacity: adaptive
// limits move the rate, never the burst.
func (r *rateParams) withRate(rateMicro uint64) *rateParams {
	cp := *r
	cp.rpuMicro = rateMicro
	cp.rpu = rateMicro / microPerUnit
	return &cp
}

// rateOf returns the rate that governs the bucket key of lv for a refill starting at `at`.
// A bucket refills at the effective rate of its last refill until a command touches it again:
// increases apply from the next touch (never retroactively), decreases settle the bucket first.
func (e *Engine) rateOf(key string, lv *level, at Time) *rateParams {
	if lv.adaptive == nil {
		return lv.rate
	}
	a := e.adapt[key]
	if a == nil {
		return lv.rate
	}
	return lv.rate.withRate(a.rateAt(at))
}

// settle refills a stored bucket to now under its current rate, so a rate change applies from
// now on only. It returns the bucket's slot, or noSlot if it is not stored.
func (e *Engine) settle(key string, now Time) uint32 {
	s, _ := find(&e.buckets, key, e.buckets.hashString(key))
	if s != noSlot {
		b := e.buckets.rec(s)
		tokens, last := e.slotRate(s).refill(b.tokens.get(), Time(b.last.get()), now)
		b.tokens.set(tokens)
		b.last.set(uint64(last))
	}
	return s
}

// adaptFeedback applies attributed feedback to the adaptive level lv at key: a multiplicative
// decrease when decrease is set (at most one per stable window, so a burst of 429s that many
// workers see at once counts once), and in any case no increase before reset. It reports
// whether it decreased.
func (e *Engine) adaptFeedback(key string, lv *level, now, reset Time, decrease bool) bool {
	p := lv.adaptive
	a := e.adapt[key]
	if a == nil && !decrease {
		return false // at the ceiling: nothing to hold back
	}
	s := e.settle(key, now)
	cur := p.ceil
	if a != nil {
		cur = a.rateAt(now)
	}
	did := false
	if decrease && (a == nil || now >= addSat(a.lastDecrease, p.window)) {
		hi, lo := bits.Mul64(cur, p.keepPercent)
		q, _ := bits.Div64(hi, lo, 100) // keepPercent < 100, so hi < 100
		cur, did = max(p.floor, q), true
	}
	if a == nil {
		a = &adaptState{lvl: lv}
		e.adapt[key] = a
	}
	a.base = cur
	a.since = max(a.since, now, reset)
	if did {
		a.lastDecrease = now
	}
	if s != noSlot {
		e.scheduleFull(s)
	}
	return did
}

// sweepAdaptive forgets adaptive states that are back at their ceiling (absent means ceiling),
// settling their buckets first so no refill is revalued.
func (e *Engine) sweepAdaptive(now Time) {
	for k, a := range e.adapt {
		if a.rateAt(now) < a.lvl.adaptive.ceil {
			continue
		}
		s := e.settle(k, now)
		delete(e.adapt, k)
		if s != noSlot {
			e.scheduleFull(s)
		}
	}
}

// retryParams is a RetryBudget in micro-units.
type retryParams struct {
	creditMicro uint64      // per admitted first attempt
	minRate     *rateParams // MinPerSecond refill; nil when 0
	capMicro    uint64
}

// retryState is a domain's stored retry budget (absent: full).
type retryState struct {
	tokens uint64 // micro-units as of last
	last   Time
}

func (p *retryParams) refill(tokens uint64, last, now Time) (uint64, Time) {
	if p.minRate == nil {
		return tokens, last
	}
	return p.minRate.refill(tokens, last, now)
}

// setPolicy compiles a domain's policy settings onto its root level.
func (root *level) setPolicy(where string, d *Domain) error {
	var err error
	root.domain = d.Name
	if root.adaptive, err = newAdaptiveParams(where, d.Adaptive, root.rate); err != nil {
		return err
	}
	seen := make(map[string]bool, len(d.WorkClasses))
	sum := uint64(0)
	for i, wc := range d.WorkClasses {
		switch {
		case wc.Name == "":
			return fmt.Errorf("%w: %s: work_classes[%d] has an empty name; name every class, e.g. interactive", ErrInvalidLimits, where, i)
		case seen[wc.Name]:
			return fmt.Errorf("%w: %s: work class %q is defined twice; merge the two entries", ErrInvalidLimits, where, wc.Name)
		}
		seen[wc.Name] = true
		sum += uint64(wc.ReservePercent)
	}
	if sum > 100 {
		return fmt.Errorf("%w: %s: work_classes reserve %d%% in total; the reserves must add up to at most 100", ErrInvalidLimits, where, sum)
	}
	if rb := d.RetryBudget; rb != nil {
		switch {
		case rb.RatioPercent > 100:
			return fmt.Errorf("%w: %s: retry_budget.ratio_percent must be <= 100 (got %d)", ErrInvalidLimits, where, rb.RatioPercent)
		case rb.RatioPercent == 0 && rb.MinPerSecond == 0:
			return fmt.Errorf("%w: %s: retry_budget admits no retry at all with ratio_percent and min_per_second both 0; set one, or remove retry_budget", ErrInvalidLimits, where)
		case rb.MinPerSecond > maxUnits/10:
			return fmt.Errorf("%w: %s: retry_budget.min_per_second must be <= %d (got %d)", ErrInvalidLimits, where, maxUnits/10, rb.MinPerSecond)
		}
		p := &retryParams{creditMicro: uint64(rb.RatioPercent) * (microPerUnit / 100), capMicro: rb.Capacity() * microPerUnit}
		if rb.MinPerSecond > 0 {
			if p.minRate, err = newRateParams(&Rate{Unit: time.Second, RequestsPerUnit: rb.MinPerSecond, Burst: rb.Capacity()}); err != nil {
				return fmt.Errorf("%w: %s: retry_budget: %v", ErrInvalidLimits, where, err)
			}
		}
		root.retry = p
	}
	root.strict = d.StrictKeys
	switch {
	case d.MaxKeys == 0:
		root.maxKeys = DefaultMaxKeys
	case d.MaxKeys > MaxMaxKeys:
		return fmt.Errorf("%w: %s: max_keys must be at most %d (got %d)", ErrInvalidLimits, where, uint64(MaxMaxKeys), d.MaxKeys)
	default:
		root.maxKeys = int(d.MaxKeys)
	}
	switch {
	case d.ResumeJitter < 0 || d.ResumeJitter > MaxResumeJitter:
		return fmt.Errorf("%w: %s: resume_jitter must be between 0 and %v (got %v)", ErrInvalidLimits, where, MaxResumeJitter, d.ResumeJitter)
	case d.ResumeJitter == 0:
		root.jitter = DefaultResumeJitter
	default:
		root.jitter = d.ResumeJitter
	}
	if d.MaxPause < 0 || d.MaxPause > MaxMaxPause {
		return fmt.Errorf("%w: %s: max_pause must be between 0 (default %v) and %v (got %v)", ErrInvalidLimits, where, DefaultMaxPause, MaxMaxPause, d.MaxPause)
	}
	return nil
}

// retryBalance returns a domain's stored retry budget; an absent one is full.
func (e *Engine) retryBalance(domain string, p *retryParams, now Time) (tokens uint64, last Time, stored bool) {
	if st := e.retries[domain]; st != nil {
		return st.tokens, st.last, true
	}
	return p.capMicro, now, false
}

// checkRetry returns, for a retry in root's domain, how long until the budget holds one token;
// ok is false when it is empty now.
func (e *Engine) checkRetry(root *level, now Time) (wait time.Duration, ok bool) {
	p := root.retry
	tokens, last, _ := e.retryBalance(root.domain, p, now)
	if refilled, _ := p.refill(tokens, last, now); refilled >= microPerUnit {
		return 0, true
	}
	if p.minRate == nil {
		return 0, false // only first attempts refill it; the engine cannot foresee when
	}
	return p.minRate.waitUntil(tokens, last, now, microPerUnit), false
}

// chargeRetry debits one token for an admitted retry, or credits a first attempt's share.
func (e *Engine) chargeRetry(root *level, retry bool, now Time) {
	p := root.retry
	tokens, last, stored := e.retryBalance(root.domain, p, now)
	if !stored && !retry {
		return // full already
	}
	tokens, last = p.refill(tokens, last, now)
	if p.minRate == nil {
		last = now
	}
	if retry {
		tokens -= microPerUnit // checked by checkRetry
	} else {
		tokens = min(p.capMicro, tokens+p.creditMicro)
	}
	if tokens >= p.capMicro {
		delete(e.retries, root.domain)
		return
	}
	st := e.retries[root.domain]
	if st == nil {
		st = &retryState{}
		e.retries[root.domain] = st
	}
	st.tokens, st.last = tokens, last
}

// sweepRetries forgets retry budgets that have refilled to capacity.
func (e *Engine) sweepRetries(now Time) {
	for d, st := range e.retries {
		root := e.lim.domains[d]
		if root == nil || root.retry == nil {
			delete(e.retries, d)
			continue
		}
		if tokens, _ := root.retry.refill(st.tokens, st.last, now); tokens >= root.retry.capMicro {
			delete(e.retries, d)
		}
	}
}

// jitterFor places spread uniformly in [0, window).
func jitterFor(spread uint64, window time.Duration) time.Duration {
	hi, _ := bits.Mul64(spread, uint64(window))
	return time.Duration(hi)
}

// Feedback records a provider's 429 or 503 for the scope it names (domain and a descriptor
// prefix that matches the domain's tree entry by entry; empty: the whole domain).
//
// What counts: feedback that carries the provider's limiter reason, or that names a scope
// narrower than the whole domain, is attributed to that scope. A 429 without a reason for the
// whole domain is not assumed global (providers answer 429 for lock contention too): it is
// returned unattributed and changes nothing; the caller counts it as evidence. Attributed
// feedback:
//   - with a RetryAfter pauses exactly that scope until now+RetryAfter (only ever extended);
//     requests refused as paused are told to retry after the pause plus their share of the
//     domain's resume jitter;
//   - on an adaptive scope, a 429 is confirmed rate limiting: the effective rate is multiplied
//     by decrease_percent (not below the floor; at most once per stable window), and additive
//     increases resume one stable window after the provider's reset (the pause end). A 503
//     decreases nothing but holds increases back until its reset.
//
// Errors wrap ErrInvalidRequest (bad status, negative RetryAfter, a prefix that matches no
// configured level) or ErrUnknownDomain; then nothing changes, not even the clock.
func (e *Engine) Feedback(now Time, fb Feedback) (FeedbackResult, error) {
	if fb.StatusCode != StatusTooManyRequests && fb.StatusCode != StatusServiceUnavailable {
		return FeedbackResult{}, fmt.Errorf("%w: feedback: status_code %d is not 429 or 503; report only the provider's throttling answers", ErrInvalidRequest, fb.StatusCode)
	}
	if n := len(fb.Reason); n > MaxFieldBytes {
		return FeedbackResult{}, fmt.Errorf("%w: feedback: %s", ErrInvalidRequest, fieldTooLong("reason", n))
	}
	if fb.RetryAfter < 0 {
		return FeedbackResult{}, fmt.Errorf("%w: feedback: retry_after %v is negative; use 0 when the provider sent none", ErrInvalidRequest, fb.RetryAfter)
	}
	key, lv, err := e.scopeLevel("feedback", fb.Domain, fb.Prefix)
	if err != nil {
		return FeedbackResult{}, err
	}
	now = e.advance(now)
	res := FeedbackResult{Scope: lv.scope}
	if fb.Reason != "" || len(fb.Prefix) > 0 {
		res.Attributed = true
		if fb.RetryAfter > 0 {
			if until := addSat(now, fb.RetryAfter); until > e.pauses[key] {
				e.pauses[key] = until
			}
		}
		reset := now
		if until := e.pauses[key]; until > now {
			res.PausedFor, reset = until.Sub(now), until
		}
		if lv.adaptive != nil {
			res.Decreased = e.adaptFeedback(key, lv, now, reset, fb.StatusCode == StatusTooManyRequests)
		}
	}
	if lv.adaptive != nil {
		res.Limit = e.rateOf(key, lv, now).rpu
	}
	return res, nil
}

// Adaptive lists the adaptive buckets below their ceiling as of the engine's clock, by key.
func (e *Engine) Adaptive() []AdaptiveStatus {
	out := make([]AdaptiveStatus, 0, len(e.adapt))
	for k, a := range e.adapt {
		domain, _, _ := strings.Cut(k, "/")
		domain, _ = unescape(domain)
		r := a.lvl.rate
		out = append(out, AdaptiveStatus{Domain: domain, Key: k, Scope: a.lvl.scope,
			Limit: a.rateAt(e.clock) / microPerUnit, Ceiling: r.rpu, Window: r.window})
	}
	slices.SortFunc(out, func(x, y AdaptiveStatus) int { return strings.Compare(x.Key, y.Key) })
	return out
}

// carryPolicy moves adaptive and retry-budget state onto newly installed limits: states whose
// key no longer reaches an adaptive level (or retry budget) are dropped, rates are clamped into
// the new [floor, ceiling]. Call it before installing c (it reads the old limits).
func (e *Engine) carryPolicy(c *compiled, now Time) {
	for k, a := range e.adapt {
		nl := c.matchKey(k)
		if nl == nil || nl.adaptive == nil || nl.rate == nil {
			delete(e.adapt, k)
			continue
		}
		p := nl.adaptive
		a.base = min(max(a.rateAt(now), p.floor), p.ceil)
		a.since = max(a.since, now)
		a.lvl = nl
		if a.base >= p.ceil {
			delete(e.adapt, k)
		}
	}
	for d, st := range e.retries {
		root := c.domains[d]
		if root == nil || root.retry == nil {
			delete(e.retries, d)
			continue
		}
		if old := e.lim.domains[d]; old != nil && old.retry != nil && old.retry.minRate != nil {
			st.tokens, st.last = old.retry.refill(st.tokens, st.last, now)
		}
		st.tokens, st.last = min(st.tokens, root.retry.capMicro), now
		if st.tokens >= root.retry.capMicro {
			delete(e.retries, d)
		}
	}
}
