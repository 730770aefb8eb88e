package rpc_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/rpc/rpctest"
)

// Tenant R has a rate and a concurrency limit (the scheduler's denial on it reads its permit
// bookkeeping); tenant A's waiting admissions go straight to the FSM, reserving and releasing
// permits (writing that bookkeeping) all the time.
const denialRaceLimits = `
domain: race
rate_limit: {unit: second, requests_per_unit: 100000, burst: 100000}
descriptors:
  - key: tenant
    value: A
    concurrency: {max_in_flight: 1000000, lease_ttl: 1s}
  - key: tenant
    value: R
    rate_limit: {unit: minute, requests_per_unit: 1, burst: 1}
    concurrency: {max_in_flight: 100, lease_ttl: 30s}
`

// A waiting admission that cannot be admitted within its max wait is refused at once (the
// scheduler's denial) — after the scheduler's lock is let go. Deciding what holds the bucket
// (concurrency_limited or rate_limited) reads the released-permit counts, which other
// admissions write under that lock: the read must happen under it too (under -race this
// reported a data race; without -race, a concurrent map read and write can crash the leader).
func TestSchedEarlyDenialReadsUnderLock(t *testing.T) {
	c := rpctest.Start(t, 3, denialRaceLimits)
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	adm := func(id uint64, tenant string, maxWait time.Duration) *quotadv1.Admission {
		return &quotadv1.Admission{RequestId: id, Domain: "race", Cost: 1, MaxWaitMs: maxWait.Milliseconds(),
			Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tenant}}}
	}
	// R's one unit spent: its waiting admissions with a short wait are refused at once.
	if d, err := acquireOne(ctx, q, "r0", adm(1, "R", 0)); err != nil || !d.Admitted {
		t.Fatalf("R's first admission: %+v %v", d, err)
	}

	var wg sync.WaitGroup
	var ids atomic.Uint64
	ids.Store(1000)
	stop := time.Now().Add(2 * time.Second)
	var denials atomic.Int64
	for range 4 { // A: waiting admissions that go straight to the FSM (reserve, unreserve)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				_, _ = acquireOne(ctx, q, "a", adm(ids.Add(1), "A", time.Second))
			}
		}()
	}
	for range 4 { // R: refused at once, the denial computed beside A's bookkeeping
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				d, err := acquireOne(ctx, q, "r", adm(ids.Add(1), "R", 10*time.Millisecond))
				if err != nil {
					t.Error(err)
					return
				}
				if d.Admitted || d.Reason != "rate_limited" || d.Scope != "tenant" {
					t.Errorf("R beyond its rate: %+v, want rate_limited at tenant", d)
					return
				}
				denials.Add(1)
			}
		}()
	}
	wg.Wait()
	if denials.Load() == 0 {
		t.Fatal("no early denial of R was seen")
	}
}

// TestSchedDenialNamesTheLevelThatHoldsIt: a waiting admission queued behind another path's
// waiters on an outer level (the domain) whose own tenant level cannot pay for a minute is
// refused at the end of its wait naming its tenant level — the level its retry_after comes
// from — not the domain's queue it sat in (make test, under load: "rate_limited scope domain
// remaining 99999 retry_after 59000").
func TestSchedDenialNamesTheLevelThatHoldsIt(t *testing.T) {
	c := rpctest.Start(t, 1, `
domain: held
rate_limit: {unit: second, requests_per_unit: 2, burst: 1}
descriptors:
  - key: tenant
    value: R
    rate_limit: {unit: minute, requests_per_unit: 1, burst: 1}
  - key: tenant
    concurrency: {max_in_flight: 1000, lease_ttl: 1s}
`)
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[0]))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	adm := func(id uint64, tenant string, maxWait time.Duration) *quotadv1.Admission {
		return &quotadv1.Admission{RequestId: id, Domain: "held", Cost: 1, MaxWaitMs: maxWait.Milliseconds(),
			Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tenant}}}
	}
	if d, err := acquireOne(ctx, q, "r0", adm(1, "R", 0)); err != nil || !d.Admitted {
		t.Fatalf("R's first admission: %+v %v", d, err)
	}
	// A's waiters queue on the domain (2/s, its unit spent by R).
	var wg sync.WaitGroup
	for i := range 6 {
		wg.Go(func() { _, _ = acquireOne(ctx, q, "a", adm(uint64(100+i), "A", 3*time.Second)) })
	}
	defer wg.Wait()
	time.Sleep(100 * time.Millisecond)
	d, err := acquireOne(ctx, q, "r", adm(2, "R", 20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if d.Admitted || d.Reason != "rate_limited" || d.Scope != "tenant" || d.RetryAfterMs < 50_000 {
		t.Fatalf("R queued behind A's waiters on the domain: %+v, want rate_limited at tenant, retry_after about a minute", d)
	}
}
