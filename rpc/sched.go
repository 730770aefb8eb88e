package rpc

import (
	"context"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/quota"
	"github.com/quotad/quotad/sched"
)

// The leader-side fair scheduler's front door.
//
// An admission with max_wait_ms > 0 that cannot be admitted at once waits on the leader in a
// queue of the outermost contended bucket on its path (a sched.Queue per bucket key). The
// leader predicts when buckets can pay from the FSM's own state (fsm.Status: remaining tokens,
// reset time, pauses, permits in flight) plus what it has released but not yet seen applied
// ("pending"). Grants are released ahead of time: every waiter the bucket can pay within the
// release horizon (about how long a released grant takes to be stamped into a log entry) is
// picked in fair order (sched.Queue.Batch) and the whole batch goes to the waiting path's own
// proposer (fair.prop, many entries in flight, so a batch is stamped at once rather than
// after a commit slot shared with all other traffic) as one call, so it lands in one log
// entry in that order. The FSM re-checks and debits each as a
// scheduled grant (command version 2): admitted as of the moment the bucket has its units,
// which may be a little after the entry's time, and the waiter's answer is held until that
// moment. So grants follow each other at the bucket's pace whatever the commit latency (one
// grant per entry, with released cost capped at the burst, held a burst-1 bucket to one grant
// per commit), and the scheduler never grants what the FSM would refuse. A waiter the FSM
// still denies is requeued at the head of its flow until its wait ends, then gets that denial.
//
// A non-waiting admission whose path crosses a bucket with eligible waiters is denied
// (rate_limited, scope of that bucket, retry_after = the queue's backlog at the bucket's
// rate): the capacity is the waiters'. So is one whose bucket cannot pay it on top of the
// grants released to waiters and not yet applied: those take the bucket's next units as they
// accrue, and a unit taken before their entry is applied would push each of them later. It
// is admitted only from capacity no waiter can use.
//
// Flows (tenants): below the contended level, the first per-value level on the path (a
// descriptor node with no value, e.g. `key: tenant`) names the flow as "key=value", and that
// node's weight is the flow's weight. With no per-value level below it, the remaining path
// is the flow ("" if none: everyone on that bucket is one flow). Metrics label flows by tier:
// the node's name if set, the configured "key=value" for exact-value nodes, else "default" —
// values from the limits file, never from requests, so label cardinality stays bounded.
//
// Queues are soft state on the leader. On losing leadership every waiter fails UNAVAILABLE;
// clients retry (same request ID) to the new leader, which rebuilds the queues.

const (
	// fairPoll bounds how long the pump sleeps: it re-reads leadership and buckets limited
	// only by concurrency (whose permits return at unpredictable times) at least this often.
	fairPoll = 50 * time.Millisecond
	// fairAgingAfter: a request waiting this long goes before its tenant's other work.
	fairAgingAfter = 5 * time.Second
	// fairReserveBurst: units of reserve credit an idle work class banks.
	fairReserveBurst = 2
	// fairLimitsRefresh: how often the limits (classes, weights) are re-read.
	fairLimitsRefresh = time.Second
	// fairShareWindow is the window of usage shares (metrics, top).
	fairShareWindow = 10 * time.Second
	// The release horizon: how far ahead of a bucket's next unit its grant is released. It
	// must cover the time from release to the entry's timestamp (waiting for a commit slot),
	// or the bucket fills meanwhile and units are lost; beyond that it only delays newcomers.
	// It follows the release-to-stamp delay + the pump timer's lateness (each as mean + 4 ×
	// deviation) + fairPassMin, within these bounds (setHorizon).
	fairHorizonMin     = 2 * time.Millisecond
	fairHorizonMax     = 100 * time.Millisecond
	fairHorizonInitial = 10 * time.Millisecond
	// fairLaneInflight is how many log entries of the waiting path may be committing at once.
	// Its admissions have their own group commit beside the one of everything else
	// (Server.prop, --max-entries-in-flight): a released batch waits for a commit slot, and
	// that wait is both a newcomer's delay and what the release horizon must cover.
	fairLaneInflight = 16
	// fairPassMin is the least time between two passes the pump's timer starts (a new flow
	// or an answered batch starts one at once). Each pass that releases anything is one log
	// entry, so it bounds the waiting path's entries (~500/s); one grant per entry at
	// 1000/s made commits slower for everyone. The horizon adds it (a pass releases a
	// horizon's worth, and the lead may drop by this much before the next).
	fairPassMin = 2 * time.Millisecond
	// fairLateMax caps the pump timer's lateness the horizon covers. Until session 10 the
	// horizon covered a fixed 2 ms of it; on a quiet machine the timer is ~1 ms late, and the
	// extra millisecond was lead every newcomer waited out (at 1000/s the horizon went 4.4 →
	// 3.4 ms). Uncapped (tried in session 7, reverted in 291e385), one pass tens of ms late
	// lengthened the lead for ~100 passes — a second, many token intervals at 100/s.
	fairLateMax = 2 * time.Millisecond
	// fairNewcomerAhead bounds the waiters a newcomer's own release looks at and releases
	// before it in fair order (ties with flows that became backlogged at the same virtual
	// time); beyond it the newcomer is left to the pump.
	fairNewcomerAhead = 8
)

type fair struct {
	s       *Server
	metrics *fairMetrics
	// prop is the waiting path's own group commit (see fairLaneInflight).
	prop *proposer

	mu      sync.Mutex
	queues  map[string]*fairQueue // by contended bucket key
	waiters map[uint64]*waiter    // by sched ID
	// queuedPaths counts the waiters in waiters by pathKey: an admission whose exact path has
	// one queued would queue too (its buckets are theirs), so over a waiter cap it is refused
	// without reading its path (see wait).
	queuedPaths map[string]int
	pending     map[string]uint64 // bucket key → cost released to the proposer, not yet answered
	pendingConc map[string]uint64 // concurrency key → permits released, not yet answered
	// Released batches not yet answered, and what of pending the FSM has already applied
	// (see refreshApplied): the FSM's state counts those, so predictions must not again.
	inflight map[*relBatch]struct{}
	// relFlows counts released, unanswered grants by queue and flow (flowKey).
	relFlows map[string]int
	// outbox holds released batches, in release order, until flush submits them: passes run
	// concurrently (the pump's, a newcomer's), and each used to submit its own batches after
	// letting go of f.mu, so a later release could reach the log first.
	outbox      [][]*waiter
	applied     map[string]uint64
	appliedConc map[string]uint64
	seq         uint64
	relSeq      uint64 // waiters released so far: the next one's place in release order
	// tokensGen and certsGen are the FSM's token table and certificate deny-list generations
	// the queued waiters were last checked against (dropRevokedLocked).
	tokensGen  uint64
	certsGen   uint64
	limits     *quota.Limits
	limitsAt   time.Time
	usage      map[string]*shareWindow // by bucket key: who got the capacity lately
	usageSwept time.Time               // last pruneUsage pass
	horizon    time.Duration           // release horizon (see fairHorizonMin)
	stampDelay delayEstimate           // release-to-stamp delays
	timerLate  delayEstimate           // the pump timer's lateness
	holds      holdSet                 // scheduled grants held until their moments (exchanges)

	// subMu serializes flush (held from taking the outbox until its batches are submitted),
	// so batches reach the waiting lane in the order they were released. Order: subMu, then
	// f.mu; never subMu while holding f.mu.
	subMu sync.Mutex

	nwait atomic.Int64 // waiters queued (fast check on the hot path)
	// npend is len(pending)+len(pendingConc): keys with released, unanswered grants (the
	// hot path's other fast check: a queue empties while all its waiters are released).
	npend atomic.Int64
	slots waiterSlots // waiting admissions by client and domain, for the waiter caps
	kick  chan struct{}
	stop  chan struct{}
	done  chan struct{}
}

type fairQueue struct {
	key, domain, scope string
	level              int // index of the contended level in its status path (0: domain)
	q                  *sched.Queue
	cost               uint64 // sum of waiting costs
	ratePerUnit        float64
	spare              bool // last pass: waiters present, all held back by limits of their own, bucket could pay
	created            time.Time
	prefix             []quota.Entry // the path down to the contended level
}

