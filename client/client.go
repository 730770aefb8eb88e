package client

import (
	"context"
	cryptorand "crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"google.golang.org/grpc"
)

// Client is a connection to a quotad cluster. It is safe for concurrent use by many
// goroutines, and meant to be shared: one per process (per client identity) is right, since
// batching works across all of its callers. The zero value is not usable; call New.
type Client struct {
	cfg     Config
	id      string
	seq     atomic.Uint64
	nodes   *nodes
	batcher *batcher  // nil when batching is disabled
	stream  *streamer // waiting admissions over AcquireStream; nil when disabled

	baseCtx   context.Context // canceled by Close: ends batch RPCs and lease renewals
	cancel    context.CancelFunc
	closing   chan struct{}
	closeOnce sync.Once

	leasesMu sync.Mutex
	leases   map[*Lease]struct{}

	sharesOnce sync.Once
	shares     *shareHolder // Limiters' share holder, started by the first Limiter
	// sharesLive is shares once started, for readers outside sharesOnce (Feedback).
	sharesLive atomic.Pointer[shareHolder]

	tlsProbes tlsProbes // nodes found speaking TLS to this plaintext client (tlsprobe.go)

	metrics struct {
		admissions, batches, held, rpcs, retries                              atomic.Uint64
		streams, streamSends, streamAdmissions, streamFallbacks, streamStalls atomic.Uint64
		leasesLost                                                            atomic.Uint64
	}
}

// New returns a Client for the cluster at cfg.Addrs. It does not wait for a connection:
// the first call connects (and retries until its context ends).
func New(cfg Config) (*Client, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	creds, err := cfg.DialCredentials()
	if err != nil {
		return nil, err
	}
	id := cfg.ClientID
	seq := uint64(time.Now().UnixNano())
	if id == "" {
		// 96 random bits, base64: every admission carries the client ID into the replicated
		// log, so it is kept short. A fresh random namespace has never been used, so its
		// request IDs can start at 1 (short varints) instead of at the wall clock.
		var b [12]byte
		if _, err := cryptorand.Read(b[:]); err != nil {
			return nil, fmt.Errorf("client: generating a client ID: %w", err)
		}
		id, seq = base64.RawURLEncoding.EncodeToString(b[:]), 0
	}
	ctx, cancel := context.WithCancel(context.Background())
	c := &Client{
		cfg:     cfg,
		id:      id,
		nodes:   newNodes(cfg.Addrs, cfg, creds),
		baseCtx: ctx,
		cancel:  cancel,
		closing: make(chan struct{}),
		leases:  make(map[*Lease]struct{}),
	}
	// With a configured ClientID the sequence starts at the wall clock, so a restarted
	// process that reuses it never reuses a request ID the cluster may still remember. 0 is
	// never produced.
	c.seq.Store(seq)
	if !cfg.Batch.Disabled {
		c.batcher = newBatcher(c, cfg.Batch)
	}
	if !cfg.Stream.Disabled {
		c.stream = newStreamer(c)
	}
	return c, nil
}

// ClientID returns the client's idempotency namespace (the configured or generated ID).
func (c *Client) ClientID() string { return c.id }

// nextID returns a request ID that no earlier call of this client used.
func (c *Client) nextID() uint64 { return c.seq.Add(1) }

// Close releases every lease still held (best effort, for at most a second), stops batching
// and closes the connections. Calls in progress fail with ErrClosed or ErrUnavailable.
// Close is idempotent.
func (c *Client) Close() error {
	var err error
	c.closeOnce.Do(func() {
		c.sharesOnce.Do(func() {}) // no holder starts from now on
		if c.shares != nil {
			c.shares.close() // releases the shares while the connections are up
		}
		c.leasesMu.Lock()
		held := make([]*Lease, 0, len(c.leases))
		for l := range c.leases {
			held = append(held, l)
		}
		c.leasesMu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		var wg sync.WaitGroup
		for _, l := range held {
			wg.Go(func() { _ = l.Release(ctx) })
		}
		wg.Wait()
		cancel()

		close(c.closing)
		if c.stream != nil {
			c.stream.close()
		}
		c.cancel()
		if c.batcher != nil {
			close(c.batcher.stop)
			<-c.batcher.stopped
		}
		err = c.nodes.close()
	})
	return err
}

