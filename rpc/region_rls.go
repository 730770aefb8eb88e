package rpc

// Envoy's rate limit service on a regional cluster (issue 13): a request whose rules include
// scope: global levels is decided, for those levels, from the regional leader's shares of the
// global buckets — locally, like Acquire — keeping Envoy's meaning (each descriptor against
// the one rule its last entry selects; the domain ceiling for the whole request, charged once
// when the request is OK; descriptors within their limit charged even when another is over).

import (
	"context"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	"github.com/quotad/quotad/quota"
)

// regionShouldRateLimit decides req on a regional leader when its domain has scope: global
// rules that apply to it; handled is false when none does (the caller decides as usual).
//
//   - A global domain ceiling is spent from its share first, the request's hits once; the
//     share refusing answers every descriptor OVER_LIMIT with the ceiling's limit, nothing
//     charged and nothing proposed. Given back unless the request ends OK.
//   - A descriptor whose rule is global (and not replaced by another of the request's rules)
//     spends its hits from that rule's share (hits 0: checks for one unit). The share refusing
//     makes it OVER_LIMIT: it goes to the regional log as a blocking override (requests_per_unit
//     0: OVER_LIMIT, nothing charged, no bucket), so the regional FSM answers the rest of the
//     request as Envoy would (the others charged, the ceiling not) and the status is replaced
//     by the global level's; the rules it replaces stay replaced the same way. In quota_mode
//     it is answered OK (a quota violation) and checked regionally without a charge.
//   - The regional FSM still decides the admitted descriptors at their full configured rate
//     (it never binds before the share does); a descriptor it answers OVER_LIMIT gives its
//     units back to the share.
//
// A descriptor's own limit (Envoy's per-descriptor override) replaces the configuration,
// global rules included: its bucket is regional.
func (r *rlsServer) regionShouldRateLimit(ctx context.Context, req *rlsv3.RateLimitRequest, op *fsmv1.RateLimit, start time.Time) (resp *rlsv3.RateLimitResponse, handled bool, err error) {
	s := r.s
	m := s.fsm.Matcher()
	dom := m.Domain(op.Domain)
	if dom == nil {
		return nil, false, nil
	}
	// The rule of every descriptor (nil: an override, or none), and the names they replace.
	rules := make([]*quota.Node, len(op.Descriptors))
	entries := make([][]quota.Entry, len(op.Descriptors))
	var replaced map[string]bool
	anyGlobal := dom.Rate.IsGlobal()
	for i, d := range op.Descriptors {
		if d.HasLimit {
			continue
		}
		es := make([]quota.Entry, len(d.Entries))
		for j, e := range d.Entries {
			es[j] = quota.Entry{Key: e.GetKey(), Value: e.GetValue()}
		}
		entries[i] = es
		n := m.Rule(op.Domain, es)
		if n == nil {
			continue
		}
		rules[i] = n
		anyGlobal = anyGlobal || n.Rate.IsGlobal()
		for _, x := range n.Replaces {
			if replaced == nil {
				replaced = map[string]bool{}
			}
			replaced[x] = true
		}
	}
	if !anyGlobal {
		return nil, false, nil
	}
	h := s.Region()
	version := m.Limits().Version
	admit := func(es []quota.Entry, cost uint64) (bool, func()) {
		if h == nil {
			return false, nil // a new regional leader: no upstream share until its own renewal returns
		}
		ok, undo, _, _ := h.AdmitExact(version, op.Domain, es, cost)
		return ok, undo
	}
	reqHits := max(op.Hits, 1)

	var ceilingUndo func()
	if dom.Rate.IsGlobal() {
		ok, undo := admit(nil, reqHits)
		if !ok {
			c := globalRefusal(dom.Rate, "", quota.ScopeDomain, reqHits)
			d := quota.RLSDecision{Code: quota.RLSOverLimit, Ceiling: &c, Statuses: make([]quota.RLSStatus, len(op.Descriptors))}
			for i := range d.Statuses {
				d.Statuses[i] = c
				d.Statuses[i].Hits = 0
			}
			resp := r.response(&d)
			r.observe(m, req, &d, resp.OverallCode, start)
			return resp, true, nil
		}
		ceilingUndo = undo
	}

	undos := make([]func(), len(op.Descriptors))
	over := make(map[int]quota.RLSStatus)      // refused by a share: the status Envoy gets
	quotaMode := make(map[int]quota.RLSStatus) // over a share in quota_mode: answered OK
	var blockedReplaces map[string]bool        // names replaced by a rule sent as an override
	for i, n := range rules {
		if n == nil || !n.Rate.IsGlobal() || n.Name != "" && replaced[n.Name] {
			continue
		}
		d := op.Descriptors[i]
		hits := reqHits
		if d.HasHits {
			hits = d.Hits
		}
		ok, undo := admit(entries[i], hits)
		if ok {
			undos[i] = undo
			continue
		}
		st := globalRefusal(n.Rate, n.Name, n.Key, hits)
		if n.QuotaMode {
			st.Code, st.QuotaMode = quota.RLSOK, true
			quotaMode[i] = st
			d.HasHits, d.Hits = true, 0 // checked regionally, not charged
			continue
		}
		over[i] = st
		blockRLS(d)
		for _, x := range n.Replaces {
			if blockedReplaces == nil {
				blockedReplaces = map[string]bool{}
			}
			blockedReplaces[x] = true
		}
	}
	// A rule replaced by one now sent as an override would apply in the regional FSM: send it
	// blocked too and answer it as replaced (OK, nothing charged), as Envoy does.
	replacedNow := map[int]bool{}
	for i, n := range rules {
		if n != nil && n.Name != "" && blockedReplaces[n.Name] && !op.Descriptors[i].HasLimit {
			replacedNow[i] = true
			blockRLS(op.Descriptors[i])
		}
	}

	res, err := s.prop.propose(ctx, &fsmv1.Op{Op: &fsmv1.Op_RateLimit{RateLimit: op}})
	if err != nil {
		// The outcome is unknown (the entry may commit): keep the global units spent —
		// under-admission, never over.
		return nil, true, s.applyError(err)
	}
	d := res.Other.RateLimit
	if d.Code == quota.RLSUnknown {
		r.giveBack(ceilingUndo, undos)
		return nil, true, status.Errorf(codes.InvalidArgument, "%s", d.Message)
	}
	if d.Ceiling == nil || d.Ceiling.Code != quota.RLSOverLimit {
		// The regional ceiling answered every descriptor when it refused; otherwise each
		// descriptor refused by its share gets the global level's status.
		for i, st := range over {
			d.Statuses[i] = st
		}
		for i, st := range quotaMode {
			d.Statuses[i] = st
		}
		for i := range replacedNow {
			d.Statuses[i] = quota.RLSStatus{Code: quota.RLSOK, Replaced: true}
		}
	}
	if d.Code == quota.RLSOK && len(over) > 0 {
		d.Code = quota.RLSOverLimit // the blocking overrides made it so already
	}
	if d.Code != quota.RLSOK && ceilingUndo != nil {
		ceilingUndo() // the ceiling is charged only when the request is OK
	}
	for i, undo := range undos {
		if st := &d.Statuses[i]; undo != nil && (st.Code != quota.RLSOK || st.Shadow || st.QuotaMode || st.TooManyKeys) {
			undo() // the regional FSM did not charge it
		}
	}
	resp = r.response(&d)
	r.observe(res.Other.Matcher, req, &d, resp.OverallCode, start)
	return resp, true, nil
}

