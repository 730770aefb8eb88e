package chaos

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/chaos/faults"
	"github.com/quotad/quotad/client"
)

// Limits the suite writes for its run. Budget buckets refill 12 units a day (one every two
// hours), so within a run of under an hour they do not refill a whole unit: their spends are
// exactly the model "admitted iff remaining ≥ cost". A build that let wall-clock time into the
// FSM would refill them by hours on a clock offset.
const (
	BudgetDomain = "budget"
	RateDomain   = "rate"
	LeaseDomain  = "lease"

	BudgetBurst      = 2000
	RateBurst        = 10
	RatePerSecond    = 20
	LeaseMaxInFlight = 4
	LeaseTTL         = 3 * time.Second
)

// LimitsYAML is the limits file of a chaos run.
var LimitsYAML = fmt.Sprintf(`# written by the chaos suite
domain: %s
descriptors:
  - key: b
    rate_limit: {unit: day, requests_per_unit: 12, burst: %d}
---
domain: %s
descriptors:
  - key: r
    rate_limit: {unit: second, requests_per_unit: %d, burst: %d}
---
domain: %s
descriptors:
  - key: pool
    concurrency: {max_in_flight: %d, lease_ttl: %s}
`, BudgetDomain, BudgetBurst, RateDomain, RatePerSecond, RateBurst, LeaseDomain, LeaseMaxInFlight, LeaseTTL)

// recorder collects a run's history; safe for concurrent use.
type recorder struct {
	start time.Time
	mu    sync.Mutex
	h     History
}

func newRecorder(seed int64) *recorder {
	r := &recorder{start: time.Now()}
	r.h.Seed, r.h.Start = seed, r.start
	return r
}

func (r *recorder) now() int64 { return int64(time.Since(r.start)) }

func (r *recorder) addOp(op Op) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	op.Index = len(r.h.Ops)
	r.h.Ops = append(r.h.Ops, op)
	return op.Index
}

func (r *recorder) updateOp(i int, f func(*Op)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f(&r.h.Ops[i])
}

func (r *recorder) op(i int) Op {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.h.Ops[i]
}

func (r *recorder) addFault(f Fault) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.h.FirstFault == 0 && f.Skipped == "" {
		r.h.FirstFault = f.Start
	}
	r.h.Faults = append(r.h.Faults, f)
}

func (r *recorder) add(f func(h *History)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f(&r.h)
}

func (r *recorder) snapshot() *History {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := r.h
	h.Ops = append([]Op(nil), r.h.Ops...)
	h.Replays = append([]Replay(nil), r.h.Replays...)
	h.Status = append([]StatusSample(nil), r.h.Status...)
	h.States = append([]StateSample(nil), r.h.States...)
	h.Faults = append([]Fault(nil), r.h.Faults...)
	h.Reclaim = append([]Reclaim(nil), r.h.Reclaim...)
	h.Forgeries = append([]Forgery(nil), r.h.Forgeries...)
	h.HolderFaults = append([]HolderFault(nil), r.h.HolderFaults...)
	return &h
}