// waiter is one waiting admission.
type waiter struct {
	id       uint64
	owner    string       // the caller's identity name (fsmv1.Acquire.owner)
	cert     auth.CertKey // the caller's certificate, if it called with one (its deny-list key)
	clientID string
	adm      *quotadv1.Admission
	cost     uint64
	pathKey  string
	item     sched.Item
	queue    *fairQueue
	tier     string
	class    string
	// classLabel is class if the domain configures it, else "": the metrics label.
	classLabel string
	rateKeys   []string // rate-limited bucket keys on its path
	// rateMax is the deepest rate-limited level on its path (-1: none); relKey and relLevel
	// are the contended bucket key and level of the queue it was last released from. Its
	// grant may take part in moment exchanges if rateMax ≤ relLevel (sched_exchange.go).
	rateMax  int
	relKey   string
	relLevel int
	// limitsVersion is the FSM's limits version rateMax was read under: a waiter queued
	// before a limits change (a tenant given a limit of its own) must not be exchanged on
	// what its path was then.
	limitsVersion uint64
	concKeys      []string // concurrency-limited keys on its path
	arrived       time.Time
	ready         chan struct{} // released by the pump (buffered)
	failed        chan struct{} // closed when leadership is lost, or its credential revoked
	// revoked: failed was closed because the caller's token or certificate was revoked (set
	// before, f.mu).
	revoked bool
	// Set by the pump before ready: the proposer call carrying its admission (op idx), or
	// the error submitting it; releasedAt is the leader's FSM time at release.
	call       *call
	idx        int
	submitErr  error
	releasedAt int64
	// relSeq is its place in release order (1, 2, ...; f.relSeq).
	relSeq uint64
	// For fairTraceHook: its flow had nothing waiting (it went ahead of backlogged flows);
	// released by its own pass (not the pump's); the wall time of its release.
	newcomer, selfPass bool
	releasedWall       time.Time
	predicted          time.Time // when the scheduler expected it to take effect (its last slot)
}

// fairTrace is where one admitted waiter's time went, on the leader (fairTraceHook). FSM
// times (the entry's stamp, the grant's moment) are given as wall times via the release.
type fairTrace struct {
	Adm                        *quotadv1.Admission
	Newcomer, SelfPass, Direct bool
	// Release is the grant's place in the scheduler's release order (0 for a direct one).
	Release           uint64
	Arrived, Released time.Time
	Stamp, Moment     time.Time // the entry's timestamp; when the grant takes effect
	Applied           time.Time // the waiter saw its entry applied
	Answered          time.Time // after the hold
	// StampFSM and MomentFSM are the entry's timestamp and the grant's moment in the leader's
	// FSM time (ns; 0 for a direct decision): the bucket's own clock.
	StampFSM, MomentFSM int64
	// Predicted is when the scheduler expected the grant to take effect as it released it.
	Predicted time.Time
	// HeldFSM is when its answer was due in FSM time: MomentFSM, or the moment it got in an
	// exchange (sched_exchange.go); Moment is its wall time.
	HeldFSM int64
}

// fairTraceHook, if set (diagnostic tests only), is called for every admission the scheduler
// made through the waiting path. Atomic: a test clears it while handler goroutines of a
// cluster it stopped may still read it.
var fairTraceHook atomic.Pointer[func(fairTrace)]

// waitReadHook, if set (tests only), is called with a waiting admission each time wait
// reads its path. Atomic, as fairTraceHook.
var waitReadHook atomic.Pointer[func(*quotadv1.Admission)]

// nonWaitingTrace is one non-waiting admission the leader decided, and what the scheduler held
// when it looked (gate, or the hot path's check that skips it): waiters queued, grants released
// to waiters and not yet applied.
type nonWaitingTrace struct {
	Adm              *quotadv1.Admission
	Admitted         bool
	Queued, Released bool
}

// nonWaitingHook, if set (tests only), is called for every non-waiting admission the leader
// decided. Atomic for the same reason as fairTraceHook.
var nonWaitingHook atomic.Pointer[func(nonWaitingTrace)]

func traceNonWaiting(adm *quotadv1.Admission, d *quotadv1.Decision, seen gateSeen) {
	if h := nonWaitingHook.Load(); h != nil && adm != nil && adm.MaxWaitMs == 0 && d != nil {
		(*h)(nonWaitingTrace{Adm: adm, Admitted: d.Admitted, Queued: seen.queued, Released: seen.released})
	}
}

// gateSeen is what gate found: waiters queued anywhere, grants released and not yet applied.
type gateSeen struct{ queued, released bool }

// seenLocked reads gateSeen from the queues and the released grants (after refreshApplied).
// f.mu held.
func (f *fair) seenLocked() gateSeen {
	seen := gateSeen{queued: len(f.queues) > 0}
	for k, p := range f.pending {
		seen.released = seen.released || unapplied(p, f.applied[k]) > 0
	}
	for k, p := range f.pendingConc {
		seen.released = seen.released || unapplied(p, f.appliedConc[k]) > 0
	}
	return seen
}

// handlesSeen is handles and seenLocked read together under f.mu (nonWaitingHook only).
func (f *fair) handlesSeen(req *quotadv1.AcquireRequest) (bool, gateSeen) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refreshApplied()
	return f.handles(req), f.seenLocked()
}

// relBatch is one released batch (one proposer call) until its answer: the request its last
// op decides (the FSM remembers it once the entry is applied, if admitted) and its cost by
// key.
type relBatch struct {
	owner, clientID string
	requestID       uint64
	rate, conc      map[string]uint64
	applied         bool
}

// pathView is the FSM's state along one descriptor path at FSM time clock (the last applied
// entry's), the leader's time now when it was read (≥ clock: the log may have been idle), and
// the limits nodes matched at each level (nil for the domain itself).
type pathView struct {
	clock, now int64
	levels     []quota.BucketStatus
	nodes      []*quota.Node
}

func newFair(s *Server) *fair {
	f := &fair{
		s:           s,
		metrics:     newFairMetrics(s.metrics),
		queues:      make(map[string]*fairQueue),
		waiters:     make(map[uint64]*waiter),
		queuedPaths: make(map[string]int),
		pending:     make(map[string]uint64),
		pendingConc: make(map[string]uint64),
		inflight:    make(map[*relBatch]struct{}),
		relFlows:    make(map[string]int),
		applied:     make(map[string]uint64),
		appliedConc: make(map[string]uint64),
		usage:       make(map[string]*shareWindow),
		prop:        newOrderedProposer(s.node, ProposerConfig{MaxBatch: s.prop.cfg.MaxBatch, MaxInflight: fairLaneInflight, ApplyTimeout: s.prop.cfg.ApplyTimeout}),
		horizon:     fairHorizonInitial,
		kick:        make(chan struct{}, 1),
		stop:        make(chan struct{}),
		done:        make(chan struct{}),
	}
	f.prop.observe = s.prop.observe
	f.registerCollectors(s.metrics)
	go f.loop()
	return f
}

func (f *fair) close() {
	close(f.stop)
	<-f.done
	f.prop.close()
}

// handles reports whether req goes through the scheduler: it has a waiting admission, or
// admissions are waiting or released somewhere (a non-waiting one may have to yield to them).
func (f *fair) handles(req *quotadv1.AcquireRequest) bool {
	if f.nwait.Load() > 0 || f.npend.Load() > 0 {
		return true
	}
	for _, a := range req.Admissions {
		if a.GetMaxWaitMs() > 0 {
			return true
		}
	}
	return false
}

func (f *fair) wake() {
	select {
	case f.kick <- struct{}{}:
	default:
	}
}

// acquire is Server.Acquire on the leader when the scheduler is involved.
func (f *fair) acquire(ctx context.Context, req *quotadv1.AcquireRequest, owner string, cert auth.CertKey) (*quotadv1.AcquireResponse, error) {
	s := f.s
	start := time.Now()
	resp := &quotadv1.AcquireResponse{Decisions: make([]*quotadv1.Decision, len(req.Admissions))}
	errs := make([]error, len(req.Admissions))
	var (
		ops       [][]byte
		idx       []int
		batchErrs []error
	)
	var seen []gateSeen // what gate saw, for nonWaitingHook only (tests): no allocation otherwise
	if nonWaitingHook.Load() != nil {
		seen = make([]gateSeen, len(req.Admissions))
	}
	var wg sync.WaitGroup
	for i, adm := range req.Admissions {
		if msg := admissionProblem(adm); msg != "" {
			resp.Decisions[i] = &quotadv1.Decision{Reason: string(quota.ReasonInvalid), Message: msg}
			continue
		}
		// A retry of a request the FSM already decided must get that decision back from the
		// log, never the scheduler's fresh opinion: no gate, no queue.
		known := s.fsm.Remembers(owner, req.ClientId, adm.RequestId)
		if adm.MaxWaitMs > 0 && !known {
			slot := waiterSlot{identity: owner, clientID: req.ClientId, domain: adm.Domain}
			if f.s.insecure && owner == insecureIdentity {
				slot.identity = "" // everyone's name: count by client_id only
			}
			wg.Go(func() {
				resp.Decisions[i], errs[i] = f.wait(ctx, owner, cert, slot, adm)
			})
			continue
		}
		if !known {
			d, g := f.gate(adm)
			if seen != nil {
				seen[i] = g
			}
			if d != nil {
				resp.Decisions[i] = d
				continue
			}
		}
		ops = append(ops, fsm.AppendOwnedAcquireOp(nil, owner, req.ClientId, adm))
		idx = append(idx, i)
	}
	if len(ops) > 0 {
		c, err := s.prop.submit(ctx, ops)
		if err == nil {
			err = s.prop.wait(ctx, c)
		}
		if err != nil {
			batchErrs = append(batchErrs, s.applyError(err))
		} else {
			for j, r := range c.results {
				if r.err != nil {
					batchErrs = append(batchErrs, s.applyError(r.err))
					continue
				}
				// A retry answered from the dedup table may be a scheduled grant: its delay
				// counts from the original entry, held again from this one (never early).
				if err := f.hold(ctx, r); err != nil {
					batchErrs = append(batchErrs, err)
					continue
				}
				resp.Decisions[idx[j]] = answer(r.res.Decision)
			}
		}
	}
	wg.Wait()
	// errs is written by the waiters' goroutines, so the batch's own errors live apart.
	for _, err := range append(errs, batchErrs...) {
		if err != nil {
			return nil, err
		}
	}
	took := time.Since(start)
	for i, d := range resp.Decisions {
		s.metrics.observeDecision(d.Reason, took)
		if seen != nil {
			traceNonWaiting(req.Admissions[i], d, seen[i])
		}
	}
	return resp, nil
}

