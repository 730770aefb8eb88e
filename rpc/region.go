package rpc

// A regional cluster (issue 13, package region): its leader holds shares of the global
// cluster's buckets for the scope: global levels and spends them, locally, before an
// admission enters the regional log. Kept in its own file so server.go stays as it was.

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/config"
	"github.com/quotad/quotad/quota"
)

// RegionConfig makes an agent a member of a regional cluster under a global one
// (--region, --global-addrs and the global credential flags).
type RegionConfig struct {
	// Name is the region (--region).
	Name string
	// Start starts holding shares of the global cluster's buckets for the scope: global
	// levels of limits() (region.Start, wired by cmd/quotad: rpc does not import the client
	// library). It is called each time this node becomes the regional leader. follow makes
	// the global cluster's limits the regional cluster's, through the regional Raft log
	// (FollowGlobalLimits).
	Start func(nodeID string, limits func() *quota.Limits, follow func(ctx context.Context, global *quota.Limits) (bool, error), log *slog.Logger) (RegionHolder, error)
}

// RegionHolder is the regional leader's share holder (*region.Holder).
type RegionHolder interface {
	// Admit spends cost at every scope: global level on the path from the shares, locally:
	// ok and an undo (nil if nothing was spent), or the refusing level and why.
	// limitsVersion is the version of the limits the regional cluster enforces: a holder
	// that follows older ones updates first.
	Admit(limitsVersion uint64, domain string, entries []quota.Entry, cost uint64) (ok bool, undo func(), scope, message string)
	// AdmitExact is Admit at the one global level whose path is exactly (domain, entries) (an
	// Envoy descriptor's rule; its ancestors do not apply); cost 0 checks without spending.
	AdmitExact(limitsVersion uint64, domain string, entries []quota.Entry, cost uint64) (ok bool, undo func(), scope, message string)
	// Relend replaces, in resp (the regional FSM's answer to a downstream share holder's
	// req), the scope: global levels by slices of the leader's upstream shares (or answers
	// the path central); holder names the downstream holder.
	Relend(limitsVersion uint64, holder string, req *quotadv1.ShareRequest, resp *quotadv1.ShareResponse) *quotadv1.ShareResponse
	// CapDemand lowers the demand of req's paths to the upstream share rate of the global
	// levels they cross (the regional FSM then lends its own bucket of them no more).
	CapDemand(req *quotadv1.ShareRequest) *quotadv1.ShareRequest
	// EndRelends ends a downstream holder's slices granted at or before seq, the seq of its
	// release (it released its shares); slices lent for a later seq stay.
	EndRelends(holder string, seq uint64)
	// Shares describes the share of every global level (quotad status, metrics).
	Shares() []RegionShare
	// Close releases the shares; later Admits at global levels refuse.
	Close()
}

// RegionShare is the regional leader's current share of one global level.
type RegionShare struct {
	Domain string `json:"domain"`
	Path   string `json:"path"`
	Scope  string `json:"scope"`
	// Status: lent, central, too_small, invalid or pending (client.ShareInfo).
	Status   string    `json:"status"`
	Local    bool      `json:"local"`
	Rate     float64   `json:"rate"`
	Capacity float64   `json:"capacity"`
	Expiry   time.Time `json:"expiry,omitzero"`
	Message  string    `json:"message,omitempty"`
	// Admitted, Refused and Undone count units decided at the level by this holder
	// (Undone: admitted here, refused by a regional level, given back).
	Admitted uint64 `json:"admitted"`
	Refused  uint64 `json:"refused"`
	Undone   uint64 `json:"undone"`
}

// regionMembers adds the region and, from the regional leader, its shares to a Members
// answer.
func (s *Server) regionMembers(ctx context.Context, resp *quotadv1.MembersResponse) {
	if s.region == nil {
		return
	}
	resp.Region = s.region.cfg.Name
	h := s.Region()
	if h == nil {
		if conn, err := s.route(ctx); err == nil && conn != nil {
			if lr, err := quotadv1.NewAdminClient(conn).Members(forwardCtx(ctx), &quotadv1.MembersRequest{}); err == nil {
				resp.RegionShares = lr.RegionShares
			}
		}
		return
	}
	for _, r := range h.Shares() {
		var in int64
		if !r.Expiry.IsZero() {
			in = max(0, time.Until(r.Expiry).Milliseconds())
		}
		resp.RegionShares = append(resp.RegionShares, &quotadv1.RegionShare{Domain: r.Domain, Path: r.Path, Scope: r.Scope,
			Status: r.Status, Local: r.Local, Rate: r.Rate, Capacity: r.Capacity, ExpiresInMs: in, Message: r.Message,
			Admitted: r.Admitted, Refused: r.Refused, Undone: r.Undone})
	}
}

