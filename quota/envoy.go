package quota

import (
	"bytes"
	"fmt"
	"math"
	"strconv"
	"time"
)

// Envoy's rate limit service (envoy.service.ratelimit.v3) decided on the same buckets as the
// native API, with envoyproxy/ratelimit's meaning:
//
//   - each descriptor of a request is decided on its own, against the one rule its LAST entry
//     selects (Matcher.Rule); ancestors' limits do not apply, a descriptor deeper than the
//     configuration or without a rule is OK;
//   - a rule named in another selected rule's replaces (same request) does not apply;
//   - unlimited: OK, limit_remaining MaxUint32; requests_per_unit 0: OVER_LIMIT;
//   - shadow_mode: a would-be OVER_LIMIT is answered OK (and reported, for statistics);
//     quota_mode likewise, reported as a quota violation;
//   - the request is OVER_LIMIT if any descriptor is; descriptors that were within their
//     limit are charged even then (each on its own, as Envoy's counters are);
//   - a descriptor's own limit (RLSLimit, Envoy's per-descriptor override) replaces whatever
//     the configuration says for it in a configured domain — a rule, no rule, unlimited,
//     shadow_mode, quota_mode, a descriptor deeper than the configuration — and is answered
//     without a name; requests_per_unit 0 blocks. Its bucket is the descriptor's values with
//     the override's rate (Envoy: the values and the unit's window, shared by every limit of
//     that unit); when the config rule selects the same bucket with the same rate, they share it.
//
// Where quotad differs on purpose (docs/envoy.md): buckets are token buckets (burst defaults to
// one unit's worth), not clock-aligned fixed windows; a refused descriptor is not charged (Envoy
// counts every hit, so a client that keeps retrying stays limited longer there); a check
// without charge (hits 0) is OVER_LIMIT when the next hit would be refused; a domain's own
// rate_limit (quotad's ceiling, which Envoy ignores) is checked first for the whole request and
// charged once (the request's hits) when the request is OK.

// MaxRLSDescriptors caps the descriptors of one Envoy request.
const MaxRLSDescriptors = 64

// RLSCode is an answer, numbered as envoy.service.ratelimit.v3.RateLimitResponse.Code.
type RLSCode uint8

const (
	RLSUnknown   RLSCode = 0
	RLSOK        RLSCode = 1
	RLSOverLimit RLSCode = 2
)

func (c RLSCode) String() string {
	switch c {
	case RLSOK:
		return "OK"
	case RLSOverLimit:
		return "OVER_LIMIT"
	}
	return "UNKNOWN"
}

// RLSRequest is one ShouldRateLimit call.
type RLSRequest struct {
	Domain      string
	Descriptors []RLSDescriptor
	// Hits is the request's hits_addend; 0 means 1.
	Hits uint64
	// LentRate decides a level whose bucket lends shares against its central part (the rate
	// and burst left after what holders were lent), as Acquire does, and counts the hits as
	// central demand for the next allocation (command version 5). Without it (entries of
	// older leaders) RLS decided such a level at its full rate: holders plus RLS could admit
	// up to twice the level's rate.
	LentRate bool
}

// RLSDescriptor is one descriptor of an RLSRequest.
type RLSDescriptor struct {
	Entries []Entry
	// HasHits: the descriptor sets its own hits_addend (Hits), which may be 0: check without
	// charging. Otherwise it uses the request's.
	HasHits bool
	Hits    uint64
	// Limit, if set, is the descriptor's own limit (Envoy's RateLimitDescriptor.limit).
	Limit *RLSLimit
}

// RLSLimit is an Envoy descriptor's limit override: RequestsPerUnit per Unit (0 blocks).
type RLSLimit struct {
	RequestsPerUnit uint32
	Unit            time.Duration
}

// MaxOverrideUnit is the longest unit of an RLSLimit (Envoy's YEAR).
const MaxOverrideUnit = 365 * 24 * time.Hour

