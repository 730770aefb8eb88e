package quota

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"
)

var (
	// ErrLeaseNotFound: the lease was released, expired, or never granted. Its permits, if it
	// had any, are already back.
	ErrLeaseNotFound = errors.New("quota: lease not found (released, expired or never granted)")
	// ErrUnknownDomain: no domain of that name in the installed limits.
	ErrUnknownDomain = errors.New("quota: unknown domain")
	// ErrInvalidLimits wraps every SetLimits validation error.
	ErrInvalidLimits = errors.New("quota: invalid limits")
	// ErrInvalidRequest wraps malformed arguments to Pause, Resume, Renew and Status.
	ErrInvalidRequest = errors.New("quota: invalid request")
	// ErrBadSnapshot wraps every UnmarshalBinary error.
	ErrBadSnapshot = errors.New("quota: bad snapshot")
	// ErrNotOwner: a Release or Renew by an owner other than the one that took the lease.
	// Nothing changed.
	ErrNotOwner = errors.New("quota: the lease belongs to another caller")
)

// Engine is the replicated quota state: token buckets, concurrency leases and pauses, enforced
// against an installed Limits. Every method that takes now first moves the engine's clock to
// max(clock, now), so time never runs backwards and a late timestamp is treated as "now".
//
// Methods that change state (SetLimits, Acquire, Refund, Release, Renew, Pause, Resume, Tick,
// UnmarshalBinary) are commands: replicas applying the same commands in the same order end with
// the same Hash. Status, Limits, Clock, Stats, Hash and MarshalBinary only read.
//
// An Engine is not safe for concurrent use (it reuses scratch buffers on the Acquire path); the
// fsm applies commands one at a time. The zero value is not usable; call NewEngine.
type Engine struct {
	clock Time
	lim   *compiled

	buckets  bucketStore // stored (not full) buckets, and when each may be full; see scheduleFull
	leases   map[uint64]*lease
	expiries timeHeap[expiryEntry]
	inflight map[string]uint64      // concurrency key → permits held
	pauses   map[string]Time        // scope key → paused until (exclusive)
	leaseSeq uint64                 // last lease ID issued
	debitSeq uint64                 // last admission that debited buckets (Decision.DebitSeq)
	adapt    map[string]*adaptState // adaptive bucket key → effective rate, while below the ceiling
	retries  map[string]*retryState // domain → retry budget, while not full
	sh       shareState             // share holders and lends (shares.go)
	rules    ruleSet                // share rules switched off by timeline tests only

	// held indexes the expiries of the leases holding each concurrency key (heldUntil); like
	// expiries it is derived from leases and never seen by Hash or snapshots.
	held map[string]*timeHeap[expiryEntry]

	// scratch for Acquire; valid until the next call.
	keybuf []byte
	steps  []step
	// scratch for RateLimit; valid until the next call.
	rlsRules []rlsRule
	// rlsLentRate is RLSRequest.LentRate during RateLimit.
	rlsLentRate bool
	// scratch for Tick.
	later   []heapEntry
	dropped []uint32
}

// step is one matched level of a request's path during Acquire.
type step struct {
	lv       *level
	end      int         // this level's key is keybuf[:end]
	hash     uint32      // index hash of the key, for rate-limited levels
	slot     uint32      // the stored bucket, or noSlot
	looked   bool        // slot is set
	stored   string      // the stored key, sharing the store's bytes
	r        *rateParams // effective rate of the bucket (lv.rate unless adaptive)
	tokens   uint64      // refilled balance at now, micro-units
	last     Time
	skipRate bool // shadow level that would deny: not debited
	skipConc bool // shadow level that is full: no permit taken
}

// Stats counts what an Engine holds; its memory grows with these, not with key cardinality.
type Stats struct {
	Buckets       int    // stored (not full) token buckets
	Leases        int    // live concurrency leases
	Pauses        int    // pause entries, including ones that have ended but not been ticked away
	Adapted       int    // adaptive buckets below their ceiling
	RetryBudgets  int    // domains whose retry budget is not full
	LimitsVersion uint64 // version of the installed limits
}

// NewEngine returns an engine with empty limits (version 0) at clock 0.
func NewEngine() *Engine {
	lim, err := compileLimits(&Limits{}, 0)
	if err != nil {
		panic(err) // empty limits always compile
	}
	e := &Engine{
		lim:      lim,
		buckets:  newBucketStore(),
		leases:   make(map[uint64]*lease),
		inflight: make(map[string]uint64),
		held:     make(map[string]*timeHeap[expiryEntry]),
		pauses:   make(map[string]Time),
		adapt:    make(map[string]*adaptState),
		retries:  make(map[string]*retryState),
		sh:       newShareState(),
	}
	e.buckets.setDomains(lim)
	return e
}

// Clock returns the latest time the engine has seen.
func (e *Engine) Clock() Time { return e.clock }

// Stats returns the engine's current counts.
func (e *Engine) Stats() Stats {
	return Stats{
		Buckets:       e.buckets.live,
		Leases:        len(e.leases),
		Pauses:        len(e.pauses),
		Adapted:       len(e.adapt),
		RetryBudgets:  len(e.retries),
		LimitsVersion: e.lim.limits.Version,
	}
}

// Limits returns a copy of the installed limits (domains sorted by name, Version set).
func (e *Engine) Limits() *Limits { return cloneLimits(e.lim.limits) }

// Advance moves the engine's clock to now (never backwards) without doing anything else; the
// FSM calls it for every log entry so that the clock, and what Status and snapshots report,
// follow the leader's ticks between sweeps.
func (e *Engine) Advance(now Time) { e.advance(now) }

func (e *Engine) advance(now Time) Time {
	if now > e.clock {
		if len(e.sh.events) > 0 {
			e.expireShares(now) // lend ends in FSM-time order, before anything at now
		}
		e.clock = now
		if uint64(now-e.buckets.base) >= rebaseAfter {
			e.buckets.rebase(now)
		}
	}
	return e.clock
}

