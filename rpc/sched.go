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

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
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
// ("pending"); when a bucket can pay, the queue picks who goes next, and that waiter's
// admission goes through the normal proposer: the FSM re-checks and debits, so the scheduler
// never grants what the FSM would refuse. A waiter the FSM still denies (a race with an
// admission already in flight) is requeued at the head of its flow until its wait ends, then
// gets that denial.
//
// A non-waiting admission whose path crosses a bucket with eligible waiters is denied
// (rate_limited, scope of that bucket, retry_after = the queue's backlog at the bucket's
// rate): the capacity is the waiters'. It is admitted only from capacity no waiter can use.
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
	// fairMargin is added to a predicted refill time so a released admission is not early by
	// a rounding error (the FSM rounds against the caller).
	fairMargin = 200 * time.Microsecond
	// fairAgingAfter: a request waiting this long goes before its tenant's other work.
	fairAgingAfter = 5 * time.Second
	// fairReserveBurst: units of reserve credit an idle work class banks.
	fairReserveBurst = 2
	// fairLimitsRefresh: how often the limits (classes, weights) are re-read.
	fairLimitsRefresh = time.Second
	// fairShareWindow is the window of usage shares (metrics, top).
	fairShareWindow = 10 * time.Second
)

type fair struct {
	s       *Server
	metrics *fairMetrics

	mu          sync.Mutex
	queues      map[string]*fairQueue // by contended bucket key
	waiters     map[uint64]*waiter    // by sched ID
	pending     map[string]uint64     // bucket key → cost released to the proposer, not yet answered
	pendingConc map[string]uint64     // concurrency key → permits released, not yet answered
	seq         uint64
	limits      *quota.Limits
	limitsAt    time.Time
	usage       map[string]*shareWindow // by bucket key: who got the capacity lately
	usageSwept  time.Time               // last pruneUsage pass

	nwait atomic.Int64 // waiters queued (fast check on the hot path)
	slots waiterSlots  // waiting admissions by client and domain, for the waiter caps
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
	spare              bool // last pass: waiters present, none eligible, bucket could pay
	created            time.Time
	prefix             []quota.Entry // the path down to the contended level
}

// waiter is one waiting admission.
type waiter struct {
	id       uint64
	owner    string // the caller's identity name (fsmv1.Acquire.owner)
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
	concKeys   []string // concurrency-limited keys on its path
	arrived    time.Time
	ready      chan struct{} // released by the pump (buffered)
	failed     chan struct{} // closed when leadership is lost
}

// pathView is the FSM's state along one descriptor path at FSM time clock, and the limits
// nodes matched at each level (nil for the domain itself).
type pathView struct {
	clock  int64
	levels []quota.BucketStatus
	nodes  []*quota.Node
}

func newFair(s *Server) *fair {
	f := &fair{
		s:           s,
		metrics:     newFairMetrics(s.metrics),
		queues:      make(map[string]*fairQueue),
		waiters:     make(map[uint64]*waiter),
		pending:     make(map[string]uint64),
		pendingConc: make(map[string]uint64),
		usage:       make(map[string]*shareWindow),
		kick:        make(chan struct{}, 1),
		stop:        make(chan struct{}),
		done:        make(chan struct{}),
	}
	f.registerCollectors(s.metrics)
	go f.loop()
	return f
}

func (f *fair) close() {
	close(f.stop)
	<-f.done
}

