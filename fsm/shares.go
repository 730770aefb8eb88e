package fsm

import (
	"time"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/quota"
)

// Share ops (issue 12): a holder obtains, renews and releases its shares. Replays are made
// harmless by the holder's seq, in the engine, not by the dedup table: a Share whose seq is
// not newer than the holder's last changes nothing, whenever it arrives.

func (f *FSM) applyShare(now quota.Time, o *fsmv1.Share) OpResult {
	r := o.GetRequest()
	req := quota.ShareRequest{
		Holder: quota.HolderKey{Owner: o.GetOwner(), ID: r.GetHolderId(), Incarnation: r.GetIncarnation()},
		Seq:    r.GetSeq(), AckSeq: r.GetAckSeq(),
		Paths: make([]quota.SharePath, len(r.GetPaths())),
		// Command version 4: needs before headroom.
		NeedsFirst: f.scratch.version >= 4,
		// Command version 7: lends obey max_keys and max_keys_per_parent.
		KeyCaps: f.scratch.version >= 7,
	}
	for i, p := range r.GetPaths() {
		req.Paths[i] = quota.SharePath{Domain: p.GetDomain(), Descriptors: entries(p.GetDescriptors()), Demand: p.GetDemand(), MaxCost: p.GetMaxCost()}
	}
	g, err := f.engine.Share(now, req)
	if err != nil {
		return other(OtherResult{Err: err})
	}
	return other(OtherResult{Share: &g})
}

func (f *FSM) applyReleaseShare(now quota.Time, o *fsmv1.ReleaseShare) OpResult {
	r := o.GetRequest()
	rel := quota.ShareRelease{
		Holder: quota.HolderKey{Owner: o.GetOwner(), ID: r.GetHolderId(), Incarnation: r.GetIncarnation()},
		Seq:    r.GetSeq(),
	}
	for _, t := range r.GetTokens() {
		rel.Tokens = append(rel.Tokens, quota.LevelTokens{Key: t.GetKey(), Tokens: t.GetTokens()})
	}
	n, err := f.engine.ReleaseShare(now, rel)
	return other(OtherResult{Returned: n, Err: err})
}

// ShareResponse converts a grant to the API's answer.
func ShareResponse(g *quota.ShareGrant) *quotadv1.ShareResponse {
	resp := &quotadv1.ShareResponse{Seq: g.Seq, Duplicate: g.Duplicate, TermNs: int64(g.Term), MarginNs: int64(quota.ShareMarginHolder),
		RenewAfterNs: int64(g.RenewAfter),
		Paths:        make([]*quotadv1.PathShare, len(g.Paths))}
	for i, p := range g.Paths {
		ps := &quotadv1.PathShare{Status: string(p.Status), Message: p.Message, Fallback: p.Fallback,
			PausedForMs: int64((p.PausedFor + time.Millisecond - 1) / time.Millisecond)}
		for _, l := range p.Levels {
			ps.Levels = append(ps.Levels, &quotadv1.LevelShare{Key: l.Key, Scope: l.Scope, Rate: l.Rate, Burst: l.Burst, Initial: l.Initial, First: l.First})
		}
		resp.Paths[i] = ps
	}
	return resp
}

// ShareStatus lists the lending of domain's buckets and their holders, as of the last
// applied entry (local state: callers make it linearizable).
func (f *FSM) ShareStatus(domain string) ([]quota.LendStatus, []quota.HolderStatus) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.engine.ShareStatus(domain)
}

// ShareCounts returns the share state's sizes.
func (f *FSM) ShareCounts() quota.ShareCounts {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.engine.ShareCounts()
}

// ShareStatusNow is ShareStatus with the engine's clock it was read at (Until is on it).
func (f *FSM) ShareStatusNow(domain string) ([]quota.LendStatus, []quota.HolderStatus, quota.Time) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	ls, hs := f.engine.ShareStatus(domain)
	return ls, hs, f.engine.Clock()
}

// ShareExpiries counts the holders whose shares ended without a release on this replica
// since it started (or restored a snapshot).
func (f *FSM) ShareExpiries() uint64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.engine.ShareExpiries()
}