// SetLimits validates l and installs it as version prev+1. Bucket balances carry over by bucket
// key: each is refilled to now under its old rate and clamped to its new capacity (a changed
// rate keeps the balance; refill under the new rate starts at now). Buckets whose key no longer
// reaches a rate-limited level are dropped. Leases are kept; their permits count against the new
// max_in_flight, which may be exceeded until they end. Pauses are kept until they end.
// On error (wrapping ErrInvalidLimits) nothing changes, not even the clock.
func (e *Engine) SetLimits(now Time, l *Limits) error {
	c, err := compileLimits(l, e.lim.limits.Version+1)
	if err != nil {
		return err
	}
	now = e.advance(now)
	st := &e.buckets
	dropped := false
	var parse []byte
	st.eachLive(func(s uint32, _ *bucketRec) {
		b := st.rec(s) // eachLive's pointer is only to read
		old := e.slotRate(s)
		tokens, last := old.refill(b.tokens.get(), Time(b.last.get()), now)
		if ol := e.lim.levels[b.lvl]; ol.override {
			// An Envoy override's bucket keeps its rate (its key holds it) while its domain exists.
			if root := c.domains[e.lim.limits.Domains[ol.dom].Name]; root != nil {
				b.tokens.set(tokens)
				b.last.set(uint64(last))
				b.lvl = root.overrideLv.idx
			} else {
				st.release(s)
				dropped = true
			}
			return
		}
		var nl *level
		nl, parse = c.matchKeyBytes(st.key(s), parse)
		if nl == nil || nl.rate == nil {
			st.release(s) // the index is rebuilt below
			dropped = true
			return
		}
		if !nl.rate.same(old) {
			// Don't let the fraction accrued under the old rate be valued at the new one. (A
			// bucket whose refill runs ahead of now, after a scheduled grant, keeps its time.)
			last = max(last, now)
			tokens = min(tokens, nl.rate.capMicro)
		}
		b.tokens.set(tokens)
		b.last.set(uint64(last))
		b.lvl = nl.idx
	})
	e.carryPolicy(c, now)
	e.lim = c
	if dropped {
		st.rebuildIndex(0)
	}
	st.setDomains(c)
	e.rebuildFullAt()
	if len(e.sh.holders) > 0 || len(e.sh.lends) > 0 {
		e.rebuildLends()
		e.clampLent()
	}
	st.settle()
	return nil
}

// requestProblem returns why a request's shape is invalid, or "".
func requestProblem(domain string, entries []Entry, ttl time.Duration) string {
	if domain == "" {
		return "domain is empty; set Request.Domain to a configured domain"
	}
	if len(domain) > MaxFieldBytes {
		return fieldTooLong("domain", len(domain))
	}
	if len(entries) > MaxDescriptors {
		return fmt.Sprintf("%d descriptor entries; at most %d are allowed", len(entries), MaxDescriptors)
	}
	for i := range entries {
		if entries[i].Key == "" {
			return fmt.Sprintf("descriptor entry #%d (value %.40q) has an empty key; every entry needs a key", i, entries[i].Value)
		}
		if n := len(entries[i].Key); n > MaxFieldBytes {
			return fieldTooLong(fmt.Sprintf("descriptor entry #%d key", i), n)
		}
		if n := len(entries[i].Value); n > MaxFieldBytes {
			return fieldTooLong(fmt.Sprintf("descriptor entry #%d (%s) value", i, entries[i].Key), n)
		}
	}
	if ttl < 0 {
		return fmt.Sprintf("lease TTL must be >= 0 (got %v); use 0 for the configured TTL", ttl)
	}
	return ""
}

// fieldTooLong is the message for a string field above MaxFieldBytes.
func fieldTooLong(field string, n int) string {
	return fmt.Sprintf("%s is %d bytes; the limit is %d bytes", field, n, MaxFieldBytes)
}

// undefinedKey returns why entries[i], the first entry that matched no child of lv, is refused
// in a strict_keys domain, or "" if lv defines its key (only the value is not configured,
// which matches nothing, as in a domain without strict_keys).
func undefinedKey(root, lv *level, entries []Entry, i int) string {
	key := entries[i].Key
	if lv.children[key] != nil {
		return ""
	}
	where := "at the top of the domain"
	if i > 0 {
		where = fmt.Sprintf("after %s=%s", entries[i-1].Key, entries[i-1].Value)
	}
	defined := make([]string, 0, len(lv.children))
	for k := range lv.children {
		defined = append(defined, k)
	}
	slices.Sort(defined)
	hint := "none (the path ends there; send fewer entries)"
	if len(defined) > 0 {
		hint = strings.Join(defined, ", ")
	}
	return fmt.Sprintf("descriptor key %q (entry #%d) is not defined %s in domain %q, which has strict_keys; keys defined there: %s",
		key, i, where, root.domain, hint)
}

// matchPath matches entries level by level below root and builds each level's key in e.keybuf.
// Matching stops at the first entry that matches nothing; later entries charge nothing.
func (e *Engine) matchPath(root *level, domain string, entries []Entry) []step {
	kb := appendEscaped(e.keybuf[:0], domain)
	steps := append(e.steps[:0], step{lv: root, end: len(kb), slot: noSlot})
	lv := root
	for _, en := range entries {
		if lv = lv.child(en); lv == nil {
			break
		}
		kb = appendEntry(kb, lv.keyEntry(en))
		steps = append(steps, step{lv: lv, end: len(kb), slot: noSlot})
	}
	e.keybuf, e.steps = kb, steps
	return steps
}

