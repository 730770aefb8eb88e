// Package region is a regional cluster's upstream share holder (issue 13, DESIGN "Regions").
//
// A regional cluster (3–5 nodes in one region) decides its region's admissions at local
// latency. For every level whose rate_limit says scope: global, the regional leader holds a
// share of the global cluster's bucket — the share protocol of client.Limiter (seq/ack,
// incarnation, grants timed on the holder's own CLOCK_MONOTONIC_RAW/CLOCK_BOOTTIME, never on
// the region's FSM time, ends at send + term − m_H) — and admits at that level only from
// it, locally, before the admission goes to the regional Raft log for the regional levels:
//
//   - The published global limit holds across regions: the global cluster keeps Σ shares ≤
//     its rate and burst whatever the number of regions, and the regional leader spends a
//     unit of a global level only from its share (AllowLocalN: never a call to the global
//     cluster on the request path).
//   - A new regional leader uses no upstream share until its own renewal returns: the
//     holder is started by leadership (a new client, hence a new holder incarnation), so it
//     begins with nothing and fails closed until its first grant; the old leader's share
//     ends by itself (its tokens are lost, never re-used).
//   - Global cluster unreachable: the share decides until its end − m_H, then the slice of
//     the level's shares.fallback_rate the global cluster handed out, or nothing (the
//     refusal names the global scope).
//
// The regional FSM still enforces a global level at its full configured rate, which never
// binds more than the share does (share ≤ rate); the global check happens first and is given
// back when a regional level refuses the same admission (all-or-nothing).
package region

import (
	"context"
	"fmt"
	"hash/fnv"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/config"
	"github.com/quotad/quotad/quota"
	"github.com/quotad/quotad/rpc"
)

// MinDemandPercent of a global level's rate is the least demand a regional leader reports
// for it: an idle region keeps a share large enough to be lent (b ≥ 2 units, r·term ≥ 20),
// so its first requests after a quiet spell are decided locally instead of refused.
const MinDemandPercent = 10

// Config configures a Holder.
type Config struct {
	// Region names this regional cluster (in the holder's ID at the global cluster, metrics
	// and refusals).
	Region string
	// Node names this node (the holder's ID at the global cluster: region/node).
	Node string
	// Global is the connection to the global cluster: its addresses and the credential of a
	// worker for the domains the region serves (a token file or a client certificate),
	// DialOptions for a custom dialer (tests inject WAN delay there).
	Global client.Config
	// Limits returns the limits the regional cluster enforces now (the same file as the
	// global cluster's); the holder follows their scope: global levels.
	Limits func() *quota.Limits
	// Follow, if set, makes the global cluster's limits the regional cluster's (through the
	// regional Raft log; rpc.Server.FollowGlobalLimits): the holder reads them from the global
	// cluster every Refresh and calls Follow with them. It reports whether they changed.
	Follow func(ctx context.Context, global *quota.Limits) (bool, error)
	// Refresh is how often the holder looks for changed limits, its own and the global
	// cluster's (default 1s).
	Refresh time.Duration
	Logger  *slog.Logger
}

// Holder holds the regional leader's shares of the global buckets. Start one when the node
// becomes the regional leader and Close it when it stops leading.
type Holder struct {
	cfg Config
	c   *client.Client
	log *slog.Logger

	mu      sync.RWMutex
	version uint64
	shares  []*share // sorted by domain, then path length

	stop chan struct{}
	done chan struct{}

	// followed is the version of the global limits last followed and followedSum a hash of
	// their text, localVersion the regional cluster's limits version right after (the initial
	// --limits file of a new cluster may land after a follow: then they are compared again);
	// followErr the last failure to follow them (logged once per change). The text is compared
	// too because a version number alone does not name one set of limits: a global cluster
	// rebuilt from scratch numbers from 1 again (and a restore by a build before session 10
	// moved the version backwards), so the same version can come back with other limits.
	followed, followedSum, localVersion uint64
	followErr                           string

	// relendMu guards answers: the last answer to each downstream share holder (relend.go).
	relendMu sync.Mutex
	answers  map[string]*relendAnswer
}

type share struct {
	gp  quota.GlobalPath
	lim *client.Limiter
	// admitted, refused and undone count units at this level (metrics, status).
	admitted, refused, undone atomic.Uint64
	// free counts admissions in the deliberately broken build region_bug_doubleshare.
	free atomic.Uint64
	// held: the region decided this level on its share at the last watch; ended: a warning
	// said the share ended and no "regained" has followed (run's goroutine only).
	held, ended bool
}

