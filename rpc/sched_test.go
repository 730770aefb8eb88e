package rpc_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// 20 tokens/s shared by every tenant; tenants are the per-value level below the ceiling.
const fairLimits = `
domain: fair
rate_limit: {unit: second, requests_per_unit: 20, burst: 2}
descriptors:
  - key: tenant
    descriptors:
      - key: class
`

func waitingAdmission(id uint64, tenant string, maxWait time.Duration) *quotadv1.Admission {
	return &quotadv1.Admission{RequestId: id, Domain: "fair", Cost: 1, MaxWaitMs: maxWait.Milliseconds(),
		Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tenant}}}
}

// The seed scenario on a small scale, through the real API: tenant A keeps many admissions
// waiting; B's single admission is served within about two token intervals, and A still gets
// every other token (work-conserving).
func TestWaitingSmallTenantIsServedBeforeBigBacklog(t *testing.T) {
	c := rpctest.Start(t, 3, fairLimits)
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	var admittedA atomic.Int64
	var wg sync.WaitGroup
	var id atomic.Uint64
	for range 60 {
		wg.Go(func() {
			for ctx.Err() == nil {
				d, err := acquireOne(ctx, q, "a", waitingAdmission(id.Add(1), "A", 20*time.Second))
				if err == nil && d.Admitted {
					admittedA.Add(1)
				}
			}
		})
	}
	defer wg.Wait()
	clustertest.Eventually(t, 10*time.Second, func() error {
		if n := c.Agent(leader).FairView().Waiting; n < 40 {
			return fmt.Errorf("only %d of A's admissions waiting", n)
		}
		return nil
	})
	var waits []time.Duration
	for i := range 8 {
		start := time.Now()
		d, err := acquireOne(ctx, q, "b", waitingAdmission(uint64(1000+i), "B", 5*time.Second))
		if err != nil || !d.Admitted {
			t.Fatalf("B's admission %d: %v %+v", i, err, d)
		}
		waits = append(waits, time.Since(start))
		time.Sleep(130 * time.Millisecond) // B arrives at unrelated moments
	}
	sort.Slice(waits, func(i, j int) bool { return waits[i] < waits[j] })
	// One token interval is 50 ms; allow two plus commit latency on a loaded 2-core machine.
	if worst := waits[len(waits)-1]; worst > 250*time.Millisecond {
		t.Fatalf("B waited up to %v behind A's backlog (waits %v)", worst, waits)
	}
	v := c.Agent(leader).FairView()
	if len(v.Buckets) == 0 || v.Buckets[0].Scope != "domain" {
		t.Fatalf("fair view: %+v", v)
	}
	cancel()
	if admittedA.Load() == 0 {
		t.Fatal("A got nothing")
	}
}

// A non-waiting admission yields to waiters on the same bucket; a waiter whose wait cannot be
// met is refused at once with a retry_after; leadership loss fails waiters UNAVAILABLE.
func TestNonWaitingYieldsAndLeaderLossFailsWaiters(t *testing.T) {
	c := rpctest.Start(t, 3, fairLimits)
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	ctx := context.Background()
	errs := make(chan error, 100)
	for i := range 100 {
		go func() {
			_, err := acquireOne(ctx, q, "a", waitingAdmission(uint64(i+1), "A", 30*time.Second))
			errs <- err
		}()
	}
	clustertest.Eventually(t, 10*time.Second, func() error {
		if n := c.Agent(leader).FairView().Waiting; n < 50 {
			return fmt.Errorf("%d waiting", n)
		}
		return nil
	})
	d, err := acquireOne(ctx, q, "n", &quotadv1.Admission{RequestId: 1, Domain: "fair", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "N"}}})
	if err != nil || d.Admitted || d.Reason != "rate_limited" || d.Scope != "domain" || d.RetryAfterMs <= 0 {
		t.Fatalf("non-waiting admission beside waiters: %v %+v, want rate_limited by domain with retry_after", err, d)
	}
	// Transferring leadership fails every waiter with UNAVAILABLE (they retry elsewhere).
	if err := c.Agent(leader).Node().TransferLeadership(""); err != nil {
		t.Fatal(err)
	}
	unavailable := 0
	for range 100 {
		if err := <-errs; status.Code(err) == codes.Unavailable {
			unavailable++
		}
	}
	if unavailable == 0 {
		t.Fatal("no waiter failed UNAVAILABLE when leadership moved")
	}
	if n := c.Agent(leader).FairView().Waiting; n != 0 {
		t.Fatalf("old leader still holds %d waiters", n)
	}
}