// Acquire decides req all-or-nothing across the domain ceiling, every rate-limited level on the
// matched descriptor path, every concurrency-limited level on it, and any pause covering them.
//
// Matching: each entry selects the child with the same key and value, else the child with the
// same key and an empty value (one bucket per distinct value); matching stops at the first entry
// that selects nothing. Unlimited levels and levels without a Rate charge nothing.
//
// Checks, in order; the first that refuses decides:
//  1. invalid: empty domain or entry key, negative LeaseTTL, more than MaxDescriptors entries or
//     a string field longer than MaxFieldBytes;
//  2. unknown_domain;
//  3. invalid: Cost above the capacity of a (non-shadow) bucket on the path — such a request
//     could never succeed, so rate_limited with a RetryAfter would be a lie;
//  4. paused: the domain or a matched prefix is paused; Scope is the pause with the most time
//     left, RetryAfter that time;
//  5. concurrency_limited: a level's permits are all held; Scope is the outermost full level;
//     with req.ConcurrencyRetryAfter, RetryAfter is the time until the earliest expiry of a
//     lease holding one of its permits (a permit returns then at the latest, sooner on a
//     Release), else 0;
//  6. rate_limited: a bucket holds fewer than Cost units; when several do, Scope is the one
//     with the longest RetryAfter (the binding one), so retrying after RetryAfter finds every
//     bucket refilled enough (RetryAfter is exact: one nanosecond earlier is too early);
//  7. too_many_keys: admitting would store new buckets in a domain that already holds its
//     max_keys (Limit), or a new bucket at a level whose parent path already holds that
//     level's max_keys_per_parent (Limit); Scope is the outermost new bucket's level, or that level.
//
// A shadow-mode level never refuses: when it would, it is skipped (no debit, no permit; over
// its max_keys_per_parent, or with req.ShadowMaxKeys over the domain's max_keys, no bucket
// stored) and its scope is listed in Decision.ShadowDenials. The domain's max_keys counts the
// new buckets of the enforcing levels first: only those can refuse; the shadow levels' new
// buckets take what room is left, outermost first. Without req.ShadowMaxKeys (log entries
// older than command version 7) the domain's max_keys refuses whatever the modes of the levels.
//
// Admitted: every charged bucket is debited Cost (listed in Charges), and one lease (LeaseID)
// holds one permit at every concurrency-limited level for LeaseTTL: the smallest configured
// lease_ttl among those levels, or req.LeaseTTL if set and shorter. Limit, Remaining, Window and ResetAfter
// describe the refusing bucket, or when admitted the charged bucket with the fewest remaining
// units (the outermost on a tie; the tightest concurrency level if no bucket was charged).
// A refused request changes nothing but the clock and lease expiry.
//
// Scheduled grants (req.ScheduleWithin > 0): a request refused only as rate_limited whose
// RetryAfter is at most ScheduleWithin is admitted as of now+RetryAfter instead — the buckets
// are refilled to that moment and debited then (a bucket's refill time may so run ahead of
// the clock; later requests get no credit before it), its lease starts then, and the
// Decision's RetryAfter says how long after now it takes effect. Grants scheduled one after
// another take the bucket's tokens back to back, so none is lost while the caller's answers
// are in flight.
func (e *Engine) Acquire(now Time, req Request) Decision {
	now = e.advance(now)
	e.expireLeases(now)

	cost := req.Cost
	if cost == 0 {
		cost = 1
	}
	if msg := requestProblem(req.Domain, req.Descriptors, req.LeaseTTL); msg != "" {
		return Decision{Reason: ReasonInvalid, Message: msg, Cost: cost}
	}
	if n := len(req.WorkClass); n > MaxFieldBytes {
		return Decision{Reason: ReasonInvalid, Message: fieldTooLong("work_class", n), Cost: cost}
	}
	root := e.lim.domains[req.Domain]
	if root == nil {
		return Decision{Reason: ReasonUnknownDomain, Cost: cost,
			Message: fmt.Sprintf("domain %q is not configured (limits version %d)", req.Domain, e.lim.limits.Version)}
	}
	steps := e.matchPath(root, req.Domain, req.Descriptors)
	kb := e.keybuf
	if root.strict && len(steps) <= len(req.Descriptors) {
		if msg := undefinedKey(root, steps[len(steps)-1].lv, req.Descriptors, len(steps)-1); msg != "" {
			return Decision{Reason: ReasonInvalid, Message: msg, Cost: cost}
		}
	}

	for i := range steps {
		lv := steps[i].lv
		if r := lv.rate; r != nil && !lv.shadow && cost > r.capUnits {
			d := e.levelView(&steps[i], now)
			d.Reason, d.Cost = ReasonInvalid, cost
			d.Message = fmt.Sprintf("cost %d exceeds the capacity %d of bucket %q (scope %s), so it can never be admitted; "+
				"split the request into smaller costs or raise that limit's burst", cost, r.capUnits, kb[:steps[i].end], lv.scope)
			return d
		}
	}

	if len(e.pauses) > 0 {
		best, left := -1, time.Duration(0)
		for i := range steps {
			if until, ok := e.pauses[string(kb[:steps[i].end])]; ok && until > now {
				if d := until.Sub(now); best < 0 || d > left {
					best, left = i, d
				}
			}
		}
		if best >= 0 {
			d := e.levelView(&steps[best], now)
			d.Reason, d.RetryAfter, d.Cost = ReasonPaused, left+jitterFor(req.Spread, root.jitter), cost
			return d
		}
	}

	retry := req.Attempt > 1
	if retry && root.retry != nil {
		if wait, ok := e.checkRetry(root, now); !ok {
			return Decision{Reason: ReasonRetryBudgetExhausted, Scope: ScopeDomain, RetryAfter: wait, Cost: cost,
				Message: "retries in this domain have used their budget (retry_budget); reschedule the work instead of retrying now"}
		}
	}

	var shadow []string
	nConc := 0
	concEnd := 0 // lease keys are prefixes of kb[:concEnd]
	for i := range steps {
		s := &steps[i]
		s.skipConc = false
		c := s.lv.conc
		if c == nil {
			continue
		}
		if e.inflight[string(kb[:s.end])] >= c.MaxInFlight {
			if s.lv.shadow {
				s.skipConc = true
				shadow = appendScope(shadow, s.lv.scope)
				continue
			}
			d := Decision{Reason: ReasonConcurrencyLimited, Scope: s.lv.scope, Limit: c.MaxInFlight, Cost: cost, ShadowDenials: shadow}
			if req.ConcurrencyRetryAfter {
				d.RetryAfter = e.heldUntil(string(kb[:s.end]), now)
			}
			return d
		}
		nConc++
		concEnd = s.end
	}

	costMicro := uint64(math.MaxUint64)
	if cost <= maxUnits {
		costMicro = cost * microPerUnit
	}
	concShadow := len(shadow)
	e.observeCentral(steps, now, cost)
	at := now // when the buckets are debited: now, or a scheduled grant's slot
	deny, denyRetry, nRate := e.rateSteps(steps, now, costMicro, &shadow)
	if deny >= 0 && req.ScheduleWithin > 0 && denyRetry <= req.ScheduleWithin {
		// A scheduled grant: every bucket can pay at now+denyRetry (denyRetry is exact), so
		// debit them as of then. Their refill is credited up to that moment, no further.
		slot := addSat(now, denyRetry)
		shadow = shadow[:concShadow]
		if d2, _, n2 := e.rateSteps(steps, slot, costMicro, &shadow); d2 < 0 {
			deny, at, nRate = -1, slot, n2
		} else { // cannot happen (waits are exact); refuse as at now
			shadow = shadow[:concShadow]
			deny, denyRetry, nRate = e.rateSteps(steps, now, costMicro, &shadow)
		}
	}
	if deny >= 0 {
		s := &steps[deny]
		d := e.levelView(s, now)
		d.Reason, d.RetryAfter, d.Cost, d.ShadowDenials = ReasonRateLimited, denyRetry, cost, shadow
		return d
	}
	if d, ok := e.checkKeys(root, steps, cost, &shadow, &nRate, req.ShadowMaxKeys); !ok {
		return d
	}
	if root.retry != nil {
		e.chargeRetry(root, retry, now)
	}

	// Admitted: debit every bucket, then take the permits.
	d := Decision{Admitted: true, Reason: ReasonOK, Cost: cost, ShadowDenials: shadow, RetryAfter: at.Sub(now)}
	if nRate > 0 {
		d.Charges = make([]string, 0, nRate)
		e.debitSeq++
		d.DebitSeq = e.debitSeq
	}
	st := &e.buckets
	tight, tightRem := -1, uint64(0)
	for i := range steps {
		s := &steps[i]
		if s.lv.rate == nil || s.skipRate {
			continue
		}
		added := s.slot == noSlot
		if added {
			s.slot = st.add(kb[:s.end], s.hash, s.lv.idx)
			s.stored = st.keyString(s.slot)
		}
		tokens := s.tokens - costMicro
		b := st.rec(s.slot)
		b.tokens.set(tokens)
		b.last.set(uint64(s.last))
		b.debit.set(e.debitSeq)
		if added {
			st.push(s.slot, st.due(s.r.fullAt(tokens, s.last)))
		} // else a debit only moves the full-at time later: the heap entry stays a lower bound
		d.Charges = append(d.Charges, s.stored)
		if rem := tokens / microPerUnit; tight < 0 || rem < tightRem {
			tight, tightRem = i, rem
		}
	}
	if tight >= 0 {
		s := &steps[tight]
		rateView(&d, s.lv, s.r, s.tokens-costMicro, s.last, now)
	}
	if nConc > 0 {
		e.grantLease(&d, steps, string(kb[:concEnd]), req.Owner, now, req.LeaseTTL, nConc, tight < 0)
	}
	return d
}