// regionGate holds the regional leader's share holder (nil while this node does not lead).
type regionGate struct {
	cfg RegionConfig
	h   atomic.Pointer[holderBox]
}

type holderBox struct{ RegionHolder }

// Region returns the share holder while this node leads its regional cluster (nil
// otherwise, or when the cluster is not regional).
func (s *Server) Region() RegionHolder {
	if s.region == nil {
		return nil
	}
	if b := s.region.h.Load(); b != nil {
		return b.RegionHolder
	}
	return nil
}

// regionAcquire decides req's scope: global levels from the region's shares, then the rest on
// the regional leader; an admission a regional level refuses gives its global units back.
func (s *Server) regionAcquire(ctx context.Context, req *quotadv1.AcquireRequest, id auth.Identity) (*quotadv1.AcquireResponse, error) {
	h := s.Region()
	n := len(req.Admissions)
	resp := &quotadv1.AcquireResponse{Decisions: make([]*quotadv1.Decision, n)}
	sub := &quotadv1.AcquireRequest{ClientId: req.ClientId, Admissions: make([]*quotadv1.Admission, 0, n)}
	idx := make([]int, 0, n)
	undos := make([]func(), 0, n)
	var lim *quota.Limits
	version := s.fsm.LimitsVersion()
	for i, adm := range req.Admissions {
		if adm == nil || admissionProblem(adm) != "" {
			sub.Admissions, idx, undos = append(sub.Admissions, adm), append(idx, i), append(undos, nil)
			continue // the leader answers it as invalid
		}
		entries := make([]quota.Entry, len(adm.Descriptors))
		for j, e := range adm.Descriptors {
			entries[j] = quota.Entry{Key: e.GetKey(), Value: e.GetValue()}
		}
		cost := max(adm.Cost, 1)
		var (
			ok         bool
			undo       func()
			scope, why string
		)
		if s.fsm.Decided(id.Name, req.ClientId, adm.RequestId) {
			// A retry the leader answers from its dedup table: decided (and its global units
			// spent, if admitted) the first time; spend nothing again.
			sub.Admissions, idx, undos = append(sub.Admissions, adm), append(idx, i), append(undos, nil)
			continue
		}
		if h != nil {
			ok, undo, scope, why = h.Admit(version, adm.Domain, entries, cost)
		} else {
			if lim == nil {
				lim = s.fsm.Limits()
			}
			ok, scope, why = noHolder(s.region.cfg.Name, lim, adm.Domain, entries)
		}
		if !ok {
			resp.Decisions[i] = &quotadv1.Decision{Reason: string(quota.ReasonRateLimited), Scope: scope, Message: why, RetryAfterMs: 100}
			continue
		}
		sub.Admissions, idx, undos = append(sub.Admissions, adm), append(idx, i), append(undos, undo)
	}
	if len(sub.Admissions) > 0 {
		r, err := s.acquireLeader(ctx, sub, id)
		if err != nil {
			// The outcome is unknown (the admissions may have committed): keep the global
			// units spent — under-admission, never over.
			return nil, err
		}
		for j, d := range r.Decisions {
			resp.Decisions[idx[j]] = d
			if undos[j] != nil && (d == nil || !d.Admitted) {
				undos[j]()
			}
		}
	}
	return resp, nil
}

// noHolder decides global levels on a leader whose holder has not started yet: every
// admission at a scope: global level is refused (a new regional leader uses no upstream share
// until its own renewal returns).
func noHolder(name string, l *quota.Limits, domain string, entries []quota.Entry) (ok bool, scope, message string) {
	for _, gp := range l.GlobalPaths() {
		if gp.Domain != domain || len(gp.Entries) > len(entries) {
			continue
		}
		match := true
		for i := range gp.Entries {
			match = match && gp.Entries[i] == entries[i]
		}
		if match {
			return false, gp.Scope, fmt.Sprintf("global scope %s (domain %q, region %q): no share of the global limit yet (this node has just become the regional leader)", gp.Scope, domain, name)
		}
	}
	return true, "", ""
}

// SetRegion makes s a regional cluster's server: Acquire checks scope: global levels against
// the leader's shares (RunRegion starts and stops the holder with leadership).
func (s *Server) SetRegion(cfg RegionConfig) { s.region = &regionGate{cfg: cfg} }