// RLSStatus is the answer for one descriptor.
type RLSStatus struct {
	Code RLSCode
	// Limited: a limit applied (Limit, Window, Name, Remaining, ResetAfter describe it).
	Limited   bool
	Unlimited bool // the rule is unlimited (Remaining is MaxUint32)
	Limit     uint64
	Window    time.Duration
	Name      string
	Remaining uint64
	// ResetAfter is the time until the bucket is full again (Envoy: until the window resets).
	ResetAfter time.Duration
	// Scope is "domain" when the domain's ceiling answered, else the rule's key.
	Scope string
	// Hits checked (and charged, when OK) against the bucket; Capacity its burst; UsedBefore
	// the whole units missing from it before this request. Statistics use them as Envoy's
	// counters (limit, before and after the increase).
	Hits       uint64
	Capacity   uint64
	UsedBefore uint64
	// Shadow: over the limit in shadow_mode, answered OK, nothing charged. QuotaMode: over the
	// limit in quota_mode, answered OK. Replaced: the rule was replaced by another of the
	// request's rules. TooManyKeys: the domain holds max_keys buckets and this one is new.
	Shadow      bool
	QuotaMode   bool
	Replaced    bool
	TooManyKeys bool
}

// RLSDecision is the answer to an RLSRequest.
type RLSDecision struct {
	Code     RLSCode
	Statuses []RLSStatus
	// UnknownDomain: the domain is not configured; every descriptor is OK without a limit.
	UnknownDomain bool
	// Ceiling is the domain ceiling's part (nil: the domain has none). When it refused, every
	// descriptor is OVER_LIMIT with the ceiling's limit and nothing was charged.
	Ceiling *RLSStatus
	// Message explains an RLSUnknown answer (an invalid request); nothing changed.
	Message string
}

// rlsProblem returns why an RLS request is invalid, or "".
func rlsProblem(req *RLSRequest) string {
	switch {
	case req.Domain == "":
		return "domain is empty; set the rate limit domain"
	case len(req.Domain) > MaxFieldBytes:
		return fieldTooLong("domain", len(req.Domain))
	case len(req.Descriptors) == 0:
		return "no descriptors; send at least one"
	case len(req.Descriptors) > MaxRLSDescriptors:
		return fmt.Sprintf("%d descriptors; at most %d are allowed", len(req.Descriptors), MaxRLSDescriptors)
	}
	for i := range req.Descriptors {
		es := req.Descriptors[i].Entries
		if len(es) == 0 {
			return fmt.Sprintf("descriptors[%d] has no entries; every descriptor needs at least one", i)
		}
		if msg := requestProblem(req.Domain, es, 0); msg != "" {
			return fmt.Sprintf("descriptors[%d]: %s", i, msg)
		}
		if l := req.Descriptors[i].Limit; l != nil && (l.Unit < time.Second || l.Unit%time.Second != 0 || l.Unit > MaxOverrideUnit) {
			return fmt.Sprintf("descriptors[%d].limit: unit %v; use whole seconds from 1s to %v (Envoy's SECOND to YEAR)", i, l.Unit, MaxOverrideUnit)
		}
	}
	return ""
}

// rlsRule is one descriptor's matched rule during RateLimit.
type rlsRule struct {
	lv   *level
	key  []byte // bucket key
	hits uint64
	// override: the descriptor's own limit decides (lv is a copy carrying its rate): no
	// shadow_mode, quota_mode, unlimited or replaces.
	override bool
}