// checkKeys refuses (ok false) an admission that would store new buckets in a domain that
// already holds max_keys of them, or a new bucket at a level whose parent path already holds
// its max_keys_per_parent there. It runs once the admission would otherwise be admitted, so
// a request refused for another reason is refused for that one. A shadow_mode level over its
// max_keys_per_parent does not refuse: it is skipped as when its bucket cannot pay (no bucket
// stored, no debit; nRate counts one fewer) and listed in shadow. With shadowMaxKeys the same
// holds for the domain's max_keys: the enforcing levels' new buckets must fit, and the shadow
// levels' new buckets that do not fit in what is left are skipped; without it (older log
// entries) every new bucket counts and the domain's max_keys refuses whatever the modes.
func (e *Engine) checkKeys(root *level, steps []step, cost uint64, shadow *[]string, nRate *int, shadowMaxKeys bool) (Decision, bool) {
	added, first, shadowAdded := 0, -1, 0
	for i := range steps {
		s := &steps[i]
		if s.lv.rate == nil || s.skipRate || s.slot != noSlot {
			continue
		}
		if s.lv.maxPerParent > 0 && i > 0 {
			if held := e.buckets.underParent(s.lv.idx, e.keybuf[:s.end]); held >= s.lv.maxPerParent {
				if s.lv.shadow {
					s.skipRate = true
					*nRate--
					*shadow = appendScope(*shadow, s.lv.scope)
					continue
				}
				wait := s.r.timeFor(s.r.capMicro)
				parent := e.keybuf[:steps[i-1].end]
				return Decision{Reason: ReasonTooManyKeys, Scope: s.lv.scope, Limit: uint64(s.lv.maxPerParent), RetryAfter: wait,
					Cost: cost, ShadowDenials: *shadow,
					Message: fmt.Sprintf("%.80q holds %d active %q buckets and that level's max_keys_per_parent is %d, so bucket %.80q cannot be added; "+
						"buckets are dropped once idle and full again (within %v), or raise max_keys_per_parent",
						parent, held, s.lv.scope, s.lv.maxPerParent, e.keybuf[:s.end], wait)}, false
			}
		}
		if shadowMaxKeys && s.lv.shadow {
			shadowAdded++ // fitted below, after the enforcing levels' buckets
			continue
		}
		if added++; first < 0 {
			first = i
		}
	}
	held := e.buckets.domKeys[root.dom]
	if added > 0 && held+added > root.maxKeys {
		s := &steps[first]
		// A stored bucket is dropped once it is full again: by then an idle key has made room.
		wait := s.r.timeFor(s.r.capMicro)
		return Decision{Reason: ReasonTooManyKeys, Scope: s.lv.scope, Limit: uint64(root.maxKeys), RetryAfter: wait,
			Cost: cost, ShadowDenials: *shadow,
			Message: fmt.Sprintf("domain %q holds %d active buckets and max_keys is %d, so bucket %.80q cannot be added; "+
				"buckets are dropped once idle and full again (within %v), or raise the domain's max_keys",
				root.domain, held, root.maxKeys, e.keybuf[:s.end], wait)}, false
	}
	if room := root.maxKeys - held - added; shadowAdded > room {
		for i := range steps {
			s := &steps[i]
			if s.lv.rate == nil || s.skipRate || s.slot != noSlot || !s.lv.shadow {
				continue
			}
			if room > 0 {
				room--
				continue
			}
			s.skipRate = true
			*nRate--
			*shadow = appendScope(*shadow, s.lv.scope)
		}
	}
	return Decision{}, true
}