// WorkloadConfig sizes the workload.
type WorkloadConfig struct {
	BudgetWorkers int
	RateWorkers   int
	LeaseWorkers  int
	// Clients is how many client.Clients the budget workers share (each batches its callers).
	Clients int
	// CallTimeout bounds one admission, retries included; then its outcome is unknown.
	CallTimeout time.Duration
	// ResolveWithin is how long after its call an unknown op's request ID is re-sent to learn
	// its outcome (well inside the FSM's 2-minute dedup window).
	ResolveWithin time.Duration
	// BudgetGeneration is how long workers spend one generation of budget buckets before
	// moving to fresh ones (keeps porcupine's partitions small).
	BudgetGeneration time.Duration
	// CrashRate is the fraction of lease holders that "crash" (never release).
	CrashRate float64
	// RawToAnyNode makes budget workers send single admissions over raw gRPC to a random
	// node instead of through the client (which follows the leader): the planted
	// "follower decides" bug is only reachable that way.
	RawToAnyNode bool
	// ImpatientWorkers spend on the same budget buckets as the budget workers, each call with
	// a deadline drawn in [ImpatientMin, ImpatientMax] — shorter than a failover — so calls
	// that overlap a leader change, a pause or a lost reply end without an answer: unknown
	// outcomes, which porcupine must place. Every other call goes through a client whose
	// attempts are that short too (it retries the request ID while the deadline lasts);
	// the others are one raw Acquire to a random node, so a reply lost after the commit is
	// unknown at once.
	ImpatientWorkers           int
	ImpatientMin, ImpatientMax time.Duration
	// LeaveAmbiguous is the fraction of the impatient workers' unknown outcomes that are never
	// re-sent: they stay ambiguous to the end (porcupine ends them at infinity, admitted or
	// not). The rest, and every other unknown spend, are re-sent to learn the outcome.
	LeaveAmbiguous float64
	// MaxAmbiguousPerBucket caps the unknowns left ambiguous on purpose in one budget bucket;
	// past it they are re-sent like the rest. Each one ends at infinity, so porcupine has to
	// try it at every point of the bucket's history, admitted or not: a fault that made 30 of
	// them in one bucket left the search undecided after 2 minutes (2,099 ops), while a handful
	// per bucket costs milliseconds. The pressure stays: every bucket a fault hits gets some.
	MaxAmbiguousPerBucket int
}

// DefaultWorkload is sized for a 2-core CI machine.
func DefaultWorkload() WorkloadConfig {
	return WorkloadConfig{
		BudgetWorkers: 16, RateWorkers: 8, LeaseWorkers: 6, Clients: 4,
		CallTimeout: 8 * time.Second, ResolveWithin: 60 * time.Second,
		BudgetGeneration: 4 * time.Second, CrashRate: 0.2,
		ImpatientWorkers: 4, ImpatientMin: 50 * time.Millisecond, ImpatientMax: 300 * time.Millisecond,
		LeaveAmbiguous: 0.15, MaxAmbiguousPerBucket: 6,
	}
}

// workload drives the cluster through the Go client and records every op.
type workload struct {
	cfg  WorkloadConfig
	c    *Cluster
	rec  *recorder
	rng  func() *rand.Rand
	addr []string

	clients []*client.Client
	// impatient is the client of the impatient workers: attempts as short as their calls.
	impatient *client.Client
	rawSeq    atomic.Uint64 // request IDs of raw admissions (own client ID namespace is shared, so start high)
	wg        sync.WaitGroup
	resolve   sync.WaitGroup

	leftMu sync.Mutex
	left   map[string]int // unknown spends left ambiguous on purpose, per bucket
}

func newWorkload(cfg WorkloadConfig, c *Cluster, rec *recorder, seed int64) (*workload, error) {
	w := &workload{cfg: cfg, c: c, rec: rec}
	var mu sync.Mutex
	seq := uint64(0)
	w.rng = func() *rand.Rand { // one deterministic stream per worker
		mu.Lock()
		defer mu.Unlock()
		seq++
		return rand.New(rand.NewPCG(uint64(seed), seq))
	}
	for _, n := range c.Nodes {
		w.addr = append(w.addr, n.GRPC)
	}
	w.rawSeq.Store(1 << 62)
	for range max(cfg.Clients, 1) + 2 {
		cl, err := client.New(c.ClientConfig(w.addr...))
		if err != nil {
			return nil, err
		}
		w.clients = append(w.clients, cl)
	}
	if cfg.ImpatientWorkers > 0 {
		icfg := c.ClientConfig(w.addr...)
		icfg.AttemptTimeout = max(cfg.ImpatientMin, 10*time.Millisecond)
		icfg.Backoff.Initial, icfg.Backoff.Max = 5*time.Millisecond, 50*time.Millisecond
		cl, err := client.New(icfg)
		if err != nil {
			w.close()
			return nil, err
		}
		w.impatient = cl
	}
	return w, nil
}