// readPath reads the FSM's state along a path consistently with the FSM clock it refers to.
func (f *fair) readPath(domain string, entries []quota.Entry) (*pathView, error) {
	var (
		st  []quota.BucketStatus
		err error
		c0  int64
	)
	for range 4 {
		c0 = f.s.fsm.Clock()
		st, err = f.s.fsm.Status(domain, entries)
		if err != nil {
			return nil, err
		}
		if f.s.fsm.Clock() == c0 {
			break
		}
	}
	v := &pathView{clock: c0, now: c0, levels: st, nodes: make([]*quota.Node, len(st))}
	if now, err := f.s.node.Now(); err == nil {
		v.now = max(now, c0)
	}
	// The nodes of the path by the engine's own matcher (st[0] is the domain, st[i] entry i-1).
	nodes, _ := f.s.fsm.Matcher().Path(domain, entries)
	for i := 1; i < len(st) && i-1 < len(nodes); i++ {
		v.nodes[i] = nodes[i-1]
	}
	return v, nil
}

// limitsLocked returns the limits, re-read at most every fairLimitsRefresh. f.mu or the
// single caller's exclusivity must hold.
func (f *fair) limitsLocked() *quota.Limits {
	if f.limits == nil || time.Since(f.limitsAt) > fairLimitsRefresh {
		f.limits, f.limitsAt = f.s.fsm.Limits(), time.Now()
	}
	return f.limits
}

func (f *fair) domainConfig(domain string) sched.Config {
	cfg := sched.Config{AgingAfter: fairAgingAfter, ReserveBurst: fairReserveBurst}
	for _, d := range f.limitsLocked().Domains {
		if d.Name == domain {
			for _, c := range d.WorkClasses {
				cfg.Classes = append(cfg.Classes, sched.Class{Name: c.Name, ReservePercent: c.ReservePercent})
			}
		}
	}
	return cfg
}

// levelAt returns the FSM time at which level i of v can pay cost on top of what is pending
// (released, not yet answered: as scheduled grants they take the bucket's units as these
// accrue, so the time grows by cost/rate per pending unit, beyond the burst too), or
// math.MaxInt64 when that cannot be predicted (permits all held). A paused level counts its
// end plus the release horizon, so that no waiter is released before the pause is over (the
// FSM refuses paused admissions). Shadow and unlimited levels never hold a request back.
//
// Pending grants are taken to pay from the FSM's clock on (the last applied entry's time):
// those stamped since took their units as of their stamps, which may be before now — the
// release of the next grants must not wait for them (at 1000/s, counting them from now cost
// 0.1-0.15 of the bucket under -race). With asOfNow they pay from now: what is pending may
// not be stamped yet, and from a stale clock (an idle log) a full bucket looked as if it
// had paid them long ago — the test of "can it pay now" for going straight to the FSM uses
// that (TestSchedWaitingLaneIsItsOwn).
func (f *fair) levelAt(v *pathView, i int, cost uint64, asOfNow bool) int64 {
	b := &v.levels[i]
	if n := v.nodes[i]; n != nil && (n.ShadowMode || n.Unlimited) {
		return v.clock
	}
	at := v.clock
	if b.PausedFor > 0 {
		at = v.clock + int64(b.PausedFor) + int64(f.horizon)
	}
	if b.MaxInFlight > 0 && b.InFlight+unapplied(f.pendingConc[b.Key], f.appliedConc[b.Key]) >= b.MaxInFlight {
		return math.MaxInt64
	}
	if b.Limit > 0 && b.Window > 0 {
		from, left := v.clock, b.ResetAfter
		if asOfNow {
			from, left = v.now, max(0, b.ResetAfter-time.Duration(v.now-v.clock))
		}
		bk := sched.Bucket{Limit: b.Limit, Window: b.Window, Burst: b.Burst, ResetAfter: left}
		at = max(at, from+int64(bk.ReadyAfter(cost+unapplied(f.pending[b.Key], f.applied[b.Key]))))
	}
	return at
}

// admitAt is the time every level of v can pay cost, and the outermost level that is last
// (asOfNow: see levelAt).
func (f *fair) admitAt(v *pathView, cost uint64, asOfNow bool) (int64, int) {
	at, which := v.clock, -1
	for i := range v.levels {
		if t := f.levelAt(v, i, cost, asOfNow); t > at {
			at, which = t, i
		}
	}
	return at, which
}

// queueOn returns the outermost queue on v's path that has waiters.
func (f *fair) queueOn(v *pathView) *fairQueue {
	for i := range v.levels {
		if q := f.queues[v.levels[i].Key]; q != nil && q.q.Len() > 0 {
			return q
		}
	}
	return nil
}

// gate denies a non-waiting admission whose path crosses a bucket with eligible waiters, or a
// bucket that cannot pay it on top of the grants released to waiters and not yet applied.
func (f *fair) gate(adm *quotadv1.Admission) (*quotadv1.Decision, gateSeen) {
	if f.nwait.Load() == 0 && f.npend.Load() == 0 {
		return nil, gateSeen{}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.queues) == 0 && len(f.pending) == 0 && len(f.pendingConc) == 0 {
		return nil, gateSeen{}
	}
	f.refreshApplied()
	var seen gateSeen
	if nonWaitingHook.Load() != nil { // tests only: a walk of every pending key under f.mu
		seen = f.seenLocked()
	}
	v, err := f.readPath(adm.Domain, entries(adm.Descriptors))
	if err != nil {
		return nil, seen // the FSM will say what is wrong
	}
	if q := f.queueOn(v); q != nil {
		if q.spare {
			return nil, seen
		}
		return f.denyForWaiters(adm, v, q.level, q.backlog()), seen
	}
	// No waiter queued on the path, but all of a queue's waiters may be released and not yet
	// applied (a slow waiting lane under load releases the whole queue): the bucket's units
	// up to their moments are theirs. A level with nothing of theirs pending never denies
	// here: the FSM decides it as it would without waiters.
	for i, b := range v.levels {
		if unapplied(f.pending[b.Key], f.applied[b.Key]) == 0 && unapplied(f.pendingConc[b.Key], f.appliedConc[b.Key]) == 0 {
			continue
		}
		if at := f.levelAt(v, i, max(adm.Cost, 1), true); at > v.now { // cost 0 is charged 1, as the FSM does
			wait := fairPoll
			if at != math.MaxInt64 {
				wait = time.Duration(at - v.now)
			}
			return f.denyForWaiters(adm, v, i, wait), seen
		}
	}
	return nil, seen
}

// denyForWaiters is gate's denial on level i of v, whose capacity waiters hold for about wait.
func (f *fair) denyForWaiters(adm *quotadv1.Admission, v *pathView, i int, wait time.Duration) *quotadv1.Decision {
	reason, b, retry := f.heldBy(v, i, wait)
	d := heldDecision(reason, b, retry)
	d.Message = "requests waiting on this bucket have priority; send with max_wait_ms to queue fairly"
	f.metrics.denied(adm.Domain, d.Reason, "waiters:"+b.Scope)
	return d
}