// rateSteps refills every rate-limited level of steps as of now and reports the level that
// cannot pay costMicro (deny, -1 if none; the one with the longest wait), that wait, and how
// many levels will be charged. Shadow levels that cannot pay are skipped and listed in shadow.
func (e *Engine) rateSteps(steps []step, now Time, costMicro uint64, shadow *[]string) (deny int, denyRetry time.Duration, nRate int) {
	kb := e.keybuf
	deny = -1
	for i := range steps {
		s := &steps[i]
		s.skipRate = false
		r := s.lv.rate
		if r == nil {
			if s.lv.blocked > 0 { // requests_per_unit 0: refuses everything, never pays
				if s.lv.shadow {
					s.skipRate = true
					*shadow = appendScope(*shadow, s.lv.scope)
				} else if deny < 0 || s.lv.blocked > denyRetry {
					deny, denyRetry = i, s.lv.blocked
				}
			}
			continue
		}
		key := kb[:s.end]
		s.hash = e.buckets.hash(key)
		s.slot, s.stored = find(&e.buckets, key, s.hash)
		s.looked = true
		// Waits are computed from the stored state, which a refusal leaves as it is: the
		// refilled one has its last rounded up and would overstate them by up to 1ns.
		storedTokens, storedLast := r.capMicro, now
		if s.slot == noSlot {
			if s.lv.adaptive != nil {
				r = e.rateOf(string(key), s.lv, now)
			}
			r = e.lentRate(key, r)
			s.tokens, s.last = r.capMicro, now
		} else {
			if s.lv.adaptive != nil {
				r = e.slotRate(s.slot)
			} else {
				r = e.lentRate(key, r)
			}
			b := e.buckets.peek(s.slot)
			storedTokens, storedLast = b.tokens.get(), Time(b.last.get())
			s.tokens, s.last = r.refill(storedTokens, storedLast, now)
		}
		s.r = r
		if s.tokens >= costMicro {
			nRate++
			continue
		}
		if s.lv.shadow {
			s.skipRate = true
			*shadow = appendScope(*shadow, s.lv.scope)
			continue
		}
		if retry := r.waitUntil(storedTokens, storedLast, now, costMicro); deny < 0 || retry > denyRetry {
			deny, denyRetry = i, retry
		}
	}
	return deny, denyRetry, nRate
}

// grantLease takes one permit at every non-skipped concurrency level under one new lease; the
// levels' keys are prefixes of path.
func (e *Engine) grantLease(d *Decision, steps []step, path, owner string, now Time, ttl time.Duration, n int, report bool) {
	keys := make([]string, 0, n)
	configured := time.Duration(0)
	tight, tightRem := -1, uint64(0)
	for i := range steps {
		s := &steps[i]
		c := s.lv.conc
		if c == nil || s.skipConc {
			continue
		}
		k := path[:s.end]
		keys = append(keys, k)
		if configured == 0 || c.LeaseTTL < configured {
			configured = c.LeaseTTL
		}
		if rem := c.MaxInFlight - min(c.MaxInFlight, e.inflight[k]+1); tight < 0 || rem < tightRem {
			tight, tightRem = i, rem
		}
	}
	if ttl == 0 || ttl > configured {
		ttl = configured // a caller may not hold a permit longer than the limits say
	}
	e.leaseSeq++
	e.addLease(&lease{id: e.leaseSeq, expiry: addSat(now, ttl), ttl: ttl, keys: keys, owner: owner})
	d.LeaseID, d.LeaseTTL = e.leaseSeq, ttl
	if report {
		d.Scope, d.Limit, d.Remaining = steps[tight].lv.scope, steps[tight].lv.conc.MaxInFlight, tightRem
	}
}

func appendScope(scopes []string, s string) []string {
	if slices.Contains(scopes, s) {
		return scopes
	}
	return append(scopes, s)
}

func addSat(t Time, d time.Duration) Time {
	if d > 0 && int64(t) > math.MaxInt64-int64(d) {
		return Time(math.MaxInt64)
	}
	return t.Add(d)
}