// RunRegion holds the global shares while this node leads the regional cluster: a new
// holder (a new incarnation at the global cluster) each time it gains leadership, closed
// when it loses it or stop closes. It returns when stop is closed.
func (s *Server) RunRegion(stop <-chan struct{}, nodeID string, log *slog.Logger) {
	if s.region == nil {
		return
	}
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	defer func() {
		if h := s.region.h.Swap(nil); h != nil {
			h.Close()
		}
	}()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		leading, h := s.node.IsLeader(), s.region.h.Load()
		switch {
		case leading && h == nil:
			nh, err := s.region.cfg.Start(nodeID, s.fsm.Limits, s.FollowGlobalLimits, log)
			if err != nil {
				log.Error("cannot hold shares of the global cluster; global levels refuse", "region", s.region.cfg.Name, "err", err)
				continue
			}
			s.region.h.Store(&holderBox{nh})
			log.Info("regional leader: holding shares of the global cluster", "region", s.region.cfg.Name)
		case !leading && h != nil:
			s.region.h.Store(nil)
			h.Close()
			log.Info("no longer the regional leader: released the global shares", "region", s.region.cfg.Name)
		}
	}
}

// Region returns the agent's regional share holder while it leads a regional cluster (nil
// otherwise).
func (a *Agent) Region() RegionHolder { return a.server.Region() }

// relendHolderName names a downstream share holder in the regional leader's slices (as
// region.HolderName).
func relendHolderName(owner, id string, incarnation uint64) string {
	return fmt.Sprintf("%s\x00%s\x00%d", owner, id, incarnation)
}

// regionRelend answers, on a regional leader, the scope: global levels of a share request
// from the leader's upstream shares (RegionHolder.Relend): the regional FSM holds such a
// level at its full configured rate, so its own answer for them must never reach the holder.
// Without a holder (a leader whose holder has not started) such paths are answered central.
func (s *Server) regionRelend(owner string, req *quotadv1.ShareRequest, resp *quotadv1.ShareResponse) *quotadv1.ShareResponse {
	if s.region == nil {
		return resp
	}
	lim := s.fsm.Limits()
	gps := lim.GlobalPaths()
	if len(gps) == 0 {
		return resp
	}
	if h := s.Region(); h != nil {
		return h.Relend(lim.Version, relendHolderName(owner, req.HolderId, req.Incarnation), req, resp)
	}
	for i, p := range req.Paths {
		if i >= len(resp.Paths) {
			break
		}
		entries := make([]quota.Entry, len(p.GetDescriptors()))
		for j, e := range p.GetDescriptors() {
			entries[j] = quota.Entry{Key: e.GetKey(), Value: e.GetValue()}
		}
		if ok, _, why := noHolder(s.region.cfg.Name, lim, p.GetDomain(), entries); !ok {
			ps := resp.Paths[i]
			ps.Status, ps.Message, ps.Levels, ps.Fallback = string(quota.ShareCentral), why, nil, 0
		}
	}
	return resp
}

// regionReleased ends a released downstream holder's slices on the regional leader: those
// granted at or before the release's seq. It runs after the release committed, concurrently
// with the holder's next share request, whose slice (a newer seq) must stay charged.
func (s *Server) regionReleased(owner string, req *quotadv1.ReleaseShareRequest) {
	if h := s.Region(); h != nil {
		h.EndRelends(relendHolderName(owner, req.HolderId, req.Incarnation), req.Seq)
	}
}

// regionCollector exports the regional leader's shares per global level (on the leader; the
// other nodes export nothing).
type regionCollector struct {
	s                              *Server
	rate, capacity, local, expires *prometheus.Desc
	admitted, refused, undone      *prometheus.Desc
}

func newRegionCollector(s *Server) *regionCollector {
	l := []string{"region", "domain", "path"}
	d := func(name, help string) *prometheus.Desc { return prometheus.NewDesc(name, help, l, nil) }
	return &regionCollector{s: s,
		rate:     d("quotad_region_share_rate", "Units per second of the global level this region's leader holds (its share)."),
		capacity: d("quotad_region_share_capacity", "Capacity in units of the region's share of the global level."),
		local:    d("quotad_region_share_local", "1 while the region decides the global level on its share (lent and not ended)."),
		expires:  d("quotad_region_share_expires_in_seconds", "Seconds until the region's share of the global level ends without a renewal."),
		admitted: d("quotad_region_global_admitted_total", "Units the regional leader admitted at the global level from its share."),
		refused:  d("quotad_region_global_refused_total", "Units the regional leader refused at the global level (share spent, none yet, or ended)."),
		undone:   d("quotad_region_global_undone_total", "Units given back to the share after a regional level refused the same admission."),
	}
}