// handles reports whether req goes through the scheduler: it has a waiting admission, or
// admissions are waiting somewhere (a non-waiting one may have to yield to them).
func (f *fair) handles(req *quotadv1.AcquireRequest) bool {
	if f.nwait.Load() > 0 {
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
func (f *fair) acquire(ctx context.Context, req *quotadv1.AcquireRequest, owner string) (*quotadv1.AcquireResponse, error) {
	s := f.s
	start := time.Now()
	resp := &quotadv1.AcquireResponse{Decisions: make([]*quotadv1.Decision, len(req.Admissions))}
	errs := make([]error, len(req.Admissions))
	var (
		ops       [][]byte
		idx       []int
		batchErrs []error
	)
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
			waiter := clientKey(owner, req.ClientId)
			if msg, scope := f.slots.take(waiter, adm.Domain); msg != "" {
				resp.Decisions[i] = f.tooManyWaiters(adm.Domain, msg, scope)
				continue
			}
			wg.Go(func() {
				defer f.slots.put(waiter, adm.Domain)
				resp.Decisions[i], errs[i] = f.wait(ctx, owner, req.ClientId, adm)
			})
			continue
		}
		if !known {
			if d := f.gate(adm); d != nil {
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
				resp.Decisions[idx[j]] = decisionToProto(r.res.Decision)
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
	for _, d := range resp.Decisions {
		s.metrics.observeDecision(d.Reason, took)
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
	v := &pathView{clock: c0, levels: st, nodes: make([]*quota.Node, len(st))}
	lim := f.limitsLocked()
	var d *quota.Domain
	for i := range lim.Domains {
		if lim.Domains[i].Name == domain {
			d = &lim.Domains[i]
		}
	}
	if d != nil {
		children := d.Descriptors
		for i := 1; i < len(st) && i-1 < len(entries); i++ {
			n := matchNode(children, entries[i-1])
			if n == nil {
				break
			}
			v.nodes[i] = n
			children = n.Children
		}
	}
	return v, nil
}

// matchNode is the engine's matching rule: exact (key, value), else (key, "").
func matchNode(nodes []quota.Node, e quota.Entry) *quota.Node {
	var wild *quota.Node
	for i := range nodes {
		n := &nodes[i]
		if n.Key != e.Key {
			continue
		}
		if n.Value == e.Value {
			return n
		}
		if n.Value == "" {
			wild = n
		}
	}
	return wild
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

// levelAt returns the FSM time at which level i of v can pay cost on top of what is
// pending, or math.MaxInt64 when that cannot be predicted (permits all held, or pending
// releases must be answered first). Shadow and unlimited levels never hold a request back.
func (f *fair) levelAt(v *pathView, i int, cost uint64) int64 {
	b := &v.levels[i]
	if n := v.nodes[i]; n != nil && (n.ShadowMode || n.Unlimited) {
		return v.clock
	}
	at := v.clock
	if b.PausedFor > 0 {
		at = v.clock + int64(b.PausedFor)
	}
	if b.MaxInFlight > 0 && b.InFlight+f.pendingConc[b.Key] >= b.MaxInFlight {
		return math.MaxInt64
	}
	if b.Limit > 0 && b.Window > 0 {
		need := cost + f.pending[b.Key]
		if need > b.Burst {
			return math.MaxInt64
		}
		perUnit := float64(b.Window) / float64(b.Limit)
		ready := v.clock + int64(b.ResetAfter) - int64(float64(b.Burst-need)*perUnit)
		if ready > v.clock {
			ready += int64(fairMargin)
		}
		at = max(at, ready)
	}
	return at
}

// admitAt is the time every level of v can pay cost, and the outermost level that is last.
func (f *fair) admitAt(v *pathView, cost uint64) (int64, int) {
	at, which := v.clock, -1
	for i := range v.levels {
		if t := f.levelAt(v, i, cost); t > at {
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

// gate denies a non-waiting admission whose path crosses a bucket with eligible waiters.
func (f *fair) gate(adm *quotadv1.Admission) *quotadv1.Decision {
	if f.nwait.Load() == 0 {
		return nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.queues) == 0 {
		return nil
	}
	v, err := f.readPath(adm.Domain, entries(adm.Descriptors))
	if err != nil {
		return nil // the FSM will say what is wrong
	}
	q := f.queueOn(v)
	if q == nil || q.spare {
		return nil
	}
	b := v.levels[q.level]
	d := &quotadv1.Decision{
		Reason: string(quota.ReasonRateLimited), Scope: q.scope, Limit: b.Limit,
		WindowMs: b.Window.Milliseconds(), ResetAfterMs: ceilMs(b.ResetAfter),
		RetryAfterMs: max(1, ceilMs(q.backlog())),
		Message:      "requests waiting on this bucket have priority; send with max_wait_ms to queue fairly",
	}
	f.metrics.denied(adm.Domain, d.Reason, "waiters:"+q.scope)
	return d
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
	var b strings.Builder
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

// wait decides one admission that may wait up to its max_wait_ms.
func (f *fair) wait(ctx context.Context, owner, clientID string, adm *quotadv1.Admission) (*quotadv1.Decision, error) {
	arrived := time.Now()
	deadline := arrived.Add(time.Duration(adm.MaxWaitMs) * time.Millisecond)
	w := &waiter{owner: owner, clientID: clientID, adm: adm, cost: max(adm.Cost, 1), pathKey: pathKey(adm),
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
		v, err := f.readPath(adm.Domain, es)
		if err != nil {
			f.mu.Unlock()
			d, _, perr := f.propose(ctx, w)
			return d, perr
		}
		w.rateKeys, w.concKeys = w.rateKeys[:0], w.concKeys[:0]
		for i, b := range v.levels {
			if n := v.nodes[i]; n != nil && (n.ShadowMode || n.Unlimited) {
				continue
			}
			if b.Limit > 0 {
				w.rateKeys = append(w.rateKeys, b.Key)
			}
			if b.MaxInFlight > 0 {
				w.concKeys = append(w.concKeys, b.Key)
			}
		}
		q := f.queueOn(v)
		at, blocking := f.admitAt(v, w.cost)
		if q == nil && !requeue && at <= now {
			// Nobody waits on this path and every bucket can pay: go straight to the FSM.
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
				f.mu.Unlock()
				return f.denial(adm.Domain, v, blocking, time.Duration(at-now)), nil
			}
			q = f.newQueue(adm.Domain, v, es, blocking, time.Now())
		}
		f.push(q, w, v, es, requeue)
		f.mu.Unlock()
		f.wake()

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
			if f.waiters[w.id] == w {
				f.unqueue(q, w)
			} else if len(w.ready) > 0 {
				<-w.ready // released while the wait ended: take it
				released = true
			}
			f.mu.Unlock()
		}
		if !released {
			select {
			case <-w.failed:
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
			retry := q.backlog()
			if at, _ := f.admitAt(v, w.cost); at != math.MaxInt64 {
				retry = max(retry, time.Duration(at-now))
			}
			return f.denial(adm.Domain, v, q.level, retry), nil
		}
		d, final, err := f.decide(ctx, w)
		if err != nil || final || time.Now().After(deadline) {
			f.metrics.waited(w, d != nil && d.Admitted, time.Since(arrived))
			return d, err
		}
		last, requeue = d, true
	}
}

// denial is the scheduler's own refusal of a waiting admission (not recorded by the FSM: a
// retry with the same request ID is decided afresh).
func (f *fair) denial(domain string, v *pathView, level int, retry time.Duration) *quotadv1.Decision {
	b := v.levels[level]
	reason := quota.ReasonRateLimited
	switch {
	case b.PausedFor > 0:
		reason = quota.ReasonPaused
	case b.MaxInFlight > 0 && b.InFlight >= b.MaxInFlight:
		reason = quota.ReasonConcurrencyLimited
	}
	if retry <= 0 || retry == math.MaxInt64 {
		retry = fairPoll
	}
	f.metrics.denied(domain, string(reason), b.Scope)
	return &quotadv1.Decision{Reason: string(reason), Scope: b.Scope, Limit: b.Limit,
		Remaining: b.Remaining, WindowMs: b.Window.Milliseconds(), ResetAfterMs: ceilMs(b.ResetAfter),
		RetryAfterMs: max(1, ceilMs(retry))}
}

// decide proposes a released waiter and returns the FSM's decision; final is false when it
// was denied for a reason time can cure and the FSM has not made that denial sticky.
func (f *fair) decide(ctx context.Context, w *waiter) (*quotadv1.Decision, bool, error) {
	d, dup, err := f.propose(ctx, w)
	f.mu.Lock()
	f.unreserve(w)
	if d != nil && d.Admitted {
		f.recordAdmission(w, time.Now())
	}
	f.mu.Unlock()
	f.wake()
	if err != nil {
		return nil, true, err
	}
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

func (f *fair) propose(ctx context.Context, w *waiter) (*quotadv1.Decision, bool, error) {
	op := &fsmv1.Op{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{ClientId: w.clientID, Admission: w.adm, Owner: w.owner}}}
	r, err := f.s.prop.propose(ctx, op)
	if err != nil {
		return nil, false, f.s.applyError(err)
	}
	return decisionToProto(r.Decision), r.Duplicate, nil
}

// reserve counts a released waiter's cost as pending on its buckets. f.mu held.
func (f *fair) reserve(w *waiter) {
	for _, k := range w.rateKeys {
		f.pending[k] += w.cost
	}
	for _, k := range w.concKeys {
		f.pendingConc[k]++
	}
}

// unreserve undoes reserve once the FSM has answered (its state now shows the debit). f.mu held.
func (f *fair) unreserve(w *waiter) {
	for _, k := range w.rateKeys {
		if f.pending[k] <= w.cost {
			delete(f.pending, k)
		} else {
			f.pending[k] -= w.cost
		}
	}
	for _, k := range w.concKeys {
		if f.pendingConc[k] <= 1 {
			delete(f.pendingConc, k)
		} else {
			f.pendingConc[k]--
		}
	}
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

// push queues w on q. f.mu held.
func (f *fair) push(q *fairQueue, w *waiter, v *pathView, es []quota.Entry, requeue bool) {
	flow, weight, tier := flowOf(v, es, q.level)
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
	f.waiters[w.id] = w
	f.nwait.Add(1)
}

// unqueue removes a waiter that stopped waiting before it was released. f.mu held.
func (f *fair) unqueue(q *fairQueue, w *waiter) {
	if f.waiters[w.id] == nil {
		return
	}
	delete(f.waiters, w.id)
	f.nwait.Add(-1)
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
	for {
		var lc <-chan struct{}
		if ln != nil {
			lc = ln.LeaderChanged()
		}
		select {
		case <-f.stop:
			f.failAll()
			return
		case <-f.kick:
		case <-timer.C:
		case <-lc:
		}
		next := f.pass()
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		timer.Reset(next)
	}
}

// pass releases every waiter the queues pick while buckets can pay, and returns how long to
// sleep before the next predicted refill.
func (f *fair) pass() time.Duration {
	if f.nwait.Load() == 0 {
		f.metrics.idle()
		return time.Second
	}
	now, err := f.s.node.Now()
	if err != nil {
		f.failAll()
		return fairPoll
	}
	wall := time.Now()
	f.mu.Lock()
	defer f.mu.Unlock()
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
		eligible := func(it sched.Item) bool {
			w := f.waiters[it.ID]
			v := view(w)
			if v == nil {
				return true // the FSM will say what is wrong
			}
			at, _ := f.admitAt(v, w.cost)
			if at > now {
				wake = min(wake, at)
				return false
			}
			return true
		}
		for {
			it, ok := q.q.Next(wall, eligible)
			if !ok {
				break
			}
			w := f.waiters[it.ID]
			delete(f.waiters, it.ID)
			f.nwait.Add(-1)
			q.cost -= min(q.cost, w.cost)
			f.reserve(w)
			w.ready <- struct{}{}
		}
		q.spare = false
		if q.q.Len() > 0 {
			if v, err := f.readPath(q.domain, q.prefix); err == nil && q.level < len(v.levels) && f.levelAt(v, q.level, 1) <= now {
				q.spare = true
				f.metrics.spareTokens(q, v.levels[q.level].Remaining)
			}
		} else {
			delete(f.queues, k)
		}
		f.metrics.queue(q, wall, f.usage[k])
	}
	d := time.Duration(wake - now)
	return max(d, 100*time.Microsecond)
}

// failAll fails every waiter: this node no longer leads (or is stopping).
func (f *fair) failAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for id, w := range f.waiters {
		delete(f.waiters, id)
		f.nwait.Add(-1)
		if w.queue != nil {
			w.queue.q.Remove(id)
		}
		close(w.failed)
	}
	clear(f.queues)
	clear(f.pending)
	clear(f.pendingConc)
}