// rateView fills the bucket fields of d from a bucket of lv at rate r whose stored state is
// (tokens, last).
func rateView(d *Decision, lv *level, r *rateParams, tokens uint64, last, now Time) {
	d.Scope = lv.scope
	d.Limit = r.rpu
	d.Window = r.window
	refilled, _ := r.refill(tokens, last, now)
	d.Remaining = refilled / microPerUnit
	d.ResetAfter = r.waitUntil(tokens, last, now, r.capMicro)
}

// levelView describes a matched level without changing anything: its bucket if it has a rate,
// else its concurrency.
func (e *Engine) levelView(s *step, now Time) Decision {
	key := e.keybuf[:s.end]
	d := Decision{Scope: s.lv.scope}
	if r := s.lv.rate; r != nil {
		tokens, last := r.capMicro, now // absent: full
		slot := s.slot
		if !s.looked {
			slot, _ = find(&e.buckets, key, e.buckets.hash(key))
		}
		if slot != noSlot {
			b := e.buckets.peek(slot)
			tokens, last = b.tokens.get(), Time(b.last.get())
		}
		if s.lv.adaptive != nil {
			r = e.rateOf(string(key), s.lv, last)
		}
		r = e.lentRate(key, r)
		rateView(&d, s.lv, r, tokens, last, now)
	} else if s.lv.blocked > 0 {
		d.Window = s.lv.blocked
		d.Message = fmt.Sprintf("blocked: the limit at scope %s has requests_per_unit 0, so it admits nothing; raise it in the limits to admit requests", s.lv.scope)
	} else if c := s.lv.conc; c != nil {
		d.Limit = c.MaxInFlight
		d.Remaining = c.MaxInFlight - min(c.MaxInFlight, e.inflight[string(key)])
	}
	return d
}

// stored returns the stored state of the bucket key; an absent bucket is full.
func (e *Engine) stored(key string, r *rateParams, now Time) (uint64, Time) {
	if s, _ := find(&e.buckets, key, e.buckets.hashString(key)); s != noSlot {
		b := e.buckets.peek(s)
		return b.tokens.get(), Time(b.last.get())
	}
	return r.capMicro, now
}

// Refund returns cost units to the buckets an admission charged (its Decision.Charges), clamped
// to capacity, and reports, bucket by bucket, whether the admission's debit was undone.
//
// A bucket takes the units back only if that admission (debitSeq, its Decision.DebitSeq) is
// still the last one that debited it. Then the refund restores exactly the state the bucket
// would have without the admission (it takes back as much as its capacity holds: nothing if it
// had refilled), so the bounded-admission invariant holds; a bucket that is gone was full and
// dropped, and is restored too. Once another admission debited the bucket the units cannot be
// told apart from capacity already handed out again, and that bucket keeps them. The caller
// (the FSM) refunds an admission at most once: a second refund finds every bucket's debit
// cleared and reports them kept.
func (e *Engine) Refund(now Time, charges []string, cost uint64, debitSeq uint64) RefundResult {
	now = e.advance(now)
	var res RefundResult
	if len(charges) == 0 || cost == 0 || debitSeq == 0 {
		return res
	}
	st := &e.buckets
	for _, k := range charges {
		s, _ := find(st, k, st.hashString(k))
		if s == noSlot {
			res.Restored++
			continue
		}
		if st.peek(s).debit.get() != debitSeq {
			res.Kept++
			continue
		}
		res.Restored++
		b := st.rec(s)
		r := e.slotRate(s)
		tokens, last := r.refill(b.tokens.get(), Time(b.last.get()), now)
		add := min(cost, r.capUnits) * microPerUnit
		add = min(add, r.capMicro-tokens)
		b.tokens.set(tokens + add)
		b.last.set(uint64(last))
		b.debit.set(0)
		// The bucket is full sooner now: move its heap entry earlier if it was later.
		if due := st.due(e.slotFullAt(s)); due < st.hAt(int(b.pos)).due {
			st.setDue(s, due)
		}
	}
	return res
}

// Release ends a lease and returns its permits. It reports false if the lease is unknown or has
// already expired (its permits are then already back).
func (e *Engine) Release(now Time, leaseID uint64) bool {
	ok, _ := e.ReleaseBy(now, leaseID, "")
	return ok
}

// ReleaseBy is Release on behalf of owner: a lease taken by another owner is left alone and
// the answer is ErrNotOwner. An empty owner (an admin) may release any lease, and a lease
// taken without an owner may be released by anyone.
func (e *Engine) ReleaseBy(now Time, leaseID uint64, owner string) (bool, error) {
	now = e.advance(now)
	e.expireLeases(now)
	l := e.leases[leaseID]
	if l == nil {
		return false, nil
	}
	if !l.ownedBy(owner) {
		return false, fmt.Errorf("release lease %d: %w", leaseID, ErrNotOwner)
	}
	e.endLease(l)
	return true, nil
}

// Renew extends a live lease to now+ttl (ttl 0: the TTL it was granted with) and returns the TTL
// applied. A ttl above the lease_ttl configured now for the lease's levels (the smallest) is
// clamped to it, as at Acquire. A lease at or past its expiry is gone: ErrLeaseNotFound.
func (e *Engine) Renew(now Time, leaseID uint64, ttl time.Duration) (time.Duration, error) {
	return e.RenewBy(now, leaseID, ttl, "")
}

// RenewBy is Renew on behalf of owner, with ReleaseBy's ownership rule.
func (e *Engine) RenewBy(now Time, leaseID uint64, ttl time.Duration, owner string) (time.Duration, error) {
	now = e.advance(now)
	e.expireLeases(now)
	if ttl < 0 {
		return 0, fmt.Errorf("%w: renew lease %d: ttl must be >= 0 (got %v); use 0 for the granted TTL", ErrInvalidRequest, leaseID, ttl)
	}
	l := e.leases[leaseID]
	if l == nil {
		return 0, fmt.Errorf("renew lease %d: %w", leaseID, ErrLeaseNotFound)
	}
	if !l.ownedBy(owner) {
		return 0, fmt.Errorf("renew lease %d: %w", leaseID, ErrNotOwner)
	}
	if ttl == 0 {
		ttl = l.ttl
	}
	ttl = min(ttl, e.leaseCap(l))
	l.expiry = addSat(now, ttl)
	e.expiries.push(expiryEntry{at: l.expiry, id: l.id})
	e.indexHeld(l)
	return ttl, nil
}