// Weighted shares through the API: weights 1 and 3 split a backlogged bucket 25/75.
func TestWaitingTenantsShareByWeight(t *testing.T) {
	c := rpctest.Start(t, 3, `
domain: fair
rate_limit: {unit: second, requests_per_unit: 40, burst: 2}
descriptors:
  - key: tenant
    value: small
    weight: 1
  - key: tenant
    value: big
    weight: 3
`)
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var id atomic.Uint64
	var got [2]atomic.Int64
	for k, tenant := range []string{"small", "big"} {
		for range 30 {
			wg.Go(func() {
				for ctx.Err() == nil {
					d, err := acquireOne(ctx, q, tenant, waitingAdmission(id.Add(1), tenant, 20*time.Second))
					if err == nil && d.Admitted {
						got[k].Add(1)
					}
				}
			})
		}
	}
	clustertest.Eventually(t, 10*time.Second, func() error {
		if n := c.Agent(leader).FairView().Waiting; n < 40 {
			return fmt.Errorf("%d waiting", n)
		}
		return nil
	})
	got[0].Store(0)
	got[1].Store(0)
	time.Sleep(4 * time.Second) // measure a fixed interval of a rate, not a settle-wait
	s, b := got[0].Load(), got[1].Load()
	cancel()
	wg.Wait()
	share := float64(s) / float64(s+b)
	if share < 0.20 || share > 0.30 {
		t.Fatalf("weight-1 tenant got %d vs %d (share %.2f), want 0.25", s, b, share)
	}
}

// A retry of an admission the FSM already decided gets that decision back even while waiters
// queue on its bucket: the scheduler must not answer retries with a fresh opinion.
func TestRetryOfDecidedAdmissionBypassesTheScheduler(t *testing.T) {
	c := rpctest.Start(t, 3, fairLimits)
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	ctx := context.Background()
	first := &quotadv1.Admission{RequestId: 1, Domain: "fair", Cost: 1, Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "N"}}}
	d, err := acquireOne(ctx, q, "n", first)
	if err != nil || !d.Admitted {
		t.Fatalf("first admission: %+v %v", d, err)
	}
	waitCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	for i := range 60 {
		go acquireOne(waitCtx, q, "a", waitingAdmission(uint64(i+1), "A", 20*time.Second))
	}
	clustertest.Eventually(t, 10*time.Second, func() error {
		if n := c.Agent(leader).FairView().Waiting; n < 20 {
			return fmt.Errorf("%d waiting", n)
		}
		return nil
	})
	// A fresh non-waiting admission is turned away while others wait ...
	fresh, err := acquireOne(ctx, q, "n", &quotadv1.Admission{RequestId: 2, Domain: "fair", Cost: 1, Descriptors: first.Descriptors})
	if err != nil || fresh.Admitted {
		t.Fatalf("fresh admission beside waiters: %+v %v, want denied", fresh, err)
	}
	// ... but the retry of request 1 gets its original admission.
	again, err := acquireOne(ctx, q, "n", first)
	if err != nil || !again.Admitted || again.Remaining != d.Remaining {
		t.Fatalf("retry of a decided admission: %+v %v, want the original %+v", again, err, d)
	}
}

// The fair-share metrics label an admission with its work class only if the domain configures
// it: a client's arbitrary class strings must not each create time series.
func TestFairMetricsLabelOnlyConfiguredClasses(t *testing.T) {
	c := rpctest.Start(t, 3, fairLimits+"work_classes:\n  - {name: interactive, reserve_percent: 20}\n")
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	ctx := context.Background()
	for i, class := range []string{"interactive", "junk-1", "junk-2", "interactive", "junk-3"} {
		adm := waitingAdmission(uint64(i+1), "T", 5*time.Second)
		adm.WorkClass = class
		if d, err := acquireOne(ctx, q, "m", adm); err != nil || !d.Admitted {
			t.Fatalf("admission %d (%s): %v %+v", i, class, err, d)
		}
	}
	resp, err := http.Get("http://" + c.Agent(leader).HTTPAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	var series []string
	for _, line := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(line, "quotad_fair_admitted_cost_total{") {
			series = append(series, line)
		}
	}
	if len(series) == 0 {
		t.Fatal("no quotad_fair_admitted_cost_total series: the admissions were not scheduled")
	}
	for _, s := range series {
		if strings.Contains(s, "junk") {
			t.Fatalf("an unconfigured class became a label value: %s", s)
		}
	}
	if !strings.Contains(strings.Join(series, "\n"), `class="interactive"`) {
		t.Fatalf("the configured class is not labelled:\n%s", strings.Join(series, "\n"))
	}
}