func (c *regionCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.rate, c.capacity, c.local, c.expires, c.admitted, c.refused, c.undone} {
		ch <- d
	}
}

func (c *regionCollector) Collect(ch chan<- prometheus.Metric) {
	h := c.s.Region()
	if h == nil {
		return
	}
	name := c.s.region.cfg.Name
	for _, r := range h.Shares() {
		lv := []string{name, r.Domain, r.Path}
		local, in := 0.0, 0.0
		if r.Local {
			local = 1
		}
		if !r.Expiry.IsZero() {
			in = max(0, time.Until(r.Expiry).Seconds())
		}
		ch <- prometheus.MustNewConstMetric(c.rate, prometheus.GaugeValue, r.Rate, lv...)
		ch <- prometheus.MustNewConstMetric(c.capacity, prometheus.GaugeValue, r.Capacity, lv...)
		ch <- prometheus.MustNewConstMetric(c.local, prometheus.GaugeValue, local, lv...)
		ch <- prometheus.MustNewConstMetric(c.expires, prometheus.GaugeValue, in, lv...)
		ch <- prometheus.MustNewConstMetric(c.admitted, prometheus.CounterValue, float64(r.Admitted), lv...)
		ch <- prometheus.MustNewConstMetric(c.refused, prometheus.CounterValue, float64(r.Refused), lv...)
		ch <- prometheus.MustNewConstMetric(c.undone, prometheus.CounterValue, float64(r.Undone), lv...)
	}
}

// FollowGlobalLimits makes global (the limits the global cluster answers GetLimits with, to
// the region's credential) the regional cluster's limits: one source of truth. The set
// replaces the regional one whole (a domain the global cluster no longer has, or no longer
// shows the region's credential, goes), as one SetLimits entry through the regional Raft
// log, so every regional replica switches at once and a new regional leader has them. It
// reports whether anything changed (false: the same domains, already in force). Called on the
// regional leader by its share holder; the global cluster unreachable means no call, and the
// region keeps its last limits.
func (s *Server) FollowGlobalLimits(ctx context.Context, global *quota.Limits) (bool, error) {
	if len(global.Domains) == 0 {
		return false, fmt.Errorf("the global cluster shows this region's credential no domains: keeping the regional limits (give the region's global credential the domains it serves, or %q)", auth.AnyDomain)
	}
	s.limitsMu.Lock()
	defer s.limitsMu.Unlock()
	if err := s.node.VerifyRead(ctx); err != nil {
		return false, s.applyError(err)
	}
	if sameLimits(s.fsm.Limits(), global) {
		return false, nil
	}
	next := &quota.Limits{Domains: global.Domains}
	if _, err := s.applyLimits(ctx, next); err != nil {
		return false, err
	}
	return true, nil
}

// sameLimits reports whether a and b define the same domains (versions aside).
func sameLimits(a, b *quota.Limits) bool {
	if a == nil || b == nil {
		return a == b
	}
	x, y := *a, *b
	x.Version, y.Version = 0, 0
	return bytes.Equal(config.Format(&x), config.Format(&y))
}

// visibleLimits is what GetLimits shows id: everything to readers and admins (and without
// authentication), a worker's domains to a worker.
func visibleLimits(id auth.Identity, l *quota.Limits) *quota.Limits {
	if id.Role != auth.RoleWorker || l == nil {
		return l
	}
	out := &quota.Limits{Version: l.Version}
	for _, d := range l.Domains {
		if id.MayUseDomain(d.Name) {
			out.Domains = append(out.Domains, d)
		}
	}
	return out
}

// regionApplyProblem refuses ApplyLimits on a regional cluster: it follows the global
// cluster's limits (one source of truth), and a local change would be overwritten within a
// second — or, with the global cluster unreachable, differ from the other regions'.
func (s *Server) regionApplyProblem() error {
	if s.region == nil {
		return nil
	}
	return status.Errorf(codes.FailedPrecondition, "this is regional cluster %q: it follows the global cluster's limits (--global-addrs); apply them to the global cluster, and the regional leader applies them here within about a second (docs/regions.md)", s.region.cfg.Name)
}
