package region

// Re-lending (issue 13): the regional leader lends its own share holders (client.Limiters on
// the regional cluster) slices of its upstream shares of the scope: global levels, in its
// memory, with no Raft: the upstream grant bounds them (client/lender.go has the rules). The
// regional FSM still answers the share request (seq, acknowledgements, the regional levels);
// the global levels of its answer are replaced by the slices.

import (
	"fmt"
	"math"
	"math/bits"
	"time"

	"google.golang.org/protobuf/proto"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/quota"
)

// relendRetention: a downstream holder's last answer is kept this long (a retry of its seq
// gets it again).
const relendRetention = 10 * time.Minute

type relendAnswer struct {
	seq  uint64
	resp *quotadv1.ShareResponse
	at   time.Time
}

// HolderName names a downstream share holder in the leader's slices.
func HolderName(owner, id string, incarnation uint64) string {
	return fmt.Sprintf("%s\x00%s\x00%d", owner, id, incarnation)
}

// Relend replaces, in resp (the regional FSM's answer to req from holder), every scope:
// global level of a lent path by a slice of the regional leader's upstream share of it; a
// path whose slice cannot be lent now is answered central (its Limiter decides through
// Acquire, which the leader checks against its share). A duplicate answer is the one given
// for the seq before, or central on a leader that did not give it.
func (h *Holder) Relend(limitsVersion uint64, holder string, req *quotadv1.ShareRequest, resp *quotadv1.ShareResponse) *quotadv1.ShareResponse {
	h.mu.RLock()
	if h.version != limitsVersion || h.shares == nil {
		h.mu.RUnlock()
		h.sync()
		h.mu.RLock()
	}
	defer h.mu.RUnlock()
	if resp.Duplicate {
		h.relendMu.Lock()
		a := h.answers[holder]
		h.relendMu.Unlock()
		if a != nil && a.seq == resp.Seq {
			return proto.Clone(a.resp).(*quotadv1.ShareResponse)
		}
	}
	out := proto.Clone(resp).(*quotadv1.ShareResponse)
	type group struct {
		s       *share
		demand  uint64
		maxCost uint64
		grant   client.SliceGrant
	}
	groups := map[*share]*group{}
	var order []*group
	crossing := make([][]*share, len(req.Paths))
	for i, p := range req.Paths {
		entries := make([]quota.Entry, len(p.GetDescriptors()))
		for j, e := range p.GetDescriptors() {
			entries[j] = quota.Entry{Key: e.GetKey(), Value: e.GetValue()}
		}
		for _, s := range h.shares {
			if s.gp.Domain != p.GetDomain() || !prefix(s.gp.Entries, entries) {
				continue
			}
			crossing[i] = append(crossing[i], s)
			if i >= len(out.Paths) || out.Paths[i].Status != string(quota.ShareLent) || resp.Duplicate {
				continue
			}
			g := groups[s]
			if g == nil {
				g = &group{s: s}
				groups[s] = g
				order = append(order, g)
			}
			g.demand = satAdd(g.demand, p.GetDemand())
			g.maxCost = max(g.maxCost, p.GetMaxCost(), 1)
		}
	}
	term := time.Duration(out.TermNs)
	for _, g := range order {
		g.grant = g.s.lim.LendSlice(client.SliceRequest{Holder: holder, Seq: req.Seq, Ack: req.AckSeq, Demand: g.demand, MaxCost: g.maxCost})
		if g.grant.OK {
			term = min(term, g.grant.Term)
		}
	}
	for i, ss := range crossing {
		if len(ss) == 0 || i >= len(out.Paths) {
			continue
		}
		ps := out.Paths[i]
		if ps.Status != string(quota.ShareLent) && !resp.Duplicate {
			continue
		}
		why := ""
		for _, s := range ss {
			g := groups[s]
			switch {
			case g == nil:
				why = "this regional leader did not give the answer to this seq"
			case !g.grant.OK:
				why = g.grant.Why
			}
			if why != "" {
				why = fmt.Sprintf("global scope %s (domain %q, region %q): %s; decide through Acquire", s.gp.Scope, s.gp.Domain, h.cfg.Region, why)
				break
			}
			key := pathKey(s.gp)
			found := false
			for _, lv := range ps.Levels {
				if lv.Key == key {
					lv.Rate, lv.Burst, lv.Initial, lv.First = g.grant.Rate, g.grant.Burst, g.grant.Initial, g.grant.First
					found = true
				}
			}
			if !found {
				why = fmt.Sprintf("global scope %s (domain %q, region %q): the regional cluster does not lend this level (%s)", s.gp.Scope, s.gp.Domain, h.cfg.Region, key)
				break
			}
		}
		if why != "" {
			ps.Status, ps.Message, ps.Levels, ps.Fallback = string(quota.ShareCentral), why, nil, 0
			continue
		}
		// A slice of a global level fails closed once it ends without a renewal: the
		// region's fallback is its leader's (its slice of the level's fallback_rate).
		ps.Fallback = 0
	}
	out.TermNs = int64(term)
	h.relendMu.Lock()
	if h.answers == nil {
		h.answers = map[string]*relendAnswer{}
	}
	h.answers[holder] = &relendAnswer{seq: out.Seq, resp: out, at: time.Now()}
	h.relendMu.Unlock()
	return proto.Clone(out).(*quotadv1.ShareResponse)
}