// heldBy says why level i of v cannot take a request now, in the FSM's order of checks: a
// pause anywhere on the path (the longest: the FSM refuses paused before anything else, and
// the retry is at least the pause left as of v.now), then the permits of any level of the
// path all held, outermost first (the FSM checks concurrency on every level before any rate;
// counting grants released and not yet applied; shadow_mode levels refuse nothing; a level i
// with no rate can only be held by its permits), else level i's rate. retry is wait, or fairPoll when wait is unknown (<= 0 or math.MaxInt64: a permit
// returns on a release the scheduler cannot foresee). f.mu held.
func (f *fair) heldBy(v *pathView, i int, wait time.Duration) (quota.Reason, quota.BucketStatus, time.Duration) {
	if wait <= 0 || wait == math.MaxInt64 {
		wait = fairPoll
	}
	// PausedFor is as of v.clock (the last applied entry: up to a TickInterval old on an idle
	// log); what is left of a pause is as of v.now.
	stale := time.Duration(v.now - v.clock)
	p := -1
	for j, b := range v.levels {
		if b.PausedFor > stale && (p < 0 || b.PausedFor > v.levels[p].PausedFor) {
			p = j
		}
	}
	if p >= 0 {
		return quota.ReasonPaused, v.levels[p], max(wait, v.levels[p].PausedFor-stale)
	}
	for j, b := range v.levels {
		if b.MaxInFlight == 0 || (v.nodes[j] != nil && v.nodes[j].ShadowMode) {
			continue
		}
		if (j == i && b.Limit == 0) || b.InFlight+unapplied(f.pendingConc[b.Key], f.appliedConc[b.Key]) >= b.MaxInFlight {
			return quota.ReasonConcurrencyLimited, b, wait
		}
	}
	return quota.ReasonRateLimited, v.levels[i], wait
}

// backlog estimates how long the queue's waiting cost takes at the bucket's rate.
func (q *fairQueue) backlog() time.Duration {
	if q.ratePerUnit <= 0 {
		return fairPoll
	}
	return time.Duration(float64(q.cost) * q.ratePerUnit)
}

func entries(es []*quotadv1.Entry) []quota.Entry {
	out := make([]quota.Entry, len(es))
	for i, e := range es {
		out[i] = quota.Entry{Key: e.Key, Value: e.Value}
	}
	return out
}

func pathKey(adm *quotadv1.Admission) string {
	n := len(adm.Domain)
	for _, e := range adm.Descriptors {
		n += 2 + len(e.Key) + len(e.Value)
	}
	var b strings.Builder
	b.Grow(n) // one allocation: at 10,000 grants/s the builder's regrowth was 3.6 % of the leader's CPU
	b.WriteString(adm.Domain)
	for _, e := range adm.Descriptors {
		b.WriteByte(0)
		b.WriteString(e.Key)
		b.WriteByte(0)
		b.WriteString(e.Value)
	}
	return b.String()
}

// flowOf names the flow (tenant) of a path queued at level, its weight and metrics tier.
func flowOf(v *pathView, es []quota.Entry, level int) (flow string, weight uint32, tier string) {
	weight, tier = 1, "default"
	for i := level + 1; i < len(v.levels) && i-1 < len(es); i++ {
		n := v.nodes[i]
		if n == nil {
			break
		}
		if n.Value == "" {
			e := es[i-1]
			return e.Key + "=" + e.Value, max(n.Weight, 1), tierOf(n)
		}
	}
	var parts []string
	for i := level + 1; i < len(v.levels) && i-1 < len(es); i++ {
		e := es[i-1]
		parts = append(parts, e.Key+"="+e.Value)
		if n := v.nodes[i]; n != nil && n.Weight > 0 {
			weight, tier = n.Weight, tierOf(n)
		}
	}
	return strings.Join(parts, "/"), weight, tier
}

func tierOf(n *quota.Node) string {
	switch {
	case n.Name != "":
		return n.Name
	case n.Value != "":
		return n.Key + "=" + n.Value // configured, so bounded
	case n.Weight > 1:
		return "weight_" + itoa(uint64(n.Weight))
	}
	return "default"
}

func itoa(u uint64) string {
	var b [20]byte
	i := len(b)
	for {
		i--
		b[i] = byte('0' + u%10)
		u /= 10
		if u == 0 {
			return string(b[i:])
		}
	}
}

// wait decides one admission that may wait up to its max_wait_ms. It takes a waiter slot
// of its caller (slot, for the waiter caps) only when it is about to queue, and holds it until it
// returns: an admission its buckets can pay now with nobody queued on its path is decided at
// once, as a non-waiting one would be (the gate's rule: only capacity no waiter is entitled
// to), so it never needs a slot, and a full domain does not refuse it.
func (f *fair) wait(ctx context.Context, owner string, cert auth.CertKey, slot waiterSlot, adm *quotadv1.Admission) (*quotadv1.Decision, error) {
	clientID := slot.clientID
	slotted := false
	defer func() {
		if slotted {
			f.slots.put(slot)
		}
	}()
	arrived := time.Now()
	deadline := arrived.Add(time.Duration(adm.MaxWaitMs) * time.Millisecond)
	w := &waiter{owner: owner, cert: cert, clientID: clientID, adm: adm, cost: max(adm.Cost, 1), pathKey: pathKey(adm),
		arrived: arrived, class: adm.WorkClass, ready: make(chan struct{}, 1), failed: make(chan struct{})}
	es := entries(adm.Descriptors)
	requeue := false
	var last *quotadv1.Decision
	for {
		now, err := f.s.node.Now()
		if err != nil {
			return nil, f.s.applyError(err)
		}
		f.mu.Lock()
		if f.waiterRevoked(w) {
			// Checked under f.mu, where it queues: a revoke applied before this is seen here,
			// one applied after finds it queued (dropRevokedLocked).
			f.mu.Unlock()
			if last != nil {
				return last, nil
			}
			return nil, revokedWhileWaiting(w)
		}
		if !slotted && !requeue && f.queuedPaths[w.pathKey] > 0 {
			// Waiters are queued on this very path, so it would queue too (not go straight
			// to the FSM, not be refused for its wait) and needs a slot: over a waiter cap it
			// is refused now, as below, without reading its path first — a flood of them
			// costs a map lookup each under f.mu, not an FSM read.
			if msg, scope := f.slots.check(slot); msg != "" {
				f.mu.Unlock()
				return f.tooManyWaiters(adm.Domain, msg, scope), nil
			}
		}
		f.refreshApplied()
		if h := waitReadHook.Load(); h != nil {
			(*h)(adm)
		}
		limitsVersion := f.s.fsm.LimitsVersion() // before the read: a change during it shows
		v, err := f.readPath(adm.Domain, es)
		if err != nil {
			f.mu.Unlock()
			r, perr := f.propose(ctx, w)
			if perr == nil {
				perr = f.hold(ctx, r)
			}
			if perr != nil {
				return nil, perr
			}
			return answer(r.res.Decision), nil
		}
		w.setKeys(v)
		w.limitsVersion = limitsVersion
		q := f.queueOn(v)
		at, blocking := f.admitAt(v, w.cost, false)
		direct := q == nil && !requeue && at <= now
		if direct {
			// As of the view's own now (read after now, under f.mu): against the earlier
			// now, a bucket that could pay at once was always a few µs short, and every
			// waiting admission queued (and needed a waiter slot).
			atNow, _ := f.admitAt(v, w.cost, true)
			direct = atNow <= max(now, v.now)
		}
		if direct {
			// Nobody waits on this path and every bucket can pay now, grants pending
			// included: go straight to the FSM, through the shared group commit. Not
			// "within the release horizon": at 10,000/s with a 100 ms horizon a thousand
			// grants at a time went this way, first come first served, one entry each (A:B
			// 3:1 instead of 1:1); queued, a newcomer releases itself at once anyway (below).
			f.reserve(w)
			f.mu.Unlock()
			d, final, err := f.decide(ctx, w)
			if err != nil || final || time.Now().After(deadline) {
				return d, err
			}
			last, requeue = d, true
			continue
		}
		if q == nil {
			if blocking < 0 {
				blocking = 0
			}
			if left := time.Until(deadline); at != math.MaxInt64 && time.Duration(at-now) > left && !requeue {
				// It cannot be admitted within its wait: say so now (like rate.Limiter.Wait).
				// The denial reads the released permits (heldBy): under f.mu.
				d := f.denial(adm.Domain, v, blocking, time.Duration(at-now))
				f.mu.Unlock()
				return d, nil
			}
		}
		if !slotted {
			// It is going to queue: it needs a slot now.
			if msg, scope := f.slots.take(slot); msg != "" {
				f.mu.Unlock()
				if last != nil {
					return last, nil // the FSM's decision, as a retry of its request ID gets
				}
				return f.tooManyWaiters(adm.Domain, msg, scope), nil
			}
			slotted = true
		}
		if q == nil {
			q = f.newQueue(adm.Domain, v, es, blocking, time.Now())
		}
		urgent := f.push(q, w, v, es, requeue)
		self := false
		if urgent && !requeue {
			// A newcomer goes ahead of backlogged flows, so it is usually due at once:
			// release it from here, before letting go of f.mu (so no other pass takes it
			// first), instead of handing off to the pump goroutine (that hand-off took 0.7
			// ms median, 5 ms p99 at 1000/s on a loaded machine). Only itself: the other
			// queues and flows are the pump's (a whole pass per arrival was O(queues)).
			w.newcomer = true
			self = f.releaseNewcomerLocked(v.now, time.Now(), w, v)
			if !self {
				q.spare = false // until the pump has looked: the newcomer may be owed this bucket
			}
		}
		f.mu.Unlock()
		if h := fairReleasedHook.Load(); h != nil {
			(*h)()
		}
		f.flush()
		if urgent && !self {
			// The pump times what is left waiting; a released newcomer only moved the next
			// waiter's turn later, which the pump's timer (early at worst) covers.
			f.wake()
		}

		timer := time.NewTimer(time.Until(deadline))
		released := false
		select {
		case <-w.ready:
			released = true
		case <-timer.C:
		case <-ctx.Done():
		case <-w.failed:
		}
		timer.Stop()
		if !released {
			f.mu.Lock()
			queued := f.waiters[w.id] == w
			if queued {
				f.unqueue(q, w)
			}
			f.mu.Unlock()
			if !queued {
				// Released while the wait ended: its admission is on its way to the log (the
				// pump signals once it is submitted), so take its decision.
				select {
				case <-w.ready:
					released = true
				case <-w.failed:
				}
			}
		}
		if !released {
			select {
			case <-w.failed:
				if w.revoked {
					if last != nil {
						return last, nil
					}
					return nil, revokedWhileWaiting(w)
				}
				return nil, status.Error(codes.Unavailable, "leadership changed while the admission waited; it was not decided — retry with the same request ID")
			default:
			}
			if err := ctx.Err(); err != nil {
				return nil, f.s.applyError(err)
			}
			f.metrics.waited(w, false, time.Since(arrived))
			if last != nil {
				return last, nil
			}
			// Its wait ended in the queue: the scheduler's denial (the FSM was not asked).
			f.mu.Lock()
			defer f.mu.Unlock()
			v, err := f.readPath(adm.Domain, es)
			if err != nil {
				return nil, status.Error(codes.NotFound, err.Error())
			}
			// Named by the level its retry comes from: the queue it sat in (another path's
			// waiters on an outer level, say), or a level of its own path that cannot pay for
			// longer (it named the domain's queue with its tenant's minute as retry_after).
			retry, level := q.backlog(), q.level
			if at, which := f.admitAt(v, w.cost, false); at != math.MaxInt64 && time.Duration(at-now) > retry {
				retry = time.Duration(at - now)
				if which >= 0 {
					level = which
				}
			}
			return f.denial(adm.Domain, v, level, retry), nil
		}
		d, final, err := f.released(ctx, w)
		if err != nil || final || time.Now().After(deadline) {
			f.metrics.waited(w, d != nil && d.Admitted, time.Since(arrived))
			return d, err
		}
		last, requeue = d, true
	}
}