// RateLimit decides an Envoy ShouldRateLimit request (see the comment at the top of this file).
// An invalid request (empty domain or key, no descriptors, too many, fields too long) is
// answered RLSUnknown with a Message and changes nothing but the clock.
func (e *Engine) RateLimit(now Time, req RLSRequest) RLSDecision {
	now = e.advance(now)
	e.rlsLentRate = req.LentRate
	defer func() { e.rlsLentRate = false }()
	if msg := rlsProblem(&req); msg != "" {
		return RLSDecision{Code: RLSUnknown, Message: msg}
	}
	n := len(req.Descriptors)
	out := RLSDecision{Code: RLSOK, Statuses: make([]RLSStatus, n)}
	for i := range out.Statuses {
		out.Statuses[i].Code = RLSOK
	}
	root := e.lim.domains[req.Domain]
	if root == nil {
		out.UnknownDomain = true
		return out
	}
	reqHits := max(req.Hits, 1)

	// Match every descriptor first: replaces works across the request's rules. Rules and
	// their bucket keys live in the engine's scratch space (e.keybuf: keys are appended one
	// after another and never rewritten during the call).
	rules := e.rlsRules[:0]
	for range n {
		rules = append(rules, rlsRule{})
	}
	kb := e.keybuf[:0]
	defer func() {
		clear(rules)
		e.rlsRules, e.keybuf = rules[:0], kb[:0]
	}()
	var replaced map[string]bool
	for i := range req.Descriptors {
		d := &req.Descriptors[i]
		hits := reqHits
		if d.HasHits {
			hits = d.Hits
		}
		if d.Limit != nil {
			rules[i], kb = e.rlsOverride(kb, root, d, hits)
			continue
		}
		lv := e.lim.envoyRule(root, d.Entries)
		if lv == nil {
			continue
		}
		rules[i] = rlsRule{lv: lv, hits: hits}
		for _, r := range lv.node.Replaces {
			if replaced == nil {
				replaced = make(map[string]bool)
			}
			replaced[r] = true
		}
	}
	for i := range rules {
		lv := rules[i].lv
		if lv == nil || rules[i].override {
			continue
		}
		st := &out.Statuses[i]
		switch {
		case lv.node.Unlimited:
			st.Unlimited, st.Remaining, st.Scope = true, math.MaxUint32, lv.scope
			rules[i].lv = nil
		case lv.node.Name != "" && replaced[lv.node.Name]:
			st.Replaced = true
			rules[i].lv = nil
		default:
			start := len(kb)
			kb = appendEscaped(kb, req.Domain)
			p := root
			for _, en := range req.Descriptors[i].Entries {
				p = p.child(en)
				kb = appendEntry(kb, p.keyEntry(en))
			}
			rules[i].key = kb[start:len(kb):len(kb)]
		}
	}

	// The domain ceiling (a quotad extension) answers for the whole request first.
	start := len(kb)
	kb = appendEscaped(kb, req.Domain)
	rootKey := kb[start:len(kb):len(kb)]
	if root.rate != nil || root.blocked > 0 {
		c := e.rlsCheck(root, rootKey, reqHits, now)
		out.Ceiling = &c
		if c.Code == RLSOverLimit {
			out.Code = RLSOverLimit
			for i := range out.Statuses {
				st := c
				st.Hits = 0
				out.Statuses[i] = st
			}
			return out
		}
	}

	// Each descriptor on its own.
	e.debitSeq++
	seq, debited := e.debitSeq, false
	for i := range rules {
		r := &rules[i]
		if r.lv == nil {
			continue
		}
		st := e.rlsCheck(r.lv, r.key, r.hits, now)
		if st.Code == RLSOK && r.hits > 0 && r.lv.rate != nil {
			if e.rlsDebit(root, r.lv, r.key, r.hits, now, seq) {
				debited = true
			} else {
				st.Code, st.TooManyKeys, st.Remaining = RLSOverLimit, true, 0
			}
		}
		if st.Code == RLSOverLimit {
			switch {
			case r.override:
				out.Code = RLSOverLimit
			case r.lv.shadow:
				st.Code, st.Shadow = RLSOK, true
			case r.lv.node.QuotaMode && !st.TooManyKeys:
				st.Code, st.QuotaMode = RLSOK, true
			default:
				out.Code = RLSOverLimit
			}
		}
		out.Statuses[i] = st
	}
	if c := out.Ceiling; c != nil && out.Code == RLSOK && c.Code == RLSOK && root.rate != nil {
		// rlsCheck answered as if debited; a full domain (max_keys) leaves the ceiling
		// uncharged rather than refusing a request its descriptors admitted.
		debited = e.rlsDebit(root, root, rootKey, reqHits, now, seq) || debited
	}
	if !debited && e.debitSeq == seq {
		e.debitSeq-- // nothing carries this sequence number
	}
	return out
}

