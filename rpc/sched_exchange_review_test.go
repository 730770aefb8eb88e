package rpc_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// A bucket slow enough that a scheduled grant is held for long (100 ms per unit; a newcomer is
// released at once if its slot is within the horizon + 100 ms).
const dupSlowLimits = `
domain: slow
rate_limit: {unit: second, requests_per_unit: 10, burst: 1}
`

// A retry of a waiting admission sent without max_wait_ms (the request fingerprint leaves it
// out, so the FSM answers it from its dedup table) while the original's scheduled grant is
// held, and nothing else waits or is released on the leader: the scheduler is not involved
// (fair.handles is false), so the leader's plain path answered it at once — admitted, before
// the original and before the grant's moment. It must be held like any duplicate.
func TestDuplicateWithoutWaitOfHeldGrantIsHeld(t *testing.T) {
	c := rpctest.Start(t, 3, dupSlowLimits)
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	fsm := c.Agent(leader).FSM()
	ctx := context.Background()
	for i := range 3 {
		base := uint64(100 * (i + 1))
		// Take the bucket's unit: a waiting admission is then granted as of the next one.
		if _, err := acquireOne(ctx, q, "taker", &quotadv1.Admission{RequestId: base + 1, Domain: "slow", Cost: 1}); err != nil {
			t.Fatal(err)
		}
		mk := func(wait int64) *quotadv1.Admission {
			return &quotadv1.Admission{RequestId: base + 2, Domain: "slow", Cost: 1, MaxWaitMs: wait}
		}
		type answered struct {
			d   *quotadv1.Decision
			err error
			at  time.Time
		}
		orig := make(chan answered, 1)
		go func() {
			d, err := acquireOne(ctx, q, "retrier", mk(5000))
			orig <- answered{d, err, time.Now()}
		}()
		// The FSM has decided it (a scheduled grant, held on the leader until its moment).
		clustertest.Eventually(t, 5*time.Second, func() error {
			if !fsm.Remembers("insecure", "retrier", base+2) {
				return fmt.Errorf("admission %d not decided yet", base+2)
			}
			return nil
		})
		d, err := acquireOne(ctx, q, "retrier", mk(0))
		retried := time.Now()
		o := <-orig
		if err != nil || o.err != nil {
			t.Fatalf("round %d: retry %v, original %v", i, err, o.err)
		}
		if !o.d.Admitted || !d.Admitted {
			t.Fatalf("round %d: original %+v, retry %+v: want both admitted", i, o.d, d)
		}
		if retried.Before(o.at) {
			t.Errorf("round %d: the retry (max_wait_ms 0) was answered admitted %v before the original's held answer (retry_after_ms %d on an admission)",
				i, o.at.Sub(retried), d.RetryAfterMs)
		}
		if d.RetryAfterMs != 0 {
			t.Errorf("round %d: an admitted retry says retry_after_ms %d: a scheduled grant is held, not handed to the caller to wait out", i, d.RetryAfterMs)
		}
		time.Sleep(150 * time.Millisecond) // the bucket's unit back
	}
}

// Tenants with no limit of their own on a 1000/s ceiling, one heavy tenant (A) queued deep;
// then a limit of A's own (100/s, burst 1) is applied. A's waiters queued before it noted
// their path's rate limits then (none below the ceiling), and an exchange with a small
// newcomer moved their grants up to 25 ms later — against A's new limit, which the FSM
// decided them under: two of A's answers then came closer than its 10 ms interval.
// Before the change the ceiling is 1/s: every waiter of A and B queues (at 1000/s A's
// share served A's 400 as they trickled in under -race, and they never all queued).
const exchangeLateLimits = `
domain: late
rate_limit: {unit: second, requests_per_unit: 1, burst: 1}
descriptors:
  - key: tenant
`

const exchangeLateLimitsA = `
domain: late
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1}
descriptors:
  - key: tenant
    value: A
    rate_limit: {unit: second, requests_per_unit: 100, burst: 1}
  - key: tenant
`

