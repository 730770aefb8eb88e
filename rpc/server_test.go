package rpc_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

const testLimits = `
domain: provider
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
descriptors:
  - key: endpoint
    value: charges
    rate_limit: {unit: minute, requests_per_unit: 60, burst: 10}
  - key: endpoint
    value: search
    rate_limit: {unit: second, requests_per_unit: 50, burst: 20}
  - key: tenant
    concurrency: {max_in_flight: 2, lease_ttl: 30s}
`

func dial(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func admission(id uint64, cost uint64, descs ...string) *quotadv1.Admission {
	a := &quotadv1.Admission{RequestId: id, Domain: "provider", Cost: cost}
	for _, d := range descs {
		k, v, _ := strings.Cut(d, "=")
		a.Descriptors = append(a.Descriptors, &quotadv1.Entry{Key: k, Value: v})
	}
	return a
}

func acquireOne(ctx context.Context, c quotadv1.QuotaClient, client string, a *quotadv1.Admission) (*quotadv1.Decision, error) {
	resp, err := c.Acquire(ctx, &quotadv1.AcquireRequest{ClientId: client, Admissions: []*quotadv1.Admission{a}})
	if err != nil {
		return nil, err
	}
	return resp.Decisions[0], nil
}

func TestAcquireUntilRateLimitedOnAnyNode(t *testing.T) {
	c := rpctest.Start(t, 3, testLimits)
	leader := c.Leader()
	follower := (leader + 1) % 3
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[follower]))
	ctx := context.Background()
	// One call with 11 admissions: they share one log entry and so one instant, with no refill
	// between them, which makes the 11th's retry_after exact.
	req := &quotadv1.AcquireRequest{ClientId: "t"}
	for i := uint64(1); i <= 11; i++ {
		req.Admissions = append(req.Admissions, admission(i, 1, "endpoint=charges"))
	}
	var hdr metadata.MD
	resp, err := q.Acquire(ctx, req, grpc.Header(&hdr))
	if err != nil {
		t.Fatal(err)
	}
	if got := hdr.Get(rpc.LeaderHeader); len(got) != 1 || got[0] != c.Addrs()[leader] {
		t.Fatalf("follower's leader header = %v, want %s", got, c.Addrs()[leader])
	}
	for i, d := range resp.Decisions[:10] {
		if !d.Admitted || d.Remaining != uint64(9-i) {
			t.Fatalf("acquire %d of a burst of 10: %+v, want admitted with %d remaining", i+1, d, 9-i)
		}
	}
	d := resp.Decisions[10]
	if d.Admitted || d.Reason != "rate_limited" || d.Scope != "endpoint" || d.Limit != 60 || d.Remaining != 0 {
		t.Fatalf("11th acquire: %+v, want rate_limited by endpoint with limit 60", d)
	}
	// 60/minute refills one unit per second and the bucket is exactly empty.
	if d.RetryAfterMs < 900 || d.RetryAfterMs > 1100 {
		t.Fatalf("retry_after_ms = %d, want 1000 ± 10%%", d.RetryAfterMs)
	}
	// A later single call through the follower is denied too (no refill of a whole unit yet
	// unless a second passed), and again names the endpoint.
	d2, err := acquireOne(ctx, q, "t", admission(12, 1, "endpoint=charges"))
	if err != nil {
		t.Fatal(err)
	}
	if !d2.Admitted && (d2.Scope != "endpoint" || d2.RetryAfterMs > 1000) {
		t.Fatalf("12th acquire: %+v", d2)
	}
}