// Stats counts what a Client has done since New. Safe to read at any time.
type Stats struct {
	// Admissions is the number of admissions decided or attempted (Allow, Wait steps,
	// TryAcquire, Acquire steps).
	Admissions uint64
	// Batches is the number of batches formed (0 with batching disabled).
	Batches uint64
	// BatchesHeld counts batches held open for the batch window (Config.Batch.Window)
	// because another batch was in flight. A serial caller sees none.
	BatchesHeld uint64
	// RPCs counts Acquire RPC attempts, retries included.
	RPCs uint64
	// Retries counts failed RPC attempts of any method that were retried.
	Retries uint64
	// Streams counts AcquireStreams opened (waiting admissions, Config.Stream).
	Streams uint64
	// StreamSends counts messages sent on them, and StreamAdmissions the admissions they
	// carried (one sent again, on a stream to the leader after a follower refused one,
	// counts twice): concurrent waiting callers share messages, so under load StreamSends is
	// far below StreamAdmissions.
	StreamSends, StreamAdmissions uint64
	// StreamFallbacks counts waiting admissions decided by unary Acquire (same request ID)
	// after their stream broke or answered with a status a unary call would retry.
	StreamFallbacks uint64
	// StreamStalls counts streams given up because their leader, which sends heartbeats,
	// sent nothing for several of them while admissions were undecided (a stopped or
	// partitioned node); their admissions went to another node.
	StreamStalls uint64
	// LeasesLost counts Leases (TryAcquire, Acquire) that ended without their holder's
	// Release: a renewal found the lease gone on the cluster (expired, released by an admin,
	// dropped by a restore) or could not reach the cluster within its TTL, or Release found it
	// already gone. Each is counted once; Lease.Err says why.
	LeasesLost uint64
}

// Stats returns the client's counters.
func (c *Client) Stats() Stats {
	return Stats{
		Admissions:  c.metrics.admissions.Load(),
		Batches:     c.metrics.batches.Load(),
		BatchesHeld: c.metrics.held.Load(),
		RPCs:        c.metrics.rpcs.Load(),
		Retries:     c.metrics.retries.Load(),

		Streams:          c.metrics.streams.Load(),
		StreamSends:      c.metrics.streamSends.Load(),
		StreamAdmissions: c.metrics.streamAdmissions.Load(),
		StreamFallbacks:  c.metrics.streamFallbacks.Load(),
		StreamStalls:     c.metrics.streamStalls.Load(),

		LeasesLost: c.metrics.leasesLost.Load(),
	}
}

func (c *Client) logger() *slog.Logger { return c.cfg.Logger }

// leaseLost counts and logs a lost lease (once per lease: the callers see to that).
func (c *Client) leaseLost(err error) {
	c.metrics.leasesLost.Add(1)
	c.logger().Warn("quotad: concurrency lease lost; its holder is no longer within the limit", "err", err)
}

// Allow decides req now, without waiting for quota. It returns the Decision and a nil error
// when admitted; a *DeniedError (errors.Is(err, ErrDenied)) and the Decision when the
// cluster said no; an error matching ErrInvalid for a malformed request or unknown domain;
// and one matching ErrUnavailable when no decision arrived before ctx ended.
//
// If the path has a concurrency limit, an admitted Decision holds permits (LeaseID ≠ 0)
// that nobody renews: release them with ReleaseLease or let them expire after LeaseTTL.
// TryAcquire manages that for you.
func (c *Client) Allow(ctx context.Context, req Request) (Decision, error) {
	if err := req.validate(); err != nil {
		return Decision{}, err
	}
	id := c.nextID()
	c.metrics.admissions.Add(1)
	adm := req.admission(id)
	sent := time.Now()
	var (
		pd  *quotadv1.Decision
		at  time.Time
		err error
	)
	switch {
	case adm.MaxWaitMs > 0 && c.stream != nil:
		// Not in a unary batch: it would answer when its slowest admission is decided.
		pd, at, err = c.stream.submit(ctx, adm)
	case c.batcher == nil || adm.MaxWaitMs > 0:
		pd, at, err = c.acquireOne(ctx, adm)
	default:
		pd, at, err = c.batcher.submit(ctx, adm)
	}
	if err != nil {
		return Decision{RequestID: id}, err
	}
	d := decisionFromProto(pd, id, at)
	d.sent = sent
	return d, decisionError(d)
}

