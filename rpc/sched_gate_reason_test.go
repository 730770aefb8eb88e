package rpc_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/cluster/clustertest"
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