func TestInvalidRequestsAreRefusedWithoutChangingState(t *testing.T) {
	c := rpctest.Start(t, 3, testLimits)
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[0]))
	a := quotadv1.NewAdminClient(dial(t, c.Addrs()[1]))
	ctx := context.Background()
	leader := c.Agent(c.Leader())
	before := leader.FSM().Stats().Buckets

	_, err := q.Acquire(ctx, &quotadv1.AcquireRequest{Admissions: []*quotadv1.Admission{admission(1, 1)}})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "client_id") {
		t.Fatalf("missing client_id: %v", err)
	}
	for _, tc := range []struct {
		adm  *quotadv1.Admission
		want string
	}{
		{admission(0, 1, "endpoint=charges"), "request_id"},
		{&quotadv1.Admission{RequestId: 1}, "domain"},
		{admission(2, 1, "=x"), "empty key"},
		{admission(3, 11, "endpoint=charges"), "11"}, // above the burst: can never succeed
		{&quotadv1.Admission{RequestId: 4, Domain: "provider", LeaseTtlMs: -5}, "lease_ttl_ms"},
	} {
		d, err := acquireOne(ctx, q, "t", tc.adm)
		if err != nil {
			t.Fatal(err)
		}
		if d.Admitted || d.Reason != "invalid" || !strings.Contains(d.Message, tc.want) {
			t.Errorf("%v: got %+v, want reason invalid mentioning %q", tc.adm, d, tc.want)
		}
	}
	d, err := acquireOne(ctx, q, "t", &quotadv1.Admission{RequestId: 9, Domain: "nope"})
	if err != nil || d.Reason != "unknown_domain" {
		t.Fatalf("unknown domain: %+v %v", d, err)
	}
	_, err = a.ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{FileName: "bad.yaml", Yaml: "domain: x\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 5}\n"})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "bad.yaml:4") || !strings.Contains(err.Error(), "fortnight") {
		t.Fatalf("bad limits: %v", err)
	}
	// Nothing was debited and the limits did not change.
	if v := leader.FSM().Limits().Version; v != 1 {
		t.Fatalf("limits version %d after a refused apply, want 1", v)
	}
	if got := leader.FSM().Stats().Buckets; got != before {
		t.Fatalf("refused requests changed %d buckets into %d", before, got)
	}
}

func TestApplyLimitsTakesEffectOnNextAcquire(t *testing.T) {
	c := rpctest.Start(t, 3, testLimits)
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[0]))
	a := quotadv1.NewAdminClient(dial(t, c.Addrs()[2]))
	ctx := context.Background()
	// Spend 10 of search's 20.
	for i := uint64(1); i <= 10; i++ {
		if d, err := acquireOne(ctx, q, "t", admission(i, 1, "endpoint=search")); err != nil || !d.Admitted {
			t.Fatalf("%v %v", d, err)
		}
	}
	tighter := strings.Replace(testLimits, "requests_per_unit: 50, burst: 20", "requests_per_unit: 1, burst: 3", 1)
	resp, err := a.ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: tighter})
	if err != nil || resp.Version != 2 {
		t.Fatalf("apply: %v %v", resp, err)
	}
	// Balance carried over and clamped to the new burst 3: three admitted, then denied.
	for i := uint64(11); i <= 13; i++ {
		d, err := acquireOne(ctx, q, "t", admission(i, 1, "endpoint=search"))
		if err != nil || !d.Admitted || d.Limit != 1 {
			t.Fatalf("after apply, acquire %d: %+v %v", i, d, err)
		}
	}
	if d, _ := acquireOne(ctx, q, "t", admission(14, 1, "endpoint=search")); d.Admitted {
		t.Fatalf("4th acquire under burst 3 admitted: %+v", d)
	}
	got, err := a.GetLimits(ctx, &quotadv1.GetLimitsRequest{})
	if err != nil || got.Version != 2 || !strings.Contains(got.Yaml, "requests_per_unit: 1") {
		t.Fatalf("get limits: %v %v", got, err)
	}
}