// Wait decides req, and while the cluster says no for a reason that passes with time
// (rate_limited, concurrency_limited, paused, retry_budget_exhausted, too_many_keys,
// too_many_waiters) sleeps the decision's
// RetryAfter plus up to 20% jitter (or, when the decision gives none, as for a
// concurrency_limited one, the client's Backoff with jitter) and asks again, each time as a
// new admission. Like
// rate.Limiter.Wait it gives up at once, returning the last denial, when ctx's deadline
// comes before the earliest retry could succeed: a worker can then reschedule its job durably
// at Decision.RetryAt instead of holding a goroutine.
//
// Errors are as for Allow. A denial that ended because ctx ended wraps ctx's error too.
//
// Unless req.MaxWait is set, each admission asks the leader to queue it (MaxWait from ctx's
// deadline, at most MaxServerWait): the leader's fair scheduler then hands it the next unit
// its tenant is entitled to, which is both sooner and fairer than sleeping and asking again.
func (c *Client) Wait(ctx context.Context, req Request) (Decision, error) {
	for denials := 0; ; denials++ {
		r := req
		if r.MaxWait == 0 {
			r.MaxWait = serverWait(ctx)
		}
		d, err := c.Allow(ctx, r)
		if err == nil || !errors.Is(err, ErrDenied) || !transient(d.Reason) {
			return d, err
		}
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < d.RetryAfter && d.Reason != ReasonConcurrencyLimited {
			return d, err
		}
		wait := waitAfterDenial(d, denials, c.cfg.Backoff)
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < wait {
			wait = time.Until(dl)
		}
		if !sleep(ctx, wait) {
			return d, fmt.Errorf("%w: %w", err, ctx.Err())
		}
	}
}

// MaxServerWait caps how long Wait lets the leader queue one admission; after it Wait asks
// again (the leader's queues are soft state, so a bounded wait also bounds what a leader
// change can cost).
const MaxServerWait = 30 * time.Second

// serverWait is the max wait Wait asks the leader for: until shortly before ctx's deadline,
// so the answer arrives in time (0: the deadline is too close to queue at all).
func serverWait(ctx context.Context) time.Duration {
	dl, ok := ctx.Deadline()
	if !ok {
		return MaxServerWait
	}
	left := time.Until(dl)
	w := left - min(max(left/10, 20*time.Millisecond), time.Second)
	if w < time.Millisecond {
		return 0
	}
	return min(w, MaxServerWait)
}

// waitAfterDenial is how long Wait sleeps after its n-th consecutive denial (0-based). With a
// RetryAfter it is that plus up to 20% (so waiters do not all return at once); for a
// concurrency denial (a permit returns when its holder releases it, which nobody can foresee,
// or at the latest when the lease expires: RetryAfter) it is the client's backoff with equal
// jitter, at most RetryAfter, so waiters poll gently instead of spinning.
func waitAfterDenial(d Decision, n int, b BackoffConfig) time.Duration {
	if d.Reason == ReasonConcurrencyLimited {
		ceil := b.delayCeil(n)
		w := ceil/2 + time.Duration(rand.Int64N(int64(ceil/2)+1))
		if d.RetryAfter > 0 {
			w = min(w, d.RetryAfter)
		}
		return w
	}
	if d.RetryAfter > 0 {
		jitter := time.Duration(rand.Int64N(int64(d.RetryAfter/5) + int64(time.Millisecond)))
		if d.RetryAfter > math.MaxInt64-jitter {
			return d.RetryAfter
		}
		return d.RetryAfter + jitter
	}
	ceil := b.delayCeil(n)
	return ceil/2 + time.Duration(rand.Int64N(int64(ceil/2)+1))
}