// start runs every worker until ctx ends.
func (w *workload) start(ctx context.Context) {
	budgetClients := w.clients[:len(w.clients)-2]
	rateClient, leaseClient := w.clients[len(w.clients)-2], w.clients[len(w.clients)-1]
	id := 0
	for i := range w.cfg.BudgetWorkers {
		id++
		w.wg.Go(func() { w.budgetWorker(ctx, id, budgetClients[i%len(budgetClients)], w.rng()) })
	}
	for range w.cfg.RateWorkers {
		id++
		w.wg.Go(func() { w.rateWorker(ctx, id, rateClient, w.rng()) })
	}
	for range w.cfg.LeaseWorkers {
		id++
		w.wg.Go(func() { w.leaseWorker(ctx, id, leaseClient, w.rng()) })
	}
	for range w.cfg.ImpatientWorkers {
		id++
		w.wg.Go(func() { w.impatientWorker(ctx, id, w.rng()) })
	}
	w.wg.Go(func() { w.replayer(ctx, w.rng()) })
	w.wg.Go(func() { w.statusSampler(ctx, leaseClient) })
}

func (w *workload) close() {
	for _, cl := range w.clients {
		_ = cl.Close()
	}
	if w.impatient != nil {
		_ = w.impatient.Close()
	}
}

// outcomeOf maps the client's result to an outcome.
func outcomeOf(err error) string {
	switch {
	case err == nil:
		return Admitted
	case errors.Is(err, client.ErrDenied):
		return Denied
	case errors.Is(err, client.ErrInvalid):
		return Failed
	default:
		return Unknown
	}
}

// Causes of unknown outcomes (Op.Cause).
const (
	CauseDeadline    = "deadline"    // the caller's deadline passed without an answer
	CauseLostReply   = "lost-reply"  // a node lost the reply after the commit (the chaos hook said so)
	CauseUnavailable = "unavailable" // no node answered (no leader, node down, connection broken)
)

// causeOf classifies the error of a call whose outcome is unknown.
func causeOf(err error) string {
	switch {
	case err == nil:
		return ""
	case strings.Contains(err.Error(), faults.DroppedMessage):
		return CauseLostReply
	case errors.Is(err, context.DeadlineExceeded), status.Code(err) == codes.DeadlineExceeded:
		return CauseDeadline
	default:
		return CauseUnavailable
	}
}

// admit runs one Allow and records it as an Op; unknown outcomes are resolved in the
// background by re-sending the request ID.
func (w *workload) admit(ctx context.Context, worker int, cl *client.Client, kind string, req client.Request) (Op, client.Decision, error) {
	return w.admitWithin(ctx, worker, cl, kind, req, w.cfg.CallTimeout, true)
}

// admitWithin is admit with a deadline for the call, and resolve saying whether an unknown
// spend is re-sent.
func (w *workload) admitWithin(ctx context.Context, worker int, cl *client.Client, kind string, req client.Request, timeout time.Duration, resolve bool) (Op, client.Decision, error) {
	cctx, cancel := context.WithTimeout(ctx, timeout)
	call := w.rec.now()
	d, err := cl.Allow(cctx, req)
	ret := w.rec.now()
	cancel()
	op := Op{Worker: worker, Kind: kind, Domain: req.Domain, Bucket: req.Descriptors[0].Value, Cost: max(req.Cost, 1),
		ClientID: cl.ClientID(), RequestID: d.RequestID, Call: call, Return: ret, Outcome: outcomeOf(err),
		Reason: string(d.Reason), Remaining: d.Remaining, LeaseID: d.LeaseID, LeaseTTL: d.LeaseTTL,
		ReleaseCall: -1, ReleaseReturn: -1}
	if op.Outcome == Failed {
		op.Reason = err.Error()
	}
	if op.Outcome == Unknown && kind == KindSpend && !resolve {
		resolve = !w.leaveAmbiguous(op.Bucket)
	}
	if op.Outcome == Unknown {
		op.Cause = causeOf(err)
		op.NotResent = !resolve && kind == KindSpend
	}
	op.Index = w.rec.addOp(op)
	if op.Outcome == Unknown && d.RequestID != 0 && kind == KindSpend && resolve {
		w.resolve.Go(func() { w.resolveUnknown(op.Index, req) })
	}
	return op, d, err
}

