package rpc_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// Tenant C is held by its permits, tenant P by a provider's pause.
const gateReasonLimits = `
domain: gate
rate_limit: {unit: second, requests_per_unit: 1000, burst: 100}
descriptors:
  - key: tenant
    value: C
    concurrency: {max_in_flight: 1, lease_ttl: 30s}
  - key: tenant
    value: P
    rate_limit: {unit: second, requests_per_unit: 100, burst: 10}
`

// A non-waiting admission refused because waiters are entitled to the bucket says what holds
// the bucket, as the FSM would without the waiters: concurrency_limited when the permits are
// all held, paused (retry_after = the pause left) under a pause — not rate_limited with a
// 50 ms retry (review of s8).
func TestGateDenialSaysWhatHoldsTheBucket(t *testing.T) {
	c := rpctest.Start(t, 3, gateReasonLimits)
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	adm := func(id uint64, tenant string, maxWait time.Duration) *quotadv1.Admission {
		return &quotadv1.Admission{RequestId: id, Domain: "gate", Cost: 1, MaxWaitMs: maxWait.Milliseconds(),
			Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tenant}}}
	}
	queue := func(tenant string, from uint64, n int) {
		t.Helper()
		before := c.Agent(leader).FairView().Waiting
		for i := range n {
			go func() { _, _ = acquireOne(ctx, q, "w", adm(from+uint64(i), tenant, 30*time.Second)) }()
		}
		clustertest.Eventually(t, 10*time.Second, func() error {
			if got := c.Agent(leader).FairView().Waiting - before; got < n {
				return fmt.Errorf("%d of tenant %s's admissions waiting, want %d", got, tenant, n)
			}
			return nil
		})
	}
	fromGate := func(d *quotadv1.Decision) bool { return strings.Contains(d.Message, "waiting on this bucket") }

	// C: its one permit held by a lease; waiters queue for it.
	if d, err := acquireOne(ctx, q, "h", adm(1, "C", 0)); err != nil || !d.Admitted || d.LeaseId == 0 {
		t.Fatalf("lease for C: %+v %v", d, err)
	}
	queue("C", 100, 3)
	d, err := acquireOne(ctx, q, "n", adm(2, "C", 0))
	if err != nil || d.Admitted || !fromGate(d) || d.Reason != "concurrency_limited" || d.Scope != "tenant" ||
		d.Limit != 1 || d.RetryAfterMs <= 0 {
		t.Fatalf("non-waiting admission beside C's waiters: %+v %v, want the gate's concurrency_limited at tenant, limit 1, with a retry_after", d, err)
	}

	// P: paused for 20 s by a provider's 429; waiters queue past the pause.
	if r, err := q.Feedback(ctx, &quotadv1.FeedbackRequest{Domain: "gate", StatusCode: 429, RetryAfterMs: 20_000,
		Reason: "tenant-limited", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "P"}}}); err != nil || r.PausedForMs != 20_000 {
		t.Fatalf("pause P: %+v %v", r, err)
	}
	queue("P", 200, 3)
	d, err = acquireOne(ctx, q, "n", adm(3, "P", 0))
	if err != nil || d.Admitted || !fromGate(d) || d.Reason != "paused" || d.Scope != "tenant" ||
		d.RetryAfterMs < 10_000 || d.RetryAfterMs > 21_000 {
		t.Fatalf("non-waiting admission beside P's waiters: %+v %v, want the gate's paused at tenant, retry_after about 20 s", d, err)
	}
}

// A non-waiting admission refused while a waiter's permit is released but not yet applied
// says concurrency_limited with no permit remaining: the FSM has one free, the waiter owns
// it. (It said remaining 1: max_in_flight less the FSM's in-flight count alone.)
func TestGateConcurrencyDenialCountsReleasedPermits(t *testing.T) {
	// Proposals pass until armed; once armed the first passes (the holder's release) and the
	// next (the waiter's admission) waits until unblock is closed.
	var armed, calls atomic.Int32
	unblock := make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(unblock) }) }
	defer free()
	rpc.SetStampedHook(func() {
		if armed.Load() != 0 && calls.Add(1) == 2 {
			<-unblock
		}
	})
	defer rpc.SetStampedHook(nil)

	c := rpctest.Start(t, 3, gateReasonLimits)
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	adm := func(id uint64, maxWait time.Duration) *quotadv1.Admission {
		return &quotadv1.Admission{RequestId: id, Domain: "gate", Cost: 1, MaxWaitMs: maxWait.Milliseconds(),
			Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "C"}}}
	}
	held, err := acquireOne(ctx, q, "h", adm(1, 0))
	if err != nil || !held.Admitted || held.LeaseId == 0 {
		t.Fatalf("lease for C: %+v %v", held, err)
	}
	waited := make(chan *quotadv1.Decision, 1)
	go func() {
		d, _ := acquireOne(ctx, q, "w", adm(100, 30*time.Second))
		waited <- d
	}()
	clustertest.Eventually(t, 10*time.Second, func() error {
		if got := c.Agent(leader).FairView().Waiting; got != 1 {
			return fmt.Errorf("%d waiting, want 1", got)
		}
		return nil
	})
	armed.Store(1)
	if r, err := q.Release(ctx, &quotadv1.ReleaseRequest{LeaseId: held.LeaseId}); err != nil || !r.Released {
		t.Fatalf("release: %+v %v", r, err)
	}
	clustertest.Eventually(t, 10*time.Second, func() error {
		if n := calls.Load(); n < 2 {
			return fmt.Errorf("%d proposals since armed, want the waiter's (2)", n)
		}
		return nil
	})
	d, err := acquireOne(ctx, q, "n", adm(2, 0))
	free()
	if err != nil || d.Admitted || d.Reason != "concurrency_limited" || d.Limit != 1 || d.Remaining != 0 {
		t.Fatalf("non-waiting admission beside C's released waiter: %+v %v, want concurrency_limited, limit 1, remaining 0", d, err)
	}
	if w := <-waited; w == nil || !w.Admitted {
		t.Fatalf("the waiter: %+v, want admitted", w)
	}
}