func TestExchangeSkipsWaitersQueuedBeforeALimitChange(t *testing.T) {
	type grant struct {
		tenant          string
		fsm, held, stmp int64
	}
	var tmu sync.Mutex
	var grants []grant
	tracing := false
	rpc.SetFairTrace(func(tr rpc.FairTrace) {
		tmu.Lock()
		if tracing && !tr.Direct {
			grants = append(grants, grant{tr.Adm.Descriptors[0].Value, tr.MomentFSM, tr.HeldFSM, tr.StampFSM})
		}
		tmu.Unlock()
	})
	t.Cleanup(func() { rpc.SetFairTrace(nil) })
	c := rpctest.Start(t, 3, exchangeLateLimits)
	leader := c.Leader()
	conn := dial(t, c.Addrs()[leader])
	q := quotadv1.NewQuotaClient(conn)
	admin := quotadv1.NewAdminClient(conn)
	var id atomic.Uint64
	adm := func(tenant string) *quotadv1.Admission {
		return &quotadv1.Admission{RequestId: id.Add(1), Domain: "late", Cost: 1, MaxWaitMs: 20000,
			Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tenant}}}
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	// B keeps the ceiling contended; A's 400 waiters each ask once (a new admission after
	// the change would note A's limit): at 100/s they last 4 s after it.
	for range 100 {
		wg.Go(func() {
			for ctx.Err() == nil {
				_, _ = acquireOne(ctx, q, "heavyB", adm("B"))
			}
		})
	}
	clustertest.Eventually(t, 10*time.Second, func() error {
		if w := c.Agent(leader).FairView().Waiting; w < 80 {
			return fmt.Errorf("%d waiting", w)
		}
		return nil
	})
	for range 400 {
		wg.Go(func() { _, _ = acquireOne(ctx, q, "heavyA", adm("A")) })
	}
	clustertest.Eventually(t, 20*time.Second, func() error {
		if w := c.Agent(leader).FairView().Waiting; w < 480 {
			return fmt.Errorf("%d waiting", w)
		}
		return nil
	})
	if _, err := admin.ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: exchangeLateLimitsA}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // grants of A decided before the change are answered
	tmu.Lock()
	tracing = true
	tmu.Unlock()
	before := c.Agent(leader).FairView().MomentExchanges
	var small sync.WaitGroup
	stop := time.Now().Add(2 * time.Second)
	for s := range 8 {
		small.Go(func() {
			for time.Now().Before(stop) {
				time.Sleep(time.Duration(rand.Int64N(int64(30 * time.Millisecond))))
				_, _ = acquireOne(ctx, q, fmt.Sprint("small", s), adm(fmt.Sprint("s", s)))
			}
		})
	}
	small.Wait()
	tmu.Lock()
	tracing = false
	got := grants
	tmu.Unlock()
	exchanged := c.Agent(leader).FairView().MomentExchanges - before
	var aFSM, aHeld []int64
	for _, g := range got {
		if g.tenant == "A" {
			aFSM, aHeld = append(aFSM, g.fsm), append(aHeld, g.held)
		}
	}
	slices.Sort(aFSM)
	slices.Sort(aHeld)
	const interval = 10 * time.Millisecond
	for i := 1; i < len(aFSM); i++ {
		if d := time.Duration(aFSM[i] - aFSM[i-1]); d < interval-time.Microsecond {
			t.Fatalf("A's FSM moments %v apart: the test's premise (A's own 100/s limit in force) does not hold", d)
		}
	}
	near := 0
	for i := 1; i < len(aHeld); i++ {
		if d := time.Duration(aHeld[i] - aHeld[i-1]); d < interval-time.Microsecond {
			near++
			if near <= 3 {
				t.Errorf("two of tenant A's answers held to moments %v apart; its own limit is 100/s burst 1 (an exchange moved a grant against it)", d)
			}
		}
	}
	t.Logf("%d grants of A, %d exchanges, %d pairs of A's answers closer than %v", len(aHeld), exchanged, near, interval)
	if len(aHeld) < 50 {
		t.Fatalf("only %d grants of A traced: A's queue did not last", len(aHeld))
	}
}