// rlsOverride is the rule of a descriptor with its own limit, in the configured domain root.
// Its bucket key is appended to kb (returned).
func (e *Engine) rlsOverride(kb []byte, root *level, d *RLSDescriptor, hits uint64) (rlsRule, []byte) {
	ov := *root.overrideLv // a copy that carries this limit
	if d.Limit.RequestsPerUnit == 0 {
		ov.blocked = d.Limit.Unit
		return rlsRule{lv: &ov, hits: hits, override: true}, kb
	}
	rp := overrideRate(d.Limit.RequestsPerUnit, d.Limit.Unit)
	start := len(kb)
	kb = appendEscaped(kb, root.domain)
	for _, en := range d.Entries {
		kb = appendEntry(kb, en)
	}
	key := kb[start:len(kb):len(kb)]
	// The config rule's bucket, if it is this very bucket: same key, same fixed rate.
	if lv := e.lim.envoyRule(root, d.Entries); lv != nil && lv.rate != nil && lv.adaptive == nil && lv.shares == nil && lv.rate.same(rp) {
		var rk []byte
		rk = appendEscaped(rk, root.domain)
		p := root
		for _, en := range d.Entries {
			p = p.child(en)
			rk = appendEntry(rk, p.keyEntry(en))
		}
		if bytes.Equal(rk, key) {
			shared := *lv
			shared.shadow, shared.node, shared.scope = false, nil, ScopeOverride
			return rlsRule{lv: &shared, key: key, hits: hits, override: true}, kb
		}
	}
	ov.rate = rp
	kb = appendOverride(kb, d.Limit)
	return rlsRule{lv: &ov, key: kb[start:len(kb):len(kb)], hits: hits, override: true}, kb
}

// An override's bucket key is the descriptor's key plus "/%o<unit seconds>x<requests per
// unit>": a segment no configured key has ("%o" is not an escape), so the rate can be read
// back from the key (overrideKeyRate) when the bucket refills, expires or is restored.
var overrideMark = []byte("/%o")

func appendOverride(key []byte, l *RLSLimit) []byte {
	key = append(key, overrideMark...)
	key = strconv.AppendUint(key, uint64(l.Unit/time.Second), 10)
	key = append(key, 'x')
	return strconv.AppendUint(key, uint64(l.RequestsPerUnit), 10)
}

// overrideRate is the token bucket of an override: rpu > 0 per unit, capacity rpu.
func overrideRate(rpu uint32, unit time.Duration) *rateParams {
	r, err := newRateParams(&Rate{RequestsPerUnit: uint64(rpu), Unit: unit})
	if err != nil {
		panic(fmt.Sprintf("quota: override rate %d per %v: %v", rpu, unit, err)) // rlsProblem checked both
	}
	return r
}

// overrideKeyRate reads an override bucket's rate back from its key; ok is false for a key
// that is not one (a corrupt snapshot).
func overrideKeyRate(key []byte) (r *rateParams, ok bool) {
	i := bytes.LastIndex(key, overrideMark)
	if i < 0 {
		return nil, false
	}
	u, n, found := bytes.Cut(key[i+len(overrideMark):], []byte{'x'})
	if !found {
		return nil, false
	}
	secs, err1 := strconv.ParseUint(string(u), 10, 64)
	rpu, err2 := strconv.ParseUint(string(n), 10, 32)
	if err1 != nil || err2 != nil || secs == 0 || rpu == 0 || time.Duration(secs)*time.Second > MaxOverrideUnit {
		return nil, false
	}
	return overrideRate(uint32(rpu), time.Duration(secs)*time.Second), true
}