// setKeys notes the limited buckets on w's path v (what its release reserves). The slices
// are fresh: a released batch's completion still reads the old ones (unreserve).
func (w *waiter) setKeys(v *pathView) {
	w.rateKeys, w.concKeys, w.rateMax = nil, nil, -1
	for i, b := range v.levels {
		if n := v.nodes[i]; n != nil && (n.ShadowMode || n.Unlimited) {
			continue
		}
		if b.Limit > 0 {
			w.rateKeys = append(w.rateKeys, b.Key)
			w.rateMax = i
		}
		if b.MaxInFlight > 0 {
			w.concKeys = append(w.concKeys, b.Key)
		}
	}
}

// released returns the FSM's decision on a waiter the pump released (its batch's call), held
// until a scheduled grant takes effect; final as for decide. The batch's completion (see
// submit) unreserves its cost, whether or not this waiter is still there to read it.
func (f *fair) released(ctx context.Context, w *waiter) (*quotadv1.Decision, bool, error) {
	if w.submitErr != nil {
		return nil, true, f.s.applyError(w.submitErr)
	}
	if err := f.prop.wait(ctx, w.call); err != nil {
		return nil, true, f.s.applyError(err)
	}
	applied := time.Now()
	r := w.call.results[w.idx]
	if r.err != nil {
		return nil, true, f.s.applyError(r.err)
	}
	moment := r.ts + int64(r.res.Decision.RetryAfter)
	var err error
	if w.exchangeable(r, f.s.fsm.LimitsVersion()) {
		moment, err = f.holdExchangeable(ctx, w, r)
	} else {
		err = f.hold(ctx, r)
	}
	if err != nil {
		return nil, true, err
	}
	if hook := fairTraceHook.Load(); hook != nil && r.res.Decision.Admitted {
		toWall := func(t int64) time.Time { return w.releasedWall.Add(time.Duration(t - w.releasedAt)) }
		(*hook)(fairTrace{Adm: w.adm, Newcomer: w.newcomer, SelfPass: w.selfPass, Release: w.relSeq, Arrived: w.arrived, Released: w.releasedWall,
			Stamp: toWall(r.ts), Moment: toWall(moment), Applied: applied, Answered: time.Now(),
			StampFSM: r.ts, MomentFSM: r.ts + int64(r.res.Decision.RetryAfter), HeldFSM: moment, Predicted: w.predicted})
	}
	return f.outcome(w, answer(r.res.Decision), r.res.Duplicate)
}

// hold waits until a scheduled grant in r takes effect: RetryAfter after its entry's time. A
// caller must not learn of an admission before it (the bucket's bound counts it then).
func (f *fair) hold(ctx context.Context, r proposalResult) error {
	d := r.res.Decision
	if !d.Admitted || d.RetryAfter <= 0 {
		return nil
	}
	wait := d.RetryAfter
	if now, err := f.s.node.Now(); err == nil && r.ts > 0 {
		wait = time.Duration(r.ts + int64(d.RetryAfter) - now)
	}
	if r.res.Duplicate {
		// The original may have been answered later than its FSM moment: a newcomer took
		// that moment in an exchange (fairExchangeMax).
		wait += fairExchangeMax
	}
	if wait <= 0 {
		return nil
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return f.s.applyError(ctx.Err())
	}
}

// answer is the API form of a decision whose scheduled grant (if any) has been held.
func answer(d fsm.Decision) *quotadv1.Decision {
	pd := decisionToProto(d)
	if pd.Admitted {
		pd.RetryAfterMs = 0 // served by the hold
	}
	return pd
}

// denial is the scheduler's own refusal of a waiting admission (not recorded by the FSM: a
// retry with the same request ID is decided afresh).
func (f *fair) denial(domain string, v *pathView, level int, retry time.Duration) *quotadv1.Decision {
	reason, b, retry := f.heldBy(v, level, retry)
	f.metrics.denied(domain, string(reason), b.Scope)
	return heldDecision(reason, b, retry)
}

// heldDecision is the scheduler's denial for reason on bucket b (heldBy), shaped as the FSM
// shapes its own: for concurrency_limited, Limit is max_in_flight and Remaining 0 (no permit
// for this caller: the FSM's count may show one free that a released waiter owns).
func heldDecision(reason quota.Reason, b quota.BucketStatus, retry time.Duration) *quotadv1.Decision {
	d := &quotadv1.Decision{Reason: string(reason), Scope: b.Scope, Limit: b.Limit,
		Remaining: b.Remaining, WindowMs: b.Window.Milliseconds(), ResetAfterMs: ceilMs(b.ResetAfter),
		RetryAfterMs: max(1, ceilMs(retry))}
	if reason == quota.ReasonConcurrencyLimited {
		d.Limit, d.Remaining = b.MaxInFlight, 0
		d.WindowMs, d.ResetAfterMs = 0, 0
	}
	return d
}

// decide proposes a waiter that goes straight to the FSM and returns the FSM's decision
// (held until a scheduled grant takes effect); final is false when it was denied for a
// reason time can cure and the FSM has not made that denial sticky.
func (f *fair) decide(ctx context.Context, w *waiter) (*quotadv1.Decision, bool, error) {
	r, err := f.propose(ctx, w)
	f.mu.Lock()
	f.unreserve(w)
	if err == nil && r.res.Decision.Admitted {
		f.recordAdmission(w, time.Now())
	}
	f.mu.Unlock()
	f.wake()
	if err != nil {
		return nil, true, err
	}
	applied := time.Now()
	if err := f.hold(ctx, r); err != nil {
		return nil, true, err
	}
	if hook := fairTraceHook.Load(); hook != nil && r.res.Decision.Admitted {
		(*hook)(fairTrace{Adm: w.adm, Direct: true, Arrived: w.arrived, Released: w.arrived, Applied: applied, Answered: time.Now()})
	}
	return f.outcome(w, answer(r.res.Decision), r.res.Duplicate)
}