func TestLeaderKillKeepsBalancesAndFailsOverQuickly(t *testing.T) {
	c := rpctest.Start(t, 3, testLimits)
	ctx := context.Background()
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	for i := uint64(1); i <= 7; i++ {
		if d, err := acquireOne(ctx, q, "t", admission(i, 1, "endpoint=charges")); err != nil || !d.Admitted {
			t.Fatalf("%v %v", d, err)
		}
	}
	// A lease held across the failover must survive it.
	held, err := acquireOne(ctx, q, "t", admission(100, 1, "tenant=acme"))
	if err != nil || held.LeaseId == 0 {
		t.Fatalf("lease: %+v %v", held, err)
	}
	c.Kill(leader)
	killed := time.Now()
	other := (leader + 1) % 3
	q2 := quotadv1.NewQuotaClient(dial(t, c.Addrs()[other]))
	var d *quotadv1.Decision
	clustertest.Eventually(t, 3*time.Second, func() error {
		var err error
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		d, err = acquireOne(cctx, q2, "t", admission(8, 1, "endpoint=charges"))
		return err
	})
	t.Logf("first decision %v after the leader was killed", time.Since(killed))
	// 7 of 10 spent at 1/s refill: at most 3 + (elapsed seconds) + 1 remain; the election gap
	// is not credited, so remaining after this 8th spend is small.
	elapsed := time.Since(killed).Seconds()
	if !d.Admitted || float64(d.Remaining) > 2+elapsed+1 {
		t.Fatalf("after failover: %+v (elapsed %.1fs): a debit was lost or the gap was credited", d, elapsed)
	}
	// The retry of an acknowledged request returns its original decision on the new leader.
	again, err := acquireOne(ctx, q2, "t", admission(100, 1, "tenant=acme"))
	if err != nil || again.LeaseId != held.LeaseId {
		t.Fatalf("retry after failover: %+v %v, want lease %d", again, err, held.LeaseId)
	}
	st, err := q2.Status(ctx, &quotadv1.StatusRequest{Domain: "provider", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}})
	if err != nil {
		t.Fatal(err)
	}
	var inFlight uint64
	for _, b := range st.Buckets {
		inFlight += b.InFlight
	}
	if inFlight != 1 {
		t.Fatalf("in-flight after failover = %d, want the 1 held lease: %v", inFlight, st.Buckets)
	}
}

func TestTotalRestartKeepsBalancesLimitsAndLeases(t *testing.T) {
	c := rpctest.Start(t, 3, testLimits)
	ctx := context.Background()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[0]))
	for i := uint64(1); i <= 9; i++ {
		if d, err := acquireOne(ctx, q, "t", admission(i, 1, "endpoint=charges")); err != nil || !d.Admitted {
			t.Fatalf("%v %v", d, err)
		}
	}
	lease, err := acquireOne(ctx, q, "t", admission(50, 1, "tenant=acme"))
	if err != nil || lease.LeaseId == 0 {
		t.Fatal(lease, err)
	}
	for i := range 3 {
		c.Kill(i)
	}
	for i := range 3 {
		c.Restart(i)
	}
	c.WaitLeader(10 * time.Second)
	var st *quotadv1.StatusResponse
	clustertest.Eventually(t, 5*time.Second, func() error {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		st, err = q.Status(cctx, &quotadv1.StatusRequest{Domain: "provider", Descriptors: []*quotadv1.Entry{{Key: "endpoint", Value: "charges"}}})
		return err
	})
	var charges *quotadv1.BucketStatus
	for _, b := range st.Buckets {
		if b.Scope == "endpoint" {
			charges = b
		}
	}
	// 1 of 10 left before the restart, refilling 1/s; the down time is not credited beyond the
	// real time the cluster was up, so well under the full 10.
	if charges == nil || charges.Remaining > 4 || charges.Limit != 60 {
		t.Fatalf("after total restart endpoint bucket = %+v, want ~1 remaining and limit 60", charges)
	}
	st, err = q.Status(ctx, &quotadv1.StatusRequest{Domain: "provider", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}})
	if err != nil {
		t.Fatal(err)
	}
	if got := st.Buckets[len(st.Buckets)-1].InFlight; got != 1 {
		t.Fatalf("lease lost in restart: in-flight %d", got)
	}
	if _, err := q.Renew(ctx, &quotadv1.RenewRequest{LeaseId: lease.LeaseId}); err != nil {
		t.Fatalf("renewing the lease after restart: %v", err)
	}
}