// CapDemand lowers each path's demand in req to the upstream share rate of the scope: global
// levels it crosses (micro-units per second; nothing when the leader holds none), so the
// regional FSM lends the downstream holder no more of its own bucket of a global level (which
// it keeps at the full configured rate, and whose central part the leader's Acquire callers
// are also checked against) than the slice can be. It returns req itself when nothing changes.
func (h *Holder) CapDemand(req *quotadv1.ShareRequest) *quotadv1.ShareRequest {
	h.mu.RLock()
	defer h.mu.RUnlock()
	var out *quotadv1.ShareRequest
	for i, p := range req.Paths {
		entries := make([]quota.Entry, len(p.GetDescriptors()))
		for j, e := range p.GetDescriptors() {
			entries[j] = quota.Entry{Key: e.GetKey(), Value: e.GetValue()}
		}
		limit, crosses := uint64(math.MaxUint64), false
		for _, s := range h.shares {
			if s.gp.Domain != p.GetDomain() || !prefix(s.gp.Entries, entries) {
				continue
			}
			crosses = true
			if info := s.lim.Share(); info.Local {
				limit = min(limit, uint64(info.Rate*1e6))
			} else {
				limit = 0
			}
		}
		if !crosses || p.GetDemand() <= limit {
			continue
		}
		if out == nil {
			out = proto.Clone(req).(*quotadv1.ShareRequest)
		}
		out.Paths[i].Demand = limit
	}
	if out == nil {
		return req
	}
	return out
}

// EndRelends ends holder's slices granted at or before seq, its release's seq (it released
// its shares); a slice lent for a later seq — a renewal the regional FSM applied after the
// release, whose answer may be lent before this runs — stays charged (client.Limiter.EndSlices).
func (h *Holder) EndRelends(holder string, seq uint64) {
	h.mu.RLock()
	defer h.mu.RUnlock()
	for _, s := range h.shares {
		s.lim.EndSlices(holder, seq)
	}
	h.relendMu.Lock()
	if a := h.answers[holder]; a != nil && a.seq <= seq {
		delete(h.answers, holder)
	}
	h.relendMu.Unlock()
}

// reclaim gives ended slices back to the leader's local buckets and forgets old answers.
func (h *Holder) reclaim() {
	h.mu.RLock()
	for _, s := range h.shares {
		s.lim.Reclaim()
	}
	h.mu.RUnlock()
	h.relendMu.Lock()
	for k, a := range h.answers {
		if time.Since(a.at) > relendRetention {
			delete(h.answers, k)
		}
	}
	h.relendMu.Unlock()
}

// Lent returns the rate and burst (units) of the slices of each global level (by path) lent
// downstream now.
func (h *Holder) Lent() map[string][2]float64 {
	h.mu.RLock()
	defer h.mu.RUnlock()
	out := map[string][2]float64{}
	for _, s := range h.shares {
		r, b := s.lim.Lent()
		out[pathKey(s.gp)] = [2]float64{float64(r) / 1e6, float64(b) / 1e6}
	}
	return out
}

func satAdd(a, b uint64) uint64 {
	s, c := bits.Add64(a, b, 0)
	if c != 0 {
		return math.MaxUint64
	}
	return s
}