// leaseCap is the longest TTL lease l may be renewed for: the smallest lease_ttl of the
// concurrency levels its keys reach under the installed limits, or the TTL it was granted if
// they reach none any more.
func (e *Engine) leaseCap(l *lease) time.Duration {
	limit := time.Duration(0)
	for _, k := range l.keys {
		if lv := e.lim.matchKey(k); lv != nil && lv.conc != nil && (limit == 0 || lv.conc.LeaseTTL < limit) {
			limit = lv.conc.LeaseTTL
		}
	}
	if limit == 0 {
		return l.ttl
	}
	return limit
}

// scopeKey matches prefix fully against domain's tree and returns the scope's key and name.
func (e *Engine) scopeKey(op, domain string, prefix []Entry) (key, scope string, err error) {
	key, lv, err := e.scopeLevel(op, domain, prefix)
	if err != nil {
		return "", "", err
	}
	return key, lv.scope, nil
}

// scopeLevel matches prefix fully against domain's tree and returns the scope's key and level.
func (e *Engine) scopeLevel(op, domain string, prefix []Entry) (string, *level, error) {
	if msg := requestProblem(domain, prefix, 0); msg != "" {
		return "", nil, fmt.Errorf("%w: %s: %s", ErrInvalidRequest, op, msg)
	}
	lv := e.lim.domains[domain]
	if lv == nil {
		return "", nil, fmt.Errorf("%s: domain %q: %w", op, domain, ErrUnknownDomain)
	}
	kb := appendEscaped(nil, domain)
	for i, en := range prefix {
		if lv = lv.child(en); lv == nil {
			return "", nil, fmt.Errorf("%w: %s: descriptor entry #%d (%s=%s) matches no limit in domain %q; name a prefix of a configured descriptor path",
				ErrInvalidRequest, op, i, en.Key, en.Value, domain)
		}
		kb = appendEntry(kb, lv.keyEntry(en))
	}
	return string(kb), lv, nil
}

// Pause refuses every request through the scope named by domain and a descriptor prefix (empty:
// the whole domain) until `until`, with reason paused. The prefix must match the domain's tree
// entry by entry. An existing pause is only ever extended, so concurrent reports of the same
// provider 429 cannot shorten one another; use Resume to lift a pause early. until <= now changes
// nothing. Returns the scope name: "domain" or the last entry's key.
func (e *Engine) Pause(now Time, domain string, prefix []Entry, until Time) (scope string, err error) {
	key, scope, err := e.scopeKey("pause", domain, prefix)
	if err != nil {
		return "", err
	}
	now = e.advance(now)
	if until > now && until > e.pauses[key] {
		e.pauses[key] = until
	}
	return scope, nil
}

// Resume lifts a pause set by Pause on exactly that scope; it reports whether one was active.
func (e *Engine) Resume(now Time, domain string, prefix []Entry) (bool, error) {
	key, _, err := e.scopeKey("resume", domain, prefix)
	if err != nil {
		return false, err
	}
	now = e.advance(now)
	until, ok := e.pauses[key]
	delete(e.pauses, key)
	return ok && until > now, nil
}

// Tick expires leases and pauses whose time has come and drops exactly the buckets that have
// refilled to capacity by now (an absent bucket is full), so memory follows active keys only.
// Its cost is proportional to what is due, not to the number of stored buckets.
func (e *Engine) Tick(now Time) {
	now = e.advance(now)
	e.expireLeases(now)
	for k, until := range e.pauses {
		if until <= now {
			delete(e.pauses, k)
		}
	}
	e.sweepAdaptive(now)
	e.sweepRetries(now)
	e.dropFull(now)
	e.buckets.settle()
}

// dropFull drops every bucket that is full at now. A heap entry's due is a lower bound in
// units of ~1ms, so entries due in now's unit may belong to buckets that are not full yet: those
// are set aside and put back afterwards, to be looked at again by the next Tick.
func (e *Engine) dropFull(now Time) {
	st := &e.buckets
	cnow := st.due(now)
	later := e.later[:0]
	for popped := 0; st.hlen > 0 && st.top().due <= cnow; popped++ {
		if popped >= 64 && popped >= st.hlen/16 {
			// Much is due (say a burst of keys a while ago): one sequential pass over the heap
			// beats popping each entry at O(log n) cache misses.
			for _, x := range later {
				st.push(x.slot, x.due)
			}
			e.later = later[:0]
			e.sweepFull(now, cnow)
			return
		}
		s := st.top().slot
		if e.isLent(s) { // never swept: absent would mean full at burst − lent
			st.setDue(s, math.MaxUint32)
			continue
		}
		fa := e.slotFullAt(s)
		if fa <= now {
			st.pop()
			st.drop(s)
			continue
		}
		if due := st.due(fa); due > cnow {
			st.setDue(s, due)
		} else {
			st.pop()
			later = append(later, heapEntry{due, s})
		}
	}
	for _, x := range later {
		st.push(x.slot, x.due)
	}
	e.later = later[:0]
}