// TestBoundedAdmissionAcrossLeaderKill runs many concurrent clients against a refilling bucket
// of rate R and burst B for T seconds, kills the leader once in the middle, and checks that at
// most B + R·T were admitted in total (DESIGN invariant 2).
func TestBoundedAdmissionAcrossLeaderKill(t *testing.T) {
	c := rpctest.Start(t, 3, testLimits)
	const (
		burst   = 20
		rate    = 50.0 // per second ("search")
		workers = 16
	)
	var admitted, decided, unknown atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	start := time.Now()
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conns := make([]quotadv1.QuotaClient, 3)
			for i, a := range c.Addrs() {
				conns[i] = quotadv1.NewQuotaClient(dial(t, a))
			}
			client := fmt.Sprintf("w%d", w)
			for id := uint64(1); ctx.Err() == nil; id++ {
				// Retry one request ID across nodes until a decision comes back.
				for attempt := 0; ctx.Err() == nil; attempt++ {
					cctx, ccancel := context.WithTimeout(ctx, 500*time.Millisecond)
					d, err := acquireOne(cctx, conns[(w+attempt)%3], client, admission(id, 1, "endpoint=search"))
					ccancel()
					if err == nil {
						decided.Add(1)
						if d.Admitted {
							admitted.Add(1)
						}
						break
					}
					if attempt > 0 {
						unknown.Add(1)
					}
				}
			}
		}()
	}
	time.Sleep(1500 * time.Millisecond) // load runs; the bound is checked over the whole run
	c.Kill(c.Leader())
	c.WaitLeader(5 * time.Second)
	time.Sleep(1500 * time.Millisecond)
	cancel()
	wg.Wait()
	elapsed := time.Since(start).Seconds()
	bound := burst + rate*elapsed
	t.Logf("admitted %d of %d decisions in %.2fs (bound %.0f)", admitted.Load(), decided.Load(), elapsed, bound)
	if float64(admitted.Load()) > math.Floor(bound) {
		t.Fatalf("admitted %d > burst + rate·T = %.1f", admitted.Load(), bound)
	}
	if decided.Load() < 100 {
		t.Fatalf("only %d decisions: the load did not run", decided.Load())
	}
}

// /debug/state is cheap to poll: no state hash unless asked for (?hash=1), and the hash is the
// same on every replica once they applied the same entries.
func TestDebugStateHashOnlyWhenAsked(t *testing.T) {
	c := rpctest.Start(t, 3, testLimits)
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	if _, err := acquireOne(context.Background(), q, "s", admission(1, 1, "endpoint=charges")); err != nil {
		t.Fatal(err)
	}
	get := func(i int, query string) map[string]any {
		resp, err := http.Get("http://" + c.Agent(i).HTTPAddr() + "/debug/state" + query)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var m map[string]any
		if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
			t.Fatal(err)
		}
		return m
	}
	if m := get(leader, ""); m["hash"] != nil || m["applied_index"] == nil || m["is_leader"] != true {
		t.Fatalf("/debug/state = %v, want applied_index and is_leader without a hash", m)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		a, b := get(leader, "?hash=1"), get((leader+1)%3, "?hash=1")
		if a["hash"] == nil {
			t.Fatalf("/debug/state?hash=1 = %v, want a hash", a)
		}
		if a["applied_index"] == b["applied_index"] {
			if a["hash"] != b["hash"] {
				t.Fatalf("replicas at applied index %v disagree: %v vs %v", a["applied_index"], a["hash"], b["hash"])
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("replicas never at the same applied index: %v vs %v", a, b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