// Start connects to the global cluster and starts holding shares of the scope: global levels
// of cfg.Limits(). It does not wait for the first grants: until they arrive, admissions at
// global levels are refused.
func Start(cfg Config) (*Holder, error) {
	if err := CheckName(cfg.Region); err != nil {
		return nil, err
	}
	if len(cfg.Global.Addrs) == 0 {
		return nil, fmt.Errorf("region %q: no global cluster addresses; give --global-addrs A,B,C", cfg.Region)
	}
	if cfg.Refresh <= 0 {
		cfg.Refresh = time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Global.Logger == nil {
		// The global client's warnings (a share renewal the global cluster refused: a revoked
		// --global-token-file token) belong in the node's log: a client.Config without a
		// Logger logs nothing.
		cfg.Global.Logger = cfg.Logger.With("region", cfg.Region, "global_client", true)
	}
	if cfg.Global.ClientID == "" {
		cfg.Global.ClientID = "region/" + cfg.Region + "/" + cfg.Node
		if len(cfg.Global.ClientID) > 128 {
			cfg.Global.ClientID = cfg.Global.ClientID[:128]
		}
	}
	c, err := client.New(cfg.Global)
	if err != nil {
		return nil, fmt.Errorf("region %q: global cluster: %w", cfg.Region, err)
	}
	h := &Holder{cfg: cfg, c: c, log: cfg.Logger.With("region", cfg.Region), stop: make(chan struct{}), done: make(chan struct{})}
	h.sync()
	go h.run()
	return h, nil
}

func (h *Holder) run() {
	defer close(h.done)
	t := time.NewTicker(h.cfg.Refresh)
	defer t.Stop()
	for {
		select {
		case <-h.stop:
			return
		case <-t.C:
			h.follow()
			h.sync()
			h.watch()
			h.reclaim()
		}
	}
}

// follow reads the global cluster's limits and makes them the regional cluster's when they
// changed. The global cluster unreachable (or refusing): the region keeps its last limits.
func (h *Holder) follow() {
	if h.cfg.Follow == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), h.cfg.Refresh+time.Second)
	defer cancel()
	fail := func(err error) {
		if msg := err.Error(); msg != h.followErr {
			h.followErr = msg
			h.log.Warn("cannot follow the global cluster's limits; keeping the regional ones", "err", err)
		}
	}
	version, yaml, err := h.c.Limits(ctx)
	if err != nil {
		fail(err)
		return
	}
	var local uint64
	if l := h.cfg.Limits(); l != nil {
		local = l.Version
	}
	sum := fnv.New64a()
	sum.Write([]byte(yaml))
	if version == h.followed && sum.Sum64() == h.followedSum && h.followErr == "" && local == h.localVersion {
		// Unchanged at the global cluster and here since they were last followed.
		return
	}
	l, err := config.Parse("global limits", []byte(yaml))
	if err != nil {
		fail(fmt.Errorf("the global cluster's limits (version %d) do not parse here: %w", version, err))
		return
	}
	changed, err := h.cfg.Follow(ctx, l)
	if err != nil {
		fail(err)
		return
	}
	h.followed, h.followedSum, h.followErr = version, sum.Sum64(), ""
	if l := h.cfg.Limits(); l != nil {
		h.localVersion = l.Version
	}
	if changed {
		h.log.Info("applied the global cluster's limits", "global_version", version, "domains", len(l.Domains))
	}
}