func (w *workload) budgetWorker(ctx context.Context, id int, cl *client.Client, rng *rand.Rand) {
	for ctx.Err() == nil {
		req := w.budgetRequest(rng)
		if w.cfg.RawToAnyNode {
			w.rawAdmit(id, cl.ClientID(), req, rng, 2*time.Second, true)
			continue
		}
		w.admit(ctx, id, cl, KindSpend, req)
	}
}

// budgetRequest draws a spend on one of the current generation's budget buckets.
func (w *workload) budgetRequest(rng *rand.Rand) client.Request {
	gen := time.Since(w.rec.start) / w.cfg.BudgetGeneration
	bucket := fmt.Sprintf("g%d-%d", gen, rng.IntN(2))
	return client.Request{Domain: BudgetDomain, Descriptors: client.Descriptors("b", bucket), Cost: uint64(1 + rng.IntN(4))}
}

// impatientWorker spends on the budget buckets with deadlines shorter than a failover (see
// WorkloadConfig.ImpatientWorkers).
func (w *workload) impatientWorker(ctx context.Context, id int, rng *rand.Rand) {
	span := int64(max(w.cfg.ImpatientMax-w.cfg.ImpatientMin, 0))
	for ctx.Err() == nil {
		req := w.budgetRequest(rng)
		timeout := w.cfg.ImpatientMin + time.Duration(rng.Int64N(span+1))
		resolve := rng.Float64() >= w.cfg.LeaveAmbiguous
		if rng.IntN(2) == 0 {
			w.rawAdmit(id, w.impatient.ClientID(), req, rng, timeout, resolve)
		} else {
			w.admitWithin(ctx, id, w.impatient, KindSpend, req, timeout, resolve)
		}
		// A little slower than the others: most of their calls are answered in a few ms.
		sleepCtx(ctx, time.Duration(rng.IntN(20))*time.Millisecond)
	}
}

func (w *workload) rateWorker(ctx context.Context, id int, cl *client.Client, rng *rand.Rand) {
	for ctx.Err() == nil {
		bucket := fmt.Sprintf("r%d", rng.IntN(2))
		req := client.Request{Domain: RateDomain, Descriptors: client.Descriptors("r", bucket), Cost: 1}
		op, d, _ := w.admit(ctx, id, cl, KindRate, req)
		if op.Outcome == Denied {
			sleepCtx(ctx, min(d.RetryAfter, 50*time.Millisecond)+time.Duration(rng.IntN(10))*time.Millisecond)
		}
	}
}

func (w *workload) leaseWorker(ctx context.Context, id int, cl *client.Client, rng *rand.Rand) {
	for ctx.Err() == nil {
		req := client.Request{Domain: LeaseDomain, Descriptors: client.Descriptors("pool", "p0"), Cost: 1}
		op, d, _ := w.admit(ctx, id, cl, KindLease, req)
		switch {
		case op.Outcome == Admitted && d.LeaseID != 0:
			if rng.Float64() < w.cfg.CrashRate {
				continue // the holder crashed: it never renews nor releases
			}
			sleepCtx(ctx, time.Duration(20+rng.IntN(300))*time.Millisecond)
			rctx, cancel := context.WithTimeout(context.Background(), w.cfg.CallTimeout)
			rc := w.rec.now()
			_, err := cl.ReleaseLease(rctx, d.LeaseID)
			rr := w.rec.now()
			cancel()
			w.rec.updateOp(op.Index, func(o *Op) {
				o.ReleaseCall = rc
				if err == nil {
					o.ReleaseReturn = rr
				}
			})
		case op.Outcome == Denied:
			sleepCtx(ctx, time.Duration(20+rng.IntN(80))*time.Millisecond)
		}
	}
}