// transient reports whether a denial for reason can turn into an admission by waiting.
func transient(r Reason) bool {
	switch r {
	case ReasonRateLimited, ReasonConcurrencyLimited, ReasonPaused, ReasonRetryBudgetExhausted, ReasonTooManyKeys, ReasonTooManyWaiters:
		return true
	}
	return false
}

// TryAcquire decides req now like Allow and, when admitted, returns a Lease that holds the
// decision's concurrency permits, renewed in the background until Release. When the path has
// no concurrency limit the Lease holds nothing and Release only ends it. Errors are as for
// Allow.
func (c *Client) TryAcquire(ctx context.Context, req Request) (*Lease, error) {
	d, err := c.Allow(ctx, req)
	if err != nil {
		return nil, err
	}
	return c.newLease(d, req.LeaseTTL), nil
}

// Acquire waits like Wait and, when admitted, returns a Lease as TryAcquire does.
func (c *Client) Acquire(ctx context.Context, req Request) (*Lease, error) {
	d, err := c.Wait(ctx, req)
	if err != nil {
		return nil, err
	}
	return c.newLease(d, req.LeaseTTL), nil
}

// Refund gives back the rate tokens of an admitted request that was never used (cancelled
// after admission). Each bucket d charged takes its units back only while d is still the last
// admission that debited it, and only up to its capacity (see RefundOutcome); the answer says
// whether the cluster found d and refunded it now (Outcome RefundRefunded, Refunded = its
// cost), and how many buckets kept the units. Refunding twice is harmless (the second answer
// is RefundAlreadyRefunded). An admission that took no rate tokens (a concurrency-only
// domain) is answered RefundNothingToRefund. Concurrency permits are not affected; release
// those with the Lease.
//
// A denied d is answered RefundNotAdmitted without a call. An admitted d without a RequestID
// did not come from this package's Allow, Wait or Acquire (they always set it): the answer is
// an ErrInvalid error, without a call.
func (c *Client) Refund(ctx context.Context, d Decision) (RefundResult, error) {
	if !d.Admitted {
		return RefundResult{Outcome: RefundNotAdmitted}, nil
	}
	if d.RequestID == 0 {
		return RefundResult{}, fmt.Errorf("%w: refund: the admitted decision has request ID 0, so no admission can be named; pass the Decision that Allow, Wait or Acquire returned (its RequestID is set)", ErrInvalid)
	}
	req := &quotadv1.RefundRequest{ClientId: c.id, RequestId: d.RequestID}
	var resp *quotadv1.RefundResponse
	err := c.invoke(ctx, "Refund", 0, func(ctx context.Context, qc quotadv1.QuotaClient, opts ...grpc.CallOption) error {
		var err error
		resp, err = qc.Refund(ctx, req, opts...)
		return err
	})
	if err != nil {
		return RefundResult{}, err
	}
	return RefundResult{Outcome: RefundOutcome(resp.GetOutcome()), Refunded: resp.GetRefunded(), BucketsKept: int(resp.GetBucketsKept())}, nil
}

// ReleaseLease returns the permits of a lease taken by Allow or Wait. It reports whether the
// lease was still held (false: it had already expired or been released, which is not an
// error).
func (c *Client) ReleaseLease(ctx context.Context, leaseID uint64) (bool, error) {
	if leaseID == 0 {
		return false, nil
	}
	req := &quotadv1.ReleaseRequest{LeaseId: leaseID}
	var resp *quotadv1.ReleaseResponse
	err := c.invoke(ctx, "Release", 0, func(ctx context.Context, qc quotadv1.QuotaClient, opts ...grpc.CallOption) error {
		var err error
		resp, err = qc.Release(ctx, req, opts...)
		return err
	})
	return resp.GetReleased(), err
}