// sync follows the limits: a Limiter per scope: global level, closed when the level goes.
func (h *Holder) sync() {
	l := h.cfg.Limits()
	if l == nil {
		return
	}
	h.mu.RLock()
	same := h.version == l.Version && h.shares != nil
	h.mu.RUnlock()
	if same {
		return
	}
	paths := l.GlobalPaths()
	h.mu.Lock()
	defer h.mu.Unlock()
	old := make(map[string]*share, len(h.shares))
	for _, s := range h.shares {
		old[pathKey(s.gp)] = s
	}
	next := make([]*share, 0, len(paths))
	for _, gp := range paths {
		k := pathKey(gp)
		if s := old[k]; s != nil {
			delete(old, k)
			next = append(next, s)
			continue
		}
		descs := make([]client.Entry, len(gp.Entries))
		for i, e := range gp.Entries {
			descs[i] = client.Entry{Key: e.Key, Value: e.Value}
		}
		// A quiet region keeps asking for MinDemandPercent of the level's rate, so its share
		// stays above the lend threshold (it never decides centrally).
		perSec := float64(gp.Rate.RequestsPerUnit) / max(gp.Rate.Unit.Seconds(), 1e-9)
		next = append(next, &share{gp: gp, lim: h.c.Limiter(client.Request{Domain: gp.Domain, Descriptors: descs, Cost: 1},
			client.LimiterOptions{MinDemand: perSec * MinDemandPercent / 100})})
		h.log.Info("holding a share of a global level", "domain", gp.Domain, "level", gp.Scope, "path", k)
	}
	for k, s := range old {
		s.lim.Close()
		h.log.Info("released the share of a level no longer global", "path", k)
	}
	slices.SortStableFunc(next, func(a, b *share) int { return len(a.gp.Entries) - len(b.gp.Entries) })
	h.shares, h.version = next, l.Version
	if h.shares == nil {
		h.shares = []*share{}
	}
}

// watch logs, once per change and never per request, when a level's share ends without a
// renewal (WARN: what the region does now — its fallback slice or failing closed) and when
// the region decides on a share again after that (INFO). quotad_region_share_local says the
// same for alerts (docs/metrics.md).
func (h *Holder) watch() {
	h.mu.RLock()
	defer h.mu.RUnlock()
	for _, s := range h.shares {
		info := s.lim.Share()
		held := info.Local
		switch {
		case held && s.ended:
			h.log.Info("regained a share of the global level; deciding it locally again",
				"domain", s.gp.Domain, "level", s.gp.Scope, "path", pathKey(s.gp), "rate", info.Rate, "capacity", info.Capacity)
			s.ended = false
		case !held && s.held:
			s.ended = true
			now := "failing closed: the level refuses every admission until a share is regained"
			switch {
			case info.Refused != "":
				// No fallback slice after a refusal, whatever shares.fallback_rate says.
				now += fmt.Sprintf(" (the global cluster refused the renewal: %s; check the region's global credential, --global-token-file or --global-cert)", info.Refused)
			case info.Status == "lent" && info.FallbackRate > 0:
				now = fmt.Sprintf("falling back to its slice of shares.fallback_rate, %.4g/s", info.FallbackRate)
			case info.Status == "lent":
				now += " (the level has no shares.fallback_rate)"
			default:
				now += fmt.Sprintf(" (the global cluster answers %s: %s)", info.Status, info.Message)
			}
			h.log.Warn("the region's share of a global level ended without a renewal; "+now,
				"domain", s.gp.Domain, "level", s.gp.Scope, "path", pathKey(s.gp), "status", info.Status, "fallback_rate", info.FallbackRate)
		}
		s.held = held
	}
}

func pathKey(gp quota.GlobalPath) string {
	return quota.BucketKey(gp.Domain, gp.Entries...)
}

// Refusal is why a global level refused an admission.
type Refusal struct {
	// Scope is the refusing level's key (quota.ScopeDomain for a domain ceiling).
	Scope string
	// Message names the global scope and what happens next.
	Message string
}

// Admit spends cost at every scope: global level on the request's path (domain, entries) from
// the shares, locally (limitsVersion: the version of the limits the caller enforces): ok and an undo that gives the units back (call it when a regional
// level refuses the same admission), or a Refusal. Paths without a global level are admitted
// with a nil undo.
func (h *Holder) Admit(limitsVersion uint64, domain string, entries []quota.Entry, cost uint64) (ok bool, undo func(), scope, message string) {
	return h.admit(limitsVersion, domain, entries, cost, false)
}

// AdmitExact is Admit at one level only: the scope: global level whose path is exactly
// (domain, entries) — an Envoy descriptor's rule, whose ancestors do not apply to it. cost 0
// checks without spending: ok when one unit could be spent now. A path that is no global level
// is admitted with a nil undo.
func (h *Holder) AdmitExact(limitsVersion uint64, domain string, entries []quota.Entry, cost uint64) (ok bool, undo func(), scope, message string) {
	if cost == 0 {
		ok, undo, scope, message = h.admit(limitsVersion, domain, entries, 1, true)
		if undo != nil {
			undo()
		}
		return ok, nil, scope, message
	}
	return h.admit(limitsVersion, domain, entries, cost, true)
}