// rlsCheck answers hits at lv's bucket key without changing anything. OVER_LIMIT when the
// bucket cannot pay hits, or, for hits 0, cannot pay one unit.
func (e *Engine) rlsCheck(lv *level, key []byte, hits uint64, now Time) RLSStatus {
	st := RLSStatus{Code: RLSOK, Limited: true, Scope: lv.scope, Hits: hits}
	if lv.node != nil {
		st.Name = lv.node.Name
	}
	if lv.blocked > 0 {
		st.Code, st.Window, st.ResetAfter = RLSOverLimit, lv.blocked, lv.blocked
		return st
	}
	r, tokens, last := e.rlsBucket(lv, key, now)
	refilled, _ := r.refill(tokens, last, now)
	st.Limit, st.Window, st.Capacity = r.rpu, r.window, r.capUnits
	whole := refilled / microPerUnit
	st.UsedBefore = r.capUnits - min(r.capUnits, whole)
	need := max(hits, 1)
	if need > whole {
		st.Code = RLSOverLimit
		st.ResetAfter = r.waitUntil(tokens, last, now, r.capMicro)
		if need > r.capUnits {
			// No wait lets more than the whole capacity through; a full bucket would say 0
			// ("retry now"). envoyproxy/ratelimit answers its window's end, never 0: answer at
			// least one window (docs/envoy.md).
			st.ResetAfter = max(st.ResetAfter, r.window)
		}
		return st
	}
	after := refilled - hits*microPerUnit
	st.Remaining = after / microPerUnit
	// Full again: from the state the debit would leave (refilled as of now).
	st.ResetAfter = r.timeFor(r.capMicro - after)
	return st
}

// rlsBucket returns the effective rate of lv's bucket key and its stored state (full if absent):
// with RLSRequest.LentRate, the central part of a bucket that lends shares.
func (e *Engine) rlsBucket(lv *level, key []byte, now Time) (*rateParams, uint64, Time) {
	slot, _ := find(&e.buckets, key, e.buckets.hash(key))
	r := lv.rate
	if slot == noSlot {
		if lv.adaptive != nil {
			r = e.rateOf(string(key), lv, now)
		}
		if e.rlsLentRate {
			r = e.lentRate(key, r)
		}
		return r, r.capMicro, now
	}
	switch {
	case lv.adaptive != nil:
		r = e.slotRate(slot) // lends included, in every version
	case e.rlsLentRate:
		r = e.lentRate(key, r)
	}
	b := e.buckets.peek(slot)
	return r, b.tokens.get(), Time(b.last.get())
}

// rlsDebit takes hits from lv's bucket key, which rlsCheck found able to pay. It returns false,
// changing nothing, when the bucket is not stored and the domain already holds max_keys (or
// its parent path its level's max_keys_per_parent).
func (e *Engine) rlsDebit(root, lv *level, key []byte, hits uint64, now Time, seq uint64) bool {
	st := &e.buckets
	h := st.hash(key)
	slot, _ := find(st, key, h)
	r, tokens, last := e.rlsBucket(lv, key, now)
	tokens, last = r.refill(tokens, last, now)
	tokens -= hits * microPerUnit
	added := slot == noSlot
	if added {
		if st.domKeys[root.dom] >= root.maxKeys {
			return false
		}
		if lv.maxPerParent > 0 && st.underParent(lv.idx, key) >= lv.maxPerParent {
			return false
		}
		slot = st.add(key, h, lv.idx)
	}
	b := st.rec(slot)
	b.tokens.set(tokens)
	b.last.set(uint64(last))
	b.debit.set(seq)
	if added {
		st.push(slot, st.due(r.fullAt(tokens, last)))
	}
	if e.rlsLentRate && lv.shares != nil && len(e.sh.lends) > 0 {
		if ls := e.sh.lends[string(key)]; ls != nil {
			ls.observe(now, hits) // central demand, as observeCentral counts Acquire's
		}
	}
	return true
}