// outcome counts a decision in the metrics and says whether it is final (see decide).
func (f *fair) outcome(w *waiter, d *quotadv1.Decision, dup bool) (*quotadv1.Decision, bool, error) {
	if d.Admitted {
		f.metrics.admitted(w)
		return d, true, nil
	}
	f.metrics.denied(w.adm.Domain, d.Reason, d.Scope)
	switch quota.Reason(d.Reason) {
	case quota.ReasonRateLimited, quota.ReasonConcurrencyLimited, quota.ReasonPaused:
		// The FSM remembers a denial for retries of the request ID; proposing the same ID
		// again returns it (dup), so only a fresh denial can be retried.
		return d, dup, nil
	}
	return d, true, nil
}

// recordAdmission counts a queued waiter's admission in its bucket's share window. f.mu held.
func (f *fair) recordAdmission(w *waiter, now time.Time) {
	if w.queue != nil {
		f.usageOf(w.queue, now).add(now, w.item.Flow, w.tier, w.cost, now.Sub(w.arrived))
	}
}

func (f *fair) propose(ctx context.Context, w *waiter) (proposalResult, error) {
	c, err := f.s.prop.submit(ctx, [][]byte{fsm.AppendOwnedAcquireOp(nil, w.owner, w.clientID, w.adm)})
	if err == nil {
		err = f.s.prop.wait(ctx, c)
	}
	if err == nil {
		err = c.results[0].err
	}
	if err != nil {
		return proposalResult{}, f.s.applyError(err)
	}
	return c.results[0], nil
}

// submit sends a batch of released waiters to the proposer as one call (one log entry, in
// the order given) and signals each. When the call is answered it unreserves their cost,
// counts admissions in the share windows, feeds the release horizon and wakes the pump —
// whether or not the waiters are still there. Called by flush, without f.mu.
func (f *fair) submit(ws []*waiter) {
	if len(ws) == 0 {
		return
	}
	ops := make([][]byte, len(ws))
	for i, w := range ws {
		ops[i] = fsm.AppendOwnedAcquireOp(nil, w.owner, w.clientID, w.adm)
	}
	// What the completion needs, taken before the waiters run again (a denied one re-reads
	// its path and may be released anew).
	type held struct {
		rateKeys, concKeys []string
		cost               uint64
		flow               string
	}
	res := make([]held, len(ws))
	for i, w := range ws {
		res[i] = held{w.rateKeys, w.concKeys, w.cost, flowKey(w.queue, w.item.Flow)}
	}
	releasedAt := ws[0].releasedAt
	last := ws[len(ws)-1]
	rb := &relBatch{owner: last.owner, clientID: last.clientID, requestID: last.adm.RequestId,
		rate: map[string]uint64{}, conc: map[string]uint64{}}
	for _, h := range res {
		for _, k := range h.rateKeys {
			rb.rate[k] += h.cost
		}
		for _, k := range h.concKeys {
			rb.conc[k]++
		}
	}
	f.mu.Lock()
	f.inflight[rb] = struct{}{}
	f.mu.Unlock()
	c, err := f.prop.submit(context.Background(), ops)
	for i, w := range ws {
		w.call, w.idx, w.submitErr = c, i, err
		w.ready <- struct{}{}
	}
	// done releases the reservations; answered says the call's results are all written (not
	// so when the proposer stopped first: commit may still be writing them).
	done := func(answered bool) {
		f.mu.Lock()
		now := time.Now()
		f.forget(rb)
		for i, w := range ws {
			f.release(res[i].rateKeys, res[i].concKeys, res[i].cost)
			if n := f.relFlows[res[i].flow]; n <= 1 {
				delete(f.relFlows, res[i].flow)
			} else {
				f.relFlows[res[i].flow] = n - 1
			}
			if err == nil && answered {
				if r := c.results[i]; r.err == nil && r.res != nil && r.res.Decision.Admitted {
					f.recordAdmission(w, now)
				}
			}
		}
		if err == nil && answered && c.results[0].res != nil {
			f.observeStamp(c.results[0].ts - releasedAt)
		}
		f.mu.Unlock()
		f.wake()
	}
	if err != nil {
		done(false)
		return
	}
	go func() {
		select {
		case <-c.done:
			done(true)
		case <-f.prop.stop:
			done(false)
		}
	}()
}

// observeStamp feeds the release horizon with one release-to-stamp delay (ns). It is not
// measured from when a grant was due: a longer horizon makes larger entries, which commit
// slower, which would lengthen it again. f.mu held.
func (f *fair) observeStamp(d int64) {
	f.stampDelay.observe(time.Duration(d))
	f.setHorizon()
}

// observeLate feeds the release horizon with how late the pump's timer fired. f.mu held.
func (f *fair) observeLate(d time.Duration) {
	f.timerLate.observe(d)
	f.setHorizon()
}

// delayEstimate follows a delay as TCP follows a round trip (RFC 6298): a smoothed mean and
// mean deviation, bound = mean + 4 × deviation. It covers nearly every delay of a steady
// distribution, and one outlier raises it for a few observations only. Until session 10 the
// horizon followed a decaying maximum (× 0.99 per observation): one slow stamp (a GC pause, a
// slow fsync) kept the lead every newcomer waits out long for ~100 batches, and the small
// tenants' p99 followed those spikes (traced at 1000/s in-process: a newcomer's lead p50 3.9,
// p99 9.6–11.8 ms under a mean horizon of 4.2–4.3 ms, the scheduler's own prediction of it
// exact).
type delayEstimate struct {
	avg, dev float64 // ns
	seen     bool
}

func (e *delayEstimate) observe(d time.Duration) {
	x := float64(max(d, 0))
	if !e.seen {
		e.avg, e.dev, e.seen = x, x/2, true
		return
	}
	e.dev = 0.75*e.dev + 0.25*math.Abs(x-e.avg)
	e.avg = 0.875*e.avg + 0.125*x
}

// bound is the delay the estimate expects to cover (0 before any observation).
func (e *delayEstimate) bound() time.Duration { return time.Duration(e.avg + 4*e.dev) }

// setHorizon sets the release horizon from what it must cover. A grant due at t is released
// by the first pass at or after t − horizon, which comes up to fairPassMin after the previous
// pass plus the timer's lateness, and its entry is stamped a release-to-stamp delay after
// that: stamped after t, the bucket refills meanwhile and units are lost. Both delays are
// measured (delayEstimate), the lateness counted up to fairLateMax. f.mu held.
func (f *fair) setHorizon() {
	if !f.stampDelay.seen {
		// Nothing measured of the larger part yet (a new leader's first waiters): keep
		// fairHorizonInitial rather than lateness + fairPassMin alone.
		return
	}
	h := f.stampDelay.bound() + min(f.timerLate.bound(), fairLateMax) + fairPassMin
	f.horizon = min(max(h, fairHorizonMin), fairHorizonMax)
}

// unapplied is what of pending the FSM's state does not show yet.
func unapplied(pending, applied uint64) uint64 { return pending - min(pending, applied) }

// flowKey names a flow of a queue in f.relFlows.
func flowKey(q *fairQueue, flow string) string { return q.key + "\x00" + flow }

// refreshApplied marks the released batches whose entry the FSM has applied (it remembers
// their last admission) and counts their cost in f.applied: until their answers are handled
// (a goroutine per batch, woken after the FSM applied the entry and the proposer answered),
// the FSM's state and f.pending both counted them, and the pump held back up to that many
// grants too many (at 10,000/s, a millisecond of lateness is 10 grants). Call it before
// reading the FSM's state (a batch applied after it is counted twice, as before). f.mu held.
func (f *fair) refreshApplied() {
	for rb := range f.inflight {
		if rb.applied || !f.s.fsm.Remembers(rb.owner, rb.clientID, rb.requestID) {
			continue
		}
		rb.applied = true
		for k, c := range rb.rate {
			f.applied[k] += c
		}
		for k, c := range rb.conc {
			f.appliedConc[k] += c
		}
	}
}

// forget drops a batch whose answers are handled (its cost leaves f.pending now). f.mu held.
func (f *fair) forget(rb *relBatch) {
	delete(f.inflight, rb)
	if !rb.applied {
		return
	}
	for k, c := range rb.rate {
		if f.applied[k] <= c {
			delete(f.applied, k)
		} else {
			f.applied[k] -= c
		}
	}
	for k, c := range rb.conc {
		if f.appliedConc[k] <= c {
			delete(f.appliedConc, k)
		} else {
			f.appliedConc[k] -= c
		}
	}
}