// The gate's paused denial gives the pause left now, not as of the FSM's clock: the status it
// reads is as of the last applied entry, which on an idle log is up to a TickInterval old (here
// a minute: nothing is applied after the pause). It said the whole pause again, 3 s after 1.5 s.
func TestGatePausedRetryIsThePauseLeftNow(t *testing.T) {
	c := rpctest.Start(t, 3, gateReasonLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.Cluster.TickInterval = time.Minute })
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	adm := func(id uint64, maxWait time.Duration) *quotadv1.Admission {
		return &quotadv1.Admission{RequestId: id, Domain: "gate", Cost: 1, MaxWaitMs: maxWait.Milliseconds(),
			Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "P"}}}
	}
	const pause = 3 * time.Second
	sent := time.Now()
	if r, err := q.Feedback(ctx, &quotadv1.FeedbackRequest{Domain: "gate", StatusCode: 429, RetryAfterMs: pause.Milliseconds(),
		Reason: "tenant-limited", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "P"}}}); err != nil || r.PausedForMs != pause.Milliseconds() {
		t.Fatalf("pause P: %+v %v", r, err)
	}
	go func() { _, _ = acquireOne(ctx, q, "w", adm(100, 30*time.Second)) }()
	clustertest.Eventually(t, 10*time.Second, func() error {
		if got := c.Agent(leader).FairView().Waiting; got != 1 {
			return fmt.Errorf("%d waiting, want 1", got)
		}
		return nil
	})
	time.Sleep(time.Until(sent.Add(pause / 2)))
	asked := time.Now()
	d, err := acquireOne(ctx, q, "n", adm(2, 0))
	// The pause ends at most pause after sent (the entry is stamped after it was sent).
	left := sent.Add(pause).Sub(asked)
	if err != nil || d.Admitted || d.Reason != "paused" || time.Duration(d.RetryAfterMs)*time.Millisecond > left+100*time.Millisecond {
		t.Fatalf("non-waiting admission beside P's waiter %v into a %v pause: %+v %v, want paused, retry_after at most %v",
			asked.Sub(sent).Round(time.Millisecond), pause, d, err, left.Round(time.Millisecond))
	}
}

// The domain's ceiling is contended (D's waiters queue on it); tenant C's one permit is held.
const gateOrderLimits = `
domain: order
rate_limit: {unit: minute, requests_per_unit: 10, burst: 1}
descriptors:
  - key: tenant
    value: C
    concurrency: {max_in_flight: 1, lease_ttl: 30s}
  - key: tenant
    value: D
    rate_limit: {unit: second, requests_per_unit: 1000}
`

// The gate's denial follows the FSM's order of checks: permits on every level of the path
// before any rate. A non-waiting admission of tenant C, whose permit is held, crossing the
// domain ceiling that D's waiters queue on is concurrency_limited at tenant — what the FSM
// says without the waiters — not rate_limited at the domain (heldBy checked permits on the
// queue's level only).
func TestGateDenialChecksPermitsOnEveryLevelFirst(t *testing.T) {
	c := rpctest.Start(t, 3, gateOrderLimits)
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	adm := func(id uint64, tenant string, maxWait time.Duration) *quotadv1.Admission {
		return &quotadv1.Admission{RequestId: id, Domain: "order", Cost: 1, MaxWaitMs: maxWait.Milliseconds(),
			Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tenant}}}
	}
	// C takes the domain's one token and its one permit.
	if d, err := acquireOne(ctx, q, "h", adm(1, "C", 0)); err != nil || !d.Admitted || d.LeaseId == 0 {
		t.Fatalf("lease for C: %+v %v", d, err)
	}
	for i := range 3 {
		go func() { _, _ = acquireOne(ctx, q, "w", adm(100+uint64(i), "D", 30*time.Second)) }()
	}
	clustertest.Eventually(t, 10*time.Second, func() error {
		if got := c.Agent(leader).FairView().Waiting; got < 3 {
			return fmt.Errorf("%d of D's admissions waiting, want 3", got)
		}
		return nil
	})
	d, err := acquireOne(ctx, q, "n", adm(2, "C", 0))
	if err != nil || d.Admitted || d.Reason != "concurrency_limited" || d.Scope != "tenant" || d.Limit != 1 {
		t.Fatalf("non-waiting admission of C beside D's waiters on the domain: %+v %v, want concurrency_limited at tenant, limit 1 (the FSM checks permits first)", d, err)
	}
}