// At a rate far above one grant per commit the waiting path stays busy (scheduled grants:
// a batch of grants per log entry at the bucket's pace), and no answer is early: the k-th
// grant of a burst-1 bucket of 1000/s takes effect k−1 ms after the first, and its waiter is
// told no sooner.
//
// Busy is measured on the bucket's own clock, from what the scheduler granted: the grants'
// moments (leader FSM time). Wall-clock throughput at the clients swung from 0.03 to 0.94
// under -race on a loaded machine — it counts the clients' and the cluster's slowness too
// (a round trip longer than the backlog covers leaves nobody waiting, and the bucket's
// units accrue unused through no fault of the scheduler).
func TestWaitingPathKeepsAFastBucketBusyAndHoldsGrants(t *testing.T) {
	var tmu sync.Mutex
	var traces []rpc.FairTrace
	tracing := false
	rpc.SetFairTrace(func(tr rpc.FairTrace) {
		tmu.Lock()
		if tracing && !tr.Direct {
			traces = append(traces, tr)
		}
		tmu.Unlock()
	})
	t.Cleanup(func() { rpc.SetFairTrace(nil) }) // runs after the cluster's cleanup
	c := rpctest.Start(t, 3, `
domain: fast
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1}
descriptors:
  - key: tenant
`)
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	adm := func(id uint64, tenant string) *quotadv1.Admission {
		return &quotadv1.Admission{RequestId: id, Domain: "fast", MaxWaitMs: 20000,
			Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tenant}}}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// 200 admissions at once: answers spread at the bucket's pace, none before its moment.
	const n = 200
	start := time.Now()
	got := make(chan time.Time, n)
	for i := range n {
		go func() {
			d, err := acquireOne(ctx, q, "burst", adm(uint64(i+1), []string{"A", "B"}[i%2]))
			if err != nil || !d.Admitted {
				t.Errorf("admission %d: %v %+v", i, err, d)
			}
			got <- time.Now()
		}()
	}
	var at []time.Duration
	for range n {
		at = append(at, (<-got).Sub(start))
	}
	sort.Slice(at, func(i, j int) bool { return at[i] < at[j] })
	for k, a := range at {
		if early := time.Duration(k-1) * time.Millisecond; a < early {
			t.Fatalf("answer %d arrived %v after the start, before its grant could take effect (%v)", k, a, early)
		}
	}

	// Two tenants keep 100 waiters each: the bucket is used, not thrown away.
	var admitted atomic.Int64
	var wg sync.WaitGroup
	var id atomic.Uint64
	id.Store(n)
	for k, tenant := range []string{"A", "B"} {
		for range 100 {
			wg.Go(func() {
				for ctx.Err() == nil {
					if d, err := acquireOne(ctx, q, fmt.Sprint("c", k), adm(id.Add(1), tenant)); err == nil && d.Admitted {
						admitted.Add(1)
					}
				}
			})
		}
	}
	clustertest.Eventually(t, 10*time.Second, func() error {
		if w := c.Agent(leader).FairView().Waiting; w < 100 {
			return fmt.Errorf("%d waiting", w)
		}
		return nil
	})
	tmu.Lock()
	tracing = true
	tmu.Unlock()
	a0, t0 := admitted.Load(), time.Now()
	time.Sleep(2 * time.Second) // measure a fixed interval of a rate, not a settle-wait
	wall := float64(admitted.Load()-a0) / (1000 * time.Since(t0).Seconds())
	tmu.Lock()
	tracing = false
	ms := make([]int64, 0, len(traces))
	for _, tr := range traces {
		ms = append(ms, tr.MomentFSM)
	}
	tmu.Unlock()
	cancel()
	wg.Wait()
	slices.Sort(ms)
	if len(ms) < 100 {
		t.Fatalf("only %d grants through the waiting path in 2 s of a 1000/s bucket with 200 waiters", len(ms))
	}
	// Back to back: a grant taking effect exactly one token interval after the one before
	// was stamped while the bucket still owed earlier grants — released ahead, as it must be
	// for none of the bucket's units to be lost. One grant per commit managed 0.26 of the
	// rate, with hardly any grant back to back.
	b2b := 0
	for i := 1; i < len(ms); i++ {
		if d := time.Duration(ms[i] - ms[i-1]); d >= time.Millisecond-time.Microsecond && d <= time.Millisecond+time.Microsecond {
			b2b++
		}
	}
	span := time.Duration(ms[len(ms)-1] - ms[0])
	busy := float64(len(ms)-1) * float64(time.Millisecond) / float64(span)
	frac := float64(b2b) / float64(len(ms)-1)
	t.Logf("%d grants: %.3f back to back, %.3f of the bucket's time between the first and the last moment; clients' wall-clock rate %.3f of 1000/s", len(ms), frac, busy, wall)
	if frac < 0.9 {
		t.Fatalf("%.3f of %d grants took effect one token interval after the one before (want ≥ 0.9): grants are not released ahead of the bucket", frac, len(ms))
	}
}