// Status reads the buckets on a descriptor path linearizably. It never debits.
func (c *Client) Status(ctx context.Context, domain string, descriptors ...Entry) (*Status, error) {
	if domain == "" {
		return nil, fmt.Errorf("%w: Status: domain is empty", ErrInvalid)
	}
	req := &quotadv1.StatusRequest{Domain: domain, Descriptors: entriesToProto(descriptors)}
	var resp *quotadv1.StatusResponse
	err := c.invoke(ctx, "Status", 0, func(ctx context.Context, qc quotadv1.QuotaClient, opts ...grpc.CallOption) error {
		var err error
		resp, err = qc.Status(ctx, req, opts...)
		return err
	})
	if err != nil {
		return nil, err
	}
	s := &Status{AppliedIndex: resp.GetAppliedIndex(), LeaderID: resp.GetLeaderId()}
	for _, b := range resp.GetBuckets() {
		s.Buckets = append(s.Buckets, BucketStatus{
			Scope:       b.GetScope(),
			Key:         b.GetKey(),
			Limit:       b.GetLimit(),
			Burst:       b.GetBurst(),
			Remaining:   b.GetRemaining(),
			ResetAfter:  millis(b.GetResetAfterMs()),
			InFlight:    b.GetInFlight(),
			MaxInFlight: b.GetMaxInFlight(),
			PausedFor:   millis(b.GetPausedForMs()),
			Window:      millis(b.GetWindowMs()),
			LentLimit:   b.GetLentLimit(),
			LentBurst:   b.GetLentBurst(),
			Ceiling:     b.GetCeiling(),
		})
	}
	return s, nil
}

// Feedback reports a provider's 429/503 so the cluster pauses the scope the provider named.
// Reporting the same answer twice (a retry) extends nothing beyond the provider's
// Retry-After.
func (c *Client) Feedback(ctx context.Context, f Feedback) (FeedbackResult, error) {
	if f.Domain == "" {
		return FeedbackResult{}, fmt.Errorf("%w: Feedback.Domain is empty", ErrInvalid)
	}
	if f.StatusCode < 100 || f.StatusCode > 599 {
		return FeedbackResult{}, fmt.Errorf("%w: Feedback.StatusCode %d is not an HTTP status", ErrInvalid, f.StatusCode)
	}
	if f.RetryAfter < 0 {
		return FeedbackResult{}, fmt.Errorf("%w: Feedback.RetryAfter %v is negative", ErrInvalid, f.RetryAfter)
	}
	req := &quotadv1.FeedbackRequest{
		Domain:       f.Domain,
		Descriptors:  entriesToProto(f.Descriptors),
		StatusCode:   uint32(f.StatusCode),
		RetryAfterMs: durationMillisCeil(f.RetryAfter),
		Reason:       f.Reason,
	}
	var resp *quotadv1.FeedbackResponse
	err := c.invoke(ctx, "Feedback", 0, func(ctx context.Context, qc quotadv1.QuotaClient, opts ...grpc.CallOption) error {
		var err error
		resp, err = qc.Feedback(ctx, req, opts...)
		return err
	})
	if err != nil {
		return FeedbackResult{}, err
	}
	if resp.GetPausedForMs() > 0 {
		// This client's Limiters learn of pauses from their share renewals, every term/3
		// (5 s for a 15 s lease, minutes for long ones): renew now, so they stop spending
		// within a round trip rather than through the provider's Retry-After (at most once a
		// second, however many pauses are reported: pokeForFeedback).
		if h := c.sharesLive.Load(); h != nil {
			h.pokeForFeedback()
		}
	}
	return FeedbackResult{PausedFor: millis(resp.GetPausedForMs()), Scope: resp.GetScope(),
		Attributed: resp.GetAttributed(), Decreased: resp.GetDecreased(), Limit: resp.GetLimit()}, nil
}

// Limits reads the limits in force, linearizably: their version and the YAML `quotad limits
// apply` accepts. A worker credential sees only the domains it may use (a regional leader
// follows the global cluster's limits this way); a reader or admin sees them all.
func (c *Client) Limits(ctx context.Context) (version uint64, yaml string, err error) {
	var resp *quotadv1.GetLimitsResponse
	err = c.invokeConn(ctx, "GetLimits", func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) error {
		var err error
		resp, err = quotadv1.NewAdminClient(cc).GetLimits(ctx, &quotadv1.GetLimitsRequest{}, opts...)
		return err
	})
	if err != nil {
		return 0, "", err
	}
	return resp.GetVersion(), resp.GetYaml(), nil
}