// leaveAmbiguous reports whether one more unknown spend in bucket may be left ambiguous on
// purpose (WorkloadConfig.MaxAmbiguousPerBucket), and counts it if so.
func (w *workload) leaveAmbiguous(bucket string) bool {
	w.leftMu.Lock()
	defer w.leftMu.Unlock()
	if w.left == nil {
		w.left = make(map[string]int)
	}
	if w.left[bucket] >= w.cfg.MaxAmbiguousPerBucket {
		return false
	}
	w.left[bucket]++
	return true
}

// rawAdmit sends one spend straight to a random node (no leader following, no retry) with a
// deadline and records it; resolve says whether an unknown outcome is re-sent.
func (w *workload) rawAdmit(worker int, clientID string, req client.Request, rng *rand.Rand, timeout time.Duration, resolve bool) {
	op := Op{Worker: worker, Kind: KindSpend, Domain: req.Domain, Bucket: req.Descriptors[0].Value, Cost: max(req.Cost, 1),
		ClientID: clientID, RequestID: w.rawSeq.Add(1), ReleaseCall: -1, ReleaseReturn: -1}
	adm := admissionOf(op, req)
	cc, err := w.c.Conn(w.addr[rng.IntN(len(w.addr))])
	if err != nil {
		return
	}
	op.Call = w.rec.now()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	resp, err := quotadv1.NewQuotaClient(cc).Acquire(ctx, &quotadv1.AcquireRequest{ClientId: clientID, Admissions: []*quotadv1.Admission{adm}})
	cancel()
	op.Return, op.Outcome = w.rec.now(), Unknown
	if err == nil && len(resp.GetDecisions()) == 1 {
		d := resp.GetDecisions()[0]
		op.Outcome, op.Reason, op.Remaining = decisionOutcome(d), d.GetReason(), d.GetRemaining()
	} else if err == nil {
		err = fmt.Errorf("%d decisions for one admission", len(resp.GetDecisions()))
	}
	if op.Outcome == Unknown && !resolve {
		resolve = !w.leaveAmbiguous(op.Bucket)
	}
	if op.Outcome == Unknown {
		op.Cause, op.NotResent = causeOf(err), !resolve
	}
	op.Index = w.rec.addOp(op)
	if op.Outcome == Unknown && resolve {
		w.resolve.Go(func() { w.resolveUnknown(op.Index, req) })
	}
}

// resolveUnknown re-sends an unknown op's request ID until it gets an answer or the op is
// ResolveWithin old. The answer is the original decision if one was made (dedup), or a new
// one made now; either way the decision happened once, inside [Call, now].
func (w *workload) resolveUnknown(i int, req client.Request) {
	op := w.rec.op(i)
	adm := admissionOf(op, req)
	deadline := w.rec.start.Add(time.Duration(op.Call) + w.cfg.ResolveWithin)
	for time.Now().Before(deadline) {
		d, err := w.rawAcquire(op.ClientID, adm, 2*time.Second)
		if err == nil {
			ret := w.rec.now()
			w.rec.updateOp(i, func(o *Op) {
				o.Return, o.Resolved = ret, true
				o.Outcome, o.Reason, o.Remaining, o.LeaseID = decisionOutcome(d), d.GetReason(), d.GetRemaining(), d.GetLeaseId()
			})
			return
		}
		time.Sleep(300 * time.Millisecond)
	}
}

func decisionOutcome(d *quotadv1.Decision) string {
	switch {
	case d.GetAdmitted():
		return Admitted
	case d.GetReason() == "invalid" || d.GetReason() == "unknown_domain":
		return Failed
	default:
		return Denied
	}
}