func (r *rlsServer) giveBack(ceiling func(), undos []func()) {
	if ceiling != nil {
		ceiling()
	}
	for _, u := range undos {
		if u != nil {
			u()
		}
	}
}

// blockRLS makes d a blocking override in the regional log: OVER_LIMIT, nothing charged.
func blockRLS(d *fsmv1.RateLimitDescriptor) {
	d.HasLimit, d.LimitRequestsPerUnit, d.LimitUnitSeconds = true, 0, 1
}

// globalRefusal is the status of hits refused by the region's share of a global level: its
// configured limit, nothing remaining, and a reset after the time the configured rate takes to
// refill the hits (at least a second; the share refills no faster).
func globalRefusal(rate *quota.Rate, name, scope string, hits uint64) quota.RLSStatus {
	reset := time.Second
	if rate.RequestsPerUnit > 0 {
		reset = max(reset, time.Duration(float64(max(hits, 1))*float64(rate.Unit)/float64(rate.RequestsPerUnit)))
	}
	return quota.RLSStatus{Code: quota.RLSOverLimit, Limited: true, Limit: rate.RequestsPerUnit, Window: rate.Unit,
		Name: name, Remaining: 0, ResetAfter: reset, Scope: scope, Hits: hits, Capacity: rate.Capacity(), UsedBefore: rate.Capacity()}
}