func (h *Holder) admit(limitsVersion uint64, domain string, entries []quota.Entry, cost uint64, exact bool) (ok bool, undo func(), scope, message string) {
	h.mu.RLock()
	if h.version != limitsVersion || h.shares == nil {
		// The limits changed (or the holder started before they arrived): follow them
		// before deciding, or a new global level would be decided as if it were regional.
		h.mu.RUnlock()
		h.sync()
		h.mu.RLock()
	}
	defer h.mu.RUnlock()
	var undos []func()
	for _, s := range h.shares {
		if s.gp.Domain != domain || !prefix(s.gp.Entries, entries) || exact && len(s.gp.Entries) != len(entries) {
			continue
		}
		if cost == 0 {
			continue
		}
		ok, u := s.lim.AllowLocalN(cost)
		if plantedDoubleShare && ok && s.free.Add(1)%2 == 0 {
			u() // admitted without spending: the share counts double
			u = func() {}
		}
		if !ok {
			s.refused.Add(cost)
			for _, u := range undos {
				u()
			}
			why := h.refusal(s)
			return false, nil, why.Scope, why.Message
		}
		s.admitted.Add(cost)
		undos = append(undos, func() { u(); s.undone.Add(cost) })
	}
	switch len(undos) {
	case 0:
		return true, nil, "", ""
	case 1:
		return true, undos[0], "", ""
	}
	return true, func() {
		for _, u := range undos {
			u()
		}
	}, "", ""
}

func (h *Holder) refusal(s *share) Refusal {
	info := s.lim.Share()
	var msg string
	switch {
	case info.Status == "pending" || info.Status == "":
		msg = "no share of the global limit yet (the regional leader's first renewal with the global cluster has not returned)"
	case info.Status != "lent":
		msg = fmt.Sprintf("the global cluster does not lend this level to the region (%s: %s)", info.Status, info.Message)
	case !info.Local && info.Refused != "":
		msg = "the region's share of the global limit has ended and the global cluster refused its renewal (the region's global credential: revoked, or without this domain), so it fails closed"
	case !info.Local && s.gp.FallbackRate > 0:
		msg = "the region's share of the global limit has ended without a renewal (global cluster unreachable) and its slice of shares.fallback_rate is spent"
	case !info.Local:
		msg = "the region's share of the global limit has ended without a renewal (global cluster unreachable) and the level has no shares.fallback_rate (fail closed)"
	default:
		msg = fmt.Sprintf("the region's share of the global limit is spent (%.4g/s, burst %.4g)", info.Rate, info.Capacity)
	}
	return Refusal{Scope: s.gp.Scope, Message: fmt.Sprintf("global scope %s (domain %q, region %q): %s", s.gp.Scope, s.gp.Domain, h.cfg.Region, msg)}
}

func prefix(p, entries []quota.Entry) bool {
	if len(p) > len(entries) {
		return false
	}
	for i := range p {
		if p[i] != entries[i] {
			return false
		}
	}
	return true
}

// LevelShare is the region's current share of one global level (quotad status).
type LevelShare = rpc.RegionShare

// Shares lists the region's share of every global level.
func (h *Holder) Shares() []LevelShare {
	h.mu.RLock()
	defer h.mu.RUnlock()
	out := make([]LevelShare, 0, len(h.shares))
	for _, s := range h.shares {
		i := s.lim.Share()
		out = append(out, LevelShare{Domain: s.gp.Domain, Path: pathKey(s.gp), Scope: s.gp.Scope, Status: i.Status, Local: i.Local, Rate: i.Rate, Capacity: i.Capacity, Expiry: i.Expiry, Message: i.Message,
			Admitted: s.admitted.Load(), Refused: s.refused.Load(), Undone: s.undone.Load()})
	}
	return out
}

// Close stops holding: the shares are released to the global cluster (best effort) and
// every later Admit at a global level is refused.
func (h *Holder) Close() {
	select {
	case <-h.stop:
		return
	default:
	}
	close(h.stop)
	<-h.done
	h.mu.Lock()
	for _, s := range h.shares {
		s.lim.Close()
	}
	h.mu.Unlock()
	h.c.Close()
}