// reserve counts a released waiter's cost as pending on its buckets. f.mu held.
func (f *fair) reserve(w *waiter) {
	for _, k := range w.rateKeys {
		f.pending[k] += w.cost
	}
	for _, k := range w.concKeys {
		f.pendingConc[k]++
	}
	f.npend.Store(int64(len(f.pending) + len(f.pendingConc)))
}

// unreserve undoes reserve once the FSM has answered (its state now shows the debit). f.mu held.
func (f *fair) unreserve(w *waiter) { f.release(w.rateKeys, w.concKeys, w.cost) }

// release is unreserve of what a waiter reserved. f.mu held.
func (f *fair) release(rateKeys, concKeys []string, cost uint64) {
	for _, k := range rateKeys {
		if f.pending[k] <= cost {
			delete(f.pending, k)
		} else {
			f.pending[k] -= cost
		}
	}
	for _, k := range concKeys {
		if f.pendingConc[k] <= 1 {
			delete(f.pendingConc, k)
		} else {
			f.pendingConc[k]--
		}
	}
	f.npend.Store(int64(len(f.pending) + len(f.pendingConc)))
}

func (f *fair) newQueue(domain string, v *pathView, prefix []quota.Entry, level int, now time.Time) *fairQueue {
	b := v.levels[level]
	sq, err := sched.New(f.domainConfig(domain))
	if err != nil { // limits validation should have refused such classes; schedule without them
		sq, _ = sched.New(sched.Config{AgingAfter: fairAgingAfter, ReserveBurst: fairReserveBurst})
	}
	q := &fairQueue{key: b.Key, domain: domain, scope: b.Scope, level: level, q: sq, created: now,
		prefix: slices.Clone(prefix[:max(0, level)])}
	if b.Limit > 0 {
		q.ratePerUnit = float64(b.Window) / float64(b.Limit)
	}
	f.queues[b.Key] = q
	f.usageOf(q, q.created)
	return q
}

// usageOf returns the share window of q's bucket, made afresh if it has none. f.mu held.
func (f *fair) usageOf(q *fairQueue, now time.Time) *shareWindow {
	u := f.usage[q.key]
	if u == nil {
		f.pruneUsage(now)
		u = newShareWindow(fairShareWindow, now)
		f.usage[q.key] = u
	}
	u.domain, u.scope = q.domain, q.scope
	return u
}

// pruneUsage forgets the share windows of buckets that have no queue and admitted nothing in
// their current and previous windows. Bucket keys carry request values (a per-tenant bucket's
// key has the tenant ID), so without it every bucket ever contended would stay for good.
//
// It changes nothing anyone sees: no scheduling decision reads f.usage (only the metrics and
// FairView do), and an idle window reads the same as the new one usageOf makes if the bucket
// returns (both empty, on the same grid). Run only when usageOf makes a record, and at most
// once a window length, it costs one pass over the map per window and keeps f.usage to the
// buckets queued on or admitted to in about the last three windows. f.mu held.
func (f *fair) pruneUsage(now time.Time) {
	if now.Sub(f.usageSwept) < fairShareWindow {
		return
	}
	f.usageSwept = now
	for k, u := range f.usage {
		if f.queues[k] == nil && u.idle(now) {
			delete(f.usage, k)
		}
	}
}

// push queues w on q and reports whether the pump should look at once: w's flow had nothing
// waiting (a newcomer goes ahead of backlogged flows, so it may be due now) or it is a
// requeue. A backlogged flow's next request is picked up by the pump's own timer. f.mu held.
func (f *fair) push(q *fairQueue, w *waiter, v *pathView, es []quota.Entry, requeue bool) bool {
	flow, weight, tier := flowOf(v, es, q.level)
	urgent := requeue || !q.q.Waiting(flow)
	if !requeue || w.queue != q {
		f.seq++
		w.id = f.seq
		w.item = sched.Item{ID: w.id, Flow: flow, Weight: weight, Class: w.class, Cost: w.cost, Enqueued: w.arrived}
		_ = q.q.Push(w.item)
	} else {
		_ = q.q.Requeue(w.item)
	}
	w.queue, w.tier = q, tier
	// Metrics name the class only if the domain configures it: the client's string is not
	// trusted as a label value (each new one would be a new time series for good).
	w.classLabel = ""
	if q.q.HasClass(w.class) {
		w.classLabel = w.class
	}
	q.cost += w.cost
	f.addWaiter(w)
	return urgent
}

// addWaiter and dropWaiter add w to and remove it from f.waiters (and what counts them).
// f.mu held.
func (f *fair) addWaiter(w *waiter) {
	f.waiters[w.id] = w
	f.queuedPaths[w.pathKey]++
	f.nwait.Add(1)
}

func (f *fair) dropWaiter(w *waiter) {
	delete(f.waiters, w.id)
	if f.queuedPaths[w.pathKey]--; f.queuedPaths[w.pathKey] <= 0 {
		delete(f.queuedPaths, w.pathKey)
	}
	f.nwait.Add(-1)
}

// unqueue removes a waiter that stopped waiting before it was released. f.mu held.
func (f *fair) unqueue(q *fairQueue, w *waiter) {
	if f.waiters[w.id] == nil {
		return
	}
	f.dropWaiter(w)
	if q.q.Remove(w.id) {
		q.cost -= min(q.cost, w.cost)
	}
	if q.q.Len() == 0 && f.queues[q.key] == q {
		delete(f.queues, q.key)
	}
}

// loop is the pump: whenever capacity may have freed (a timer at the predicted refill, an
// answered admission, a new waiter) it releases the waiters the queues pick.
func (f *fair) loop() {
	defer close(f.done)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	type leaderNotifier interface{ LeaderChanged() <-chan struct{} }
	ln, _ := f.s.node.(leaderNotifier)
	var due time.Time // when the timer was set to fire
	for {
		var lc <-chan struct{}
		if ln != nil {
			lc = ln.LeaderChanged()
		}
		late := time.Duration(-1) // a timer's lateness; not measured for other wake-ups
		select {
		case <-f.stop:
			f.failAll()
			return
		case <-f.kick:
		case <-timer.C:
			late = time.Since(due)
		case <-lc:
		}
		next := f.pass(late)
		due = time.Now().Add(next)
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		timer.Reset(next)
	}
}

// pass releases, queue by queue, every waiter the queue picks (in fair order) that the
// buckets can pay within the release horizon, submits each queue's batch as one proposer
// call, and returns how long to sleep: until the next waiter comes within the horizon.
// late is how late the timer that started it fired (negative: not started by the timer).
func (f *fair) pass(late time.Duration) time.Duration {
	if f.nwait.Load() == 0 {
		// Under f.mu: waiters' goroutines release newcomers too, and the pump's passes set
		// the gauges idle clears (f.metrics.queue, also under f.mu).
		f.mu.Lock()
		f.metrics.idle()
		f.mu.Unlock()
		return time.Second
	}
	now, err := f.s.node.Now()
	if err != nil {
		f.failAll()
		return fairPoll
	}
	f.mu.Lock()
	if late >= 0 {
		f.observeLate(late)
	}
	f.dropRevokedLocked()
	d := f.passLocked(now, time.Now())
	f.mu.Unlock()
	if h := fairReleasedHook.Load(); h != nil {
		(*h)()
	}
	f.flush()
	return d
}

// fairReleasedHook, if set (tests only), runs after a pass or a newcomer's release has let go
// of f.mu and before it flushes: where a concurrent release can overtake it.
var fairReleasedHook atomic.Pointer[func()]

// flush submits the released batches in the order they were released (see f.outbox). Call
// it without f.mu after releasing; a batch another release left is submitted by whichever
// flush comes first, never after a batch released later.
func (f *fair) flush() {
	f.subMu.Lock()
	defer f.subMu.Unlock()
	f.mu.Lock()
	out := f.outbox
	f.outbox = nil
	f.mu.Unlock()
	for _, b := range out {
		f.submit(b)
	}
}

// slotOf predicts when w can be admitted (the FSM's state along its path v, plus pending),
// as leader time at and as wall time (now and wall are the same moment), and whether a
// limit of its own, not q's bucket, is what holds it back. f.mu held.
func (f *fair) slotOf(q *fairQueue, w *waiter, v *pathView, now int64, wall time.Time) sched.Slot {
	if v == nil {
		return sched.Slot{At: wall} // the FSM will say what is wrong
	}
	at, which := f.admitAt(v, w.cost, false)
	sl := sched.Slot{At: wall.Add(time.Duration(min(at-now, int64(time.Hour)))), Own: which >= 0 && which != q.level}
	w.predicted = sl.At
	return sl
}