// admissionOf rebuilds the exact admission the client sent for op.
func admissionOf(op Op, req client.Request) *quotadv1.Admission {
	a := &quotadv1.Admission{RequestId: op.RequestID, Domain: req.Domain, Cost: req.Cost, Attempt: 1}
	for _, e := range req.Descriptors {
		a.Descriptors = append(a.Descriptors, &quotadv1.Entry{Key: e.Key, Value: e.Value})
	}
	return a
}

func requestOf(op Op) client.Request {
	key := map[string]string{BudgetDomain: "b", RateDomain: "r", LeaseDomain: "pool"}[op.Domain]
	return client.Request{Domain: op.Domain, Descriptors: client.Descriptors(key, op.Bucket), Cost: op.Cost}
}

// rawAcquire sends one admission under a given client ID straight over gRPC, trying every
// node (followers forward to the leader).
func (w *workload) rawAcquire(clientID string, adm *quotadv1.Admission, perNode time.Duration) (*quotadv1.Decision, error) {
	var lastErr error
	for _, addr := range w.addr {
		cc, err := w.c.Conn(addr)
		if err != nil {
			lastErr = err
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), perNode)
		resp, err := quotadv1.NewQuotaClient(cc).Acquire(ctx, &quotadv1.AcquireRequest{ClientId: clientID, Admissions: []*quotadv1.Admission{adm}})
		cancel()
		if err == nil && len(resp.GetDecisions()) == 1 {
			return resp.GetDecisions()[0], nil
		}
		lastErr = err
	}
	return nil, lastErr
}

// replay re-sends an acknowledged op's request ID and records what came back.
func (w *workload) replay(op Op, phase string) {
	at := w.rec.now()
	d, err := w.rawAcquire(op.ClientID, admissionOf(op, requestOf(op)), 2*time.Second)
	rp := Replay{Op: op.Index, At: at, Phase: phase, Outcome: Unknown}
	if err == nil {
		rp.Outcome, rp.Reason, rp.LeaseID, rp.Remaining = decisionOutcome(d), d.GetReason(), d.GetLeaseId(), d.GetRemaining()
	}
	w.rec.add(func(h *History) { h.Replays = append(h.Replays, rp) })
}

// replayer re-sends a random recently acknowledged spend or lease every 200 ms: "retries that
// reuse request IDs", checked against the original decision.
func (w *workload) replayer(ctx context.Context, rng *rand.Rand) {
	for sleepCtx(ctx, 200*time.Millisecond) {
		h := w.rec.snapshot()
		now := w.rec.now()
		var recent []Op
		for i := len(h.Ops) - 1; i >= 0 && len(recent) < 500; i-- {
			op := h.Ops[i]
			if now-op.Return > int64(20*time.Second) {
				break
			}
			if (op.Kind == KindSpend || op.Kind == KindLease) && (op.Outcome == Admitted || op.Outcome == Denied) {
				recent = append(recent, op)
			}
		}
		if len(recent) > 0 {
			w.replay(recent[rng.IntN(len(recent))], "live")
		}
	}
}

func (w *workload) statusSampler(ctx context.Context, cl *client.Client) {
	for sleepCtx(ctx, 250*time.Millisecond) {
		sctx, cancel := context.WithTimeout(ctx, time.Second)
		st, err := cl.Status(sctx, LeaseDomain, client.Entry{Key: "pool", Value: "p0"})
		cancel()
		if err != nil {
			continue
		}
		at := w.rec.now()
		for _, b := range st.Buckets {
			if b.MaxInFlight > 0 {
				s := StatusSample{At: at, Bucket: "p0", InFlight: b.InFlight, MaxInFlight: b.MaxInFlight}
				w.rec.add(func(h *History) { h.Status = append(h.Status, s) })
			}
		}
	}
}

// sleepCtx sleeps d or until ctx ends; it reports whether ctx is still live.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