// sweepFull is dropFull in one pass: filter the heap array in place, then re-heapify.
func (e *Engine) sweepFull(now Time, cnow uint32) {
	st := &e.buckets
	dropped := e.dropped[:0]
	kept := 0
	for p := 0; p < st.hlen; p++ { // each read yields at most one write, at or before it
		x := *st.hAt(p)
		if x.due <= cnow && e.isLent(x.slot) {
			x.due = math.MaxUint32
		} else if x.due <= cnow {
			fa := e.slotFullAt(x.slot)
			if fa <= now {
				dropped = append(dropped, x.slot)
				continue
			}
			x.due = st.due(fa)
		}
		*st.hAt(kept) = x
		kept++
	}
	st.hlen = kept
	if len(dropped) > st.live/4 {
		// Cheaper to rebuild the index than to delete so many keys from it one by one.
		for _, s := range dropped {
			st.release(s)
		}
		st.rebuildIndex(0)
	} else {
		for _, s := range dropped {
			st.drop(s)
		}
	}
	e.dropped = dropped[:0]
	if st.live > 0 {
		st.heapify()
	}
}

// slotRate returns the rate that governs the stored bucket in slot s (see rateOf): its central
// part when it has lends.
func (e *Engine) slotRate(s uint32) *rateParams {
	return e.lentRate(e.buckets.key(s), e.baseSlotRate(s))
}

// baseSlotRate is slotRate before lends.
func (e *Engine) baseSlotRate(s uint32) *rateParams {
	b := e.buckets.peek(s)
	lv := e.lim.levels[b.lvl]
	if lv.override {
		if r, ok := overrideKeyRate(e.buckets.key(s)); ok {
			return r
		}
		panic(fmt.Sprintf("quota: override bucket %q has no rate in its key", e.buckets.key(s)))
	}
	if lv.adaptive == nil {
		return lv.rate
	}
	a := e.adapt[string(e.buckets.key(s))]
	if a == nil {
		return lv.rate
	}
	return lv.rate.withRate(a.rateAt(Time(b.last.get())))
}

// slotFullAt returns when the stored bucket in slot s is full, absent debits.
func (e *Engine) slotFullAt(s uint32) Time {
	b := e.buckets.peek(s)
	return e.slotRate(s).fullAt(b.tokens.get(), Time(b.last.get()))
}

// scheduleFull moves the heap entry of the bucket in slot s to the time it becomes full.
// Invariant: every stored bucket has one heap entry, due no later than the time it becomes full
// (a debit only makes that later). So Tick(now) visits every bucket full at now, and drops
// exactly those, whatever the heap's history: replicas and restored snapshots agree.
func (e *Engine) scheduleFull(s uint32) {
	e.buckets.setDue(s, e.buckets.due(e.slotFullAt(s)))
}

// rebuildFullAt rebuilds the full-at heap from the stored buckets.
func (e *Engine) rebuildFullAt() {
	st := &e.buckets
	st.base = e.clock
	st.hlen = 0
	st.eachLive(func(s uint32, _ *bucketRec) {
		*st.hAt(st.hlen) = heapEntry{st.due(e.slotFullAt(s)), s}
		st.hlen++
	})
	st.heapify()
}

// Status describes every level on the path that a request with these descriptors would match —
// the domain first — as of now, changing nothing (not even the clock). InFlight counts leases not
// yet reaped; an expired lease is reaped by the next command at or after its expiry.
func (e *Engine) Status(now Time, domain string, path []Entry) ([]BucketStatus, error) {
	if msg := requestProblem(domain, path, 0); msg != "" {
		return nil, fmt.Errorf("%w: status: %s", ErrInvalidRequest, msg)
	}
	now = max(now, e.clock)
	lv := e.lim.domains[domain]
	if lv == nil {
		return nil, fmt.Errorf("status: domain %q: %w", domain, ErrUnknownDomain)
	}
	root := lv
	kb := appendEscaped(nil, domain)
	out := []BucketStatus{e.status(lv, string(kb), now)}
	if p := lv.retry; p != nil {
		tokens, last, _ := e.retryBalance(domain, p, now)
		tokens, _ = p.refill(tokens, last, now)
		out[0].RetryTokens = tokens / microPerUnit
	}
	for i, en := range path {
		child := lv.child(en)
		if child == nil {
			// As Acquire refuses it: a key the strict_keys domain does not define there is a
			// typo, and listing only the levels above it would hide that.
			if root.strict {
				if msg := undefinedKey(root, lv, path, i); msg != "" {
					return nil, fmt.Errorf("%w: status: %s", ErrInvalidRequest, msg)
				}
			}
			break
		}
		lv = child
		kb = appendEntry(kb, lv.keyEntry(en))
		out = append(out, e.status(lv, string(kb), now))
	}
	return out, nil
}

func (e *Engine) status(lv *level, key string, now Time) BucketStatus {
	st := BucketStatus{Scope: lv.scope, Key: key}
	if r := lv.rate; r != nil {
		tokens, last := e.stored(key, e.lentRate([]byte(key), r), now)
		if lv.adaptive != nil {
			r = e.rateOf(key, lv, last)
			st.Ceiling = lv.rate.rpu
		}
		full := r
		r = e.lentRate([]byte(key), r)
		if r != full {
			// Lent to share holders: what follows is the central part only; say how much is
			// lent, or an operator reads a 100/s limit as 10/s.
			st.LentLimit, st.LentBurst = full.rpu-min(full.rpu, r.rpu), full.capUnits-min(full.capUnits, r.capUnits)
		}
		refilled, _ := r.refill(tokens, last, now)
		st.Limit, st.Burst, st.Window = r.rpu, r.capUnits, r.window
		st.Remaining = refilled / microPerUnit
		st.ResetAfter = r.waitUntil(tokens, last, now, r.capMicro)
	}
	if lv.blocked > 0 {
		st.Window = lv.blocked
	}
	if c := lv.conc; c != nil {
		st.MaxInFlight = c.MaxInFlight
		st.InFlight = e.inflight[key]
	}
	if until, ok := e.pauses[key]; ok && until > now {
		st.PausedFor = until.Sub(now)
	}
	return st
}