// takeLocked releases w, dispatched from q: it leaves the queue, its cost becomes pending
// and it joins the batch being built. self: a newcomer releasing itself. f.mu held.
func (f *fair) takeLocked(q *fairQueue, w *waiter, now int64, wall time.Time, self bool) {
	f.dropWaiter(w)
	q.cost -= min(q.cost, w.cost)
	f.reserve(w)
	w.releasedAt, w.releasedWall, w.selfPass = now, wall, self
	w.relKey, w.relLevel = q.key, q.level
	f.relSeq++
	w.relSeq = f.relSeq
	f.relFlows[flowKey(q, w.item.Flow)]++
}

// releaseNewcomerLocked releases w — a newcomer just queued, with the FSM's state along its
// path v — into an entry of its own if its flow has no grant in flight, together with the
// few waiters the fair order serves before it (a newcomer's virtual start is the virtual
// time, so usually none), and reports whether it did. It looks at w's queue only, and there
// only at what WFQ orders up to w: everything else is the pump's. It is released even if the grants
// already released reach past the release horizon (its moment comes after them anyway):
// waiting for the pump's next pass cost it a timer's lateness (traced at 1000/s: 45 % of
// small newcomers, arrival → release p99 20 ms on a loaded machine) — but not more than
// fairHorizonMax beyond the horizon (the lead of grants released ahead is about one horizon;
// with the bound at fairHorizonMax alone, a lead near its cap under -race left 29 of 40 small
// newcomers to the pump). A flow with a grant in flight is not a newcomer for this: at 10,000/s a
// heavy tenant whose waiters were all released came back as one thousands of times a
// second, each then an entry of its own (commit p99 0.3 → 1.1 s, utilization 0.81 → 0.47).
// f.mu held; the batch goes to f.outbox (flush submits it).
func (f *fair) releaseNewcomerLocked(now int64, wall time.Time, w *waiter, v *pathView) bool {
	q := w.queue
	if q == nil || f.waiters[w.id] != w || f.relFlows[flowKey(q, w.item.Flow)] > 0 {
		return false
	}
	reach := wall.Add(f.horizon + fairHorizonMax)
	if s := f.slotOf(q, w, v, now, wall); s.Own || s.At.After(reach) {
		return false
	}
	// Release in fair order up to w: a waiter the order serves before w (a flow that became
	// backlogged at the same virtual time and came first, a reserve class) goes into the
	// same entry ahead of it, as the pump's Queue.Batch would have released them; one held
	// back beyond the horizon by a limit of its own is skipped (as Batch skips it). Usually
	// w is first; a few at most are looked at (fairNewcomerAhead), never the whole queue.
	until := wall.Add(f.horizon)
	held := map[uint64]bool{}
	eligible := func(it sched.Item) bool { return !held[it.ID] }
	var batch []*waiter
	for looked := 0; looked <= fairNewcomerAhead; looked++ {
		it, ok := q.q.Peek(wall, eligible)
		if !ok {
			break
		}
		o := f.waiters[it.ID]
		if o == nil {
			break
		}
		ov := v
		if o != w {
			ov, _ = f.readPath(o.adm.Domain, entries(o.adm.Descriptors))
		}
		s := f.slotOf(q, o, ov, now, wall)
		if o != w && s.Own && s.At.After(until) {
			held[it.ID] = true
			continue
		}
		if s.At.After(reach) {
			break
		}
		if next, ok := q.q.Next(wall, eligible); !ok || next.ID != it.ID {
			break // cannot happen: Next dispatches what Peek returned
		}
		f.takeLocked(q, o, now, wall, o == w)
		batch = append(batch, o)
		if o == w {
			break
		}
	}
	if len(batch) > 0 {
		f.outbox = append(f.outbox, batch)
	}
	if q.q.Len() == 0 && f.queues[q.key] == q {
		delete(f.queues, q.key)
		f.metrics.queue(q, wall, f.usage[q.key])
	}
	return f.waiters[w.id] != w
}

// passLocked is pass with f.mu held, at leader time now (wall: the same moment as wall time):
// it releases batches into f.outbox, which the caller flushes once it has let go of f.mu,
// and says how long to sleep.
func (f *fair) passLocked(now int64, wall time.Time) time.Duration {
	f.refreshApplied()
	horizon := f.horizon
	wake := now + int64(fairPoll)
	views := map[string]*pathView{}
	view := func(w *waiter) *pathView {
		v, ok := views[w.pathKey]
		if !ok {
			v, _ = f.readPath(w.adm.Domain, entries(w.adm.Descriptors))
			views[w.pathKey] = v
		}
		return v
	}
	keys := make([]string, 0, len(f.queues))
	for k := range f.queues {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		q := f.queues[k]
		until := wall.Add(horizon)
		// owed: a waiter left in the queue waits for this bucket (not for a limit of its own).
		// Then the bucket's units are the waiters' even if it holds some now (a cost-5 head
		// while 3 have accrued), so it is not spare for non-waiting callers.
		owed := false
		slot := func(it sched.Item) sched.Slot {
			w := f.waiters[it.ID]
			s := f.slotOf(q, w, view(w), now, wall)
			if !s.Own && s.At.After(until) {
				owed = true
			}
			return s
		}
		var batch []*waiter
		take := func(it sched.Item) {
			w := f.waiters[it.ID]
			f.takeLocked(q, w, now, wall, false)
			batch = append(batch, w)
		}
		_, next := q.q.Batch(wall, until, slot, take)
		if len(batch) > 0 {
			f.outbox = append(f.outbox, batch)
		}
		if !next.IsZero() {
			wake = min(wake, now+int64(next.Sub(wall))-int64(horizon))
		}
		q.spare = false
		if q.q.Len() > 0 {
			if v, err := f.readPath(q.domain, q.prefix); err == nil && !owed && q.level < len(v.levels) && f.levelAt(v, q.level, 1, true) <= now {
				q.spare = true
				f.metrics.spareTokens(q, v.levels[q.level].Remaining)
			}
		} else {
			delete(f.queues, k)
		}
		f.metrics.queue(q, wall, f.usage[k])
	}
	return max(time.Duration(wake-now), fairPassMin)
}

// waiterRevoked reports whether w's caller called with a token that is no longer stored, or
// with a certificate on the deny-list.
func (f *fair) waiterRevoked(w *waiter) bool {
	if f.s.certRevokedOwner(w.cert) {
		return true
	}
	accessor, ok := strings.CutPrefix(w.owner, fsm.TokenIdentityPrefix)
	return ok && !f.s.fsm.TokenStored(accessor)
}

// dropRevokedLocked fails the queued waiters whose token (or certificate) was revoked since
// they were checked:
// a revoke stops a caller's waiting admissions too, not only its next calls (before, a
// waiter queued for max_wait_ms — uncapped — kept being granted after the revoke). Waiters
// already released are in the log's hands, like any call in flight. A map lookup per
// waiter, only when the token table changed. f.mu held.
func (f *fair) dropRevokedLocked() {
	gen, certGen := f.s.fsm.TokensGeneration(), f.s.fsm.CertsGeneration()
	if gen == f.tokensGen && certGen == f.certsGen {
		return
	}
	f.tokensGen, f.certsGen = gen, certGen
	for _, w := range f.waiters {
		if !f.waiterRevoked(w) {
			continue
		}
		if w.queue != nil {
			f.unqueue(w.queue, w)
		} else {
			f.dropWaiter(w)
		}
		w.revoked = true
		close(w.failed)
	}
}

// revokedWhileWaiting is the answer to an admission whose caller's token or certificate was
// revoked before it was decided.
func revokedWhileWaiting(w *waiter) error {
	if !w.cert.IsZero() {
		return status.Errorf(codes.Unauthenticated, "the client certificate of %s (serial %s) was revoked while this admission waited; it was not decided — ask an admin for a new certificate (quotad tls cert create) or a token",
			w.owner, w.cert.Serial)
	}
	return status.Errorf(codes.Unauthenticated, "the bearer token with accessor %s was revoked while this admission waited; it was not decided — ask an admin for a token (quotad token create)",
		strings.TrimPrefix(w.owner, fsm.TokenIdentityPrefix))
}

// failAll fails every waiter: this node no longer leads (or is stopping).
func (f *fair) failAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for id, w := range f.waiters {
		f.dropWaiter(w)
		if w.queue != nil {
			w.queue.q.Remove(id)
		}
		close(w.failed)
	}
	clear(f.queues)
	clear(f.pending)
	clear(f.pendingConc)
	f.npend.Store(0)
	clear(f.inflight)
	clear(f.relFlows)
	clear(f.applied)
	clear(f.appliedConc)
}
