package rpc_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

const capsLimits = `
domain: caps
rate_limit: {unit: minute, requests_per_unit: 1, burst: 1}
descriptors:
  - key: tenant
    concurrency: {max_in_flight: 100, lease_ttl: 2s}
`

// TestFieldCapsAtTheEdge: every string a caller chooses is refused above 256 bytes with a
// message naming the field, its length and the cap, and nothing reaches the log.
func TestFieldCapsAtTheEdge(t *testing.T) {
	c := rpctest.Start(t, 1, capsLimits)
	conn := dial(t, c.Addrs()[0])
	q := quotadv1.NewQuotaClient(conn)
	ctx := context.Background()
	fsm := c.Agent(0).FSM()
	before := fsm.Stats()
	long := strings.Repeat("x", 300)

	adm := func(mod func(a *quotadv1.Admission)) *quotadv1.Admission {
		a := &quotadv1.Admission{RequestId: 1, Domain: "caps", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "a"}}}
		mod(a)
		return a
	}
	for name, tc := range map[string]struct {
		adm  *quotadv1.Admission
		want string
	}{
		"work_class": {adm(func(a *quotadv1.Admission) { a.WorkClass = long }), "work_class is 300 bytes; the limit is 256 bytes"},
		"value":      {adm(func(a *quotadv1.Admission) { a.Descriptors[0].Value = long }), `descriptors[0].value (key "tenant") is 300 bytes; the limit is 256 bytes`},
		"key":        {adm(func(a *quotadv1.Admission) { a.Descriptors[0].Key = long }), "descriptors[0].key is 300 bytes; the limit is 256 bytes"},
		"domain":     {adm(func(a *quotadv1.Admission) { a.Domain = long }), "domain is 300 bytes; the limit is 256 bytes"},
		"entries": {adm(func(a *quotadv1.Admission) {
			for range 16 {
				a.Descriptors = append(a.Descriptors, &quotadv1.Entry{Key: "k", Value: "v"})
			}
		}), "descriptors has 17 entries; at most 16 are allowed"},
	} {
		d, err := acquireOne(ctx, q, "edge", tc.adm)
		if err != nil || d.Reason != "invalid" || !strings.Contains(d.Message, tc.want) {
			t.Errorf("%s: %+v %v, want invalid: %q", name, d, err, tc.want)
		}
		// A waiting admission is checked the same way before it queues.
		tc.adm.MaxWaitMs = 1000
		if d, err := acquireOne(ctx, q, "edge", tc.adm); err != nil || d.Reason != "invalid" {
			t.Errorf("%s, waiting: %+v %v", name, d, err)
		}
	}
	for name, call := range map[string]func() error{
		"client_id": func() error {
			_, err := acquireOne(ctx, q, long, adm(func(*quotadv1.Admission) {}))
			return err
		},
		"reason": func() error {
			_, err := q.Feedback(ctx, &quotadv1.FeedbackRequest{Domain: "caps", StatusCode: 429, Reason: long})
			return err
		},
		"descriptors[0].value": func() error {
			_, err := q.Feedback(ctx, &quotadv1.FeedbackRequest{Domain: "caps", StatusCode: 429, Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: long}}})
			return err
		},
		"domain": func() error {
			_, err := q.Status(ctx, &quotadv1.StatusRequest{Domain: long})
			return err
		},
		"client_id ": func() error {
			_, err := q.Refund(ctx, &quotadv1.RefundRequest{ClientId: long, RequestId: 1})
			return err
		},
	} {
		err := call()
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), strings.TrimSpace(name)) ||
			!strings.Contains(err.Error(), "is 300 bytes; the limit is 256 bytes") {
			t.Errorf("%s: %v", name, err)
		}
	}
	if after := fsm.Stats(); after.Buckets != before.Buckets || after.DedupEntries != before.DedupEntries || after.Pauses != before.Pauses {
		t.Fatalf("refused requests changed the state: %+v -> %+v", before, after)
	}
}

// TestMaxRequestBytes: a message above --max-request-bytes is refused before it is decoded.
func TestMaxRequestBytes(t *testing.T) {
	c := rpctest.Start(t, 1, capsLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.MaxRequestBytes = 64 << 10 })
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[0]))
	ctx := context.Background()
	big := &quotadv1.AcquireRequest{ClientId: "big"}
	for i := range 2000 { // ~100 KB
		big.Admissions = append(big.Admissions, &quotadv1.Admission{RequestId: uint64(i + 1), Domain: "caps",
			Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: fmt.Sprintf("tenant-%040d", i)}}})
	}
	_, err := q.Acquire(ctx, big)
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "larger than max") {
		t.Fatalf("a 100 KB request with a 64 KiB cap: %v", err)
	}
	if n := c.Agent(0).FSM().Stats().DedupEntries; n != 0 {
		t.Fatalf("%d admissions of a refused message were decided", n)
	}
	if _, err := acquireOne(ctx, q, "small", &quotadv1.Admission{RequestId: 1, Domain: "caps"}); err != nil {
		t.Fatalf("a small request after a refused one: %v", err)
	}
}

// fairWaiting reads how many admissions wait on node i (its /debug/fair).
func fairWaiting(t testing.TB, c *rpctest.Cluster, i int) int {
	t.Helper()
	resp, err := http.Get("http://" + c.Agent(i).HTTPAddr() + "/debug/fair")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v rpc.FairView
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
		t.Fatal(err)
	}
	return v.Waiting
}

func metricsText(t *testing.T, c *rpctest.Cluster, i int) string {
	t.Helper()
	resp, err := http.Get("http://" + c.Agent(i).HTTPAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestWaiterCaps: beyond the per-client and per-domain caps a waiting admission is denied at
// once (too_many_waiters, counted in the metrics) instead of parking a goroutine; slots come
// back when waiters end.
func TestWaiterCaps(t *testing.T) {
	c := rpctest.Start(t, 1, capsLimits, func(_ int, cfg *rpc.AgentConfig) {
		cfg.Waiters = rpc.WaiterCaps{PerClient: 3, PerDomain: 5}
	})
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[0]))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Empty the domain's bucket (1 a minute): every waiting admission queues.
	if d, err := acquireOne(ctx, q, "x", &quotadv1.Admission{RequestId: 1, Domain: "caps"}); err != nil || !d.Admitted {
		t.Fatalf("first: %+v %v", d, err)
	}
	var wg sync.WaitGroup
	wait := func(client string, id uint64) {
		wg.Go(func() {
			_, _ = acquireOne(ctx, q, client, &quotadv1.Admission{RequestId: id, Domain: "caps", MaxWaitMs: 120000})
		})
	}
	for i := range 3 {
		wait("a", uint64(10+i))
	}
	clustertest.Eventually(t, 5*time.Second, func() error {
		if n := fairWaiting(t, c, 0); n != 3 {
			return fmt.Errorf("%d waiting", n)
		}
		return nil
	})
	start := time.Now()
	d, err := acquireOne(ctx, q, "a", &quotadv1.Admission{RequestId: 20, Domain: "caps", MaxWaitMs: 120000})
	if err != nil || d.Reason != "too_many_waiters" || d.Scope != "client" || d.RetryAfterMs <= 0 ||
		!strings.Contains(d.Message, `client_id "a" already has 3 admissions waiting on the leader, its limit (--max-waiters-per-client 3)`) {
		t.Fatalf("a fourth waiter of one client: %+v %v", d, err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("the denial took %v: it waited", took)
	}
	for i := range 2 {
		wait("b", uint64(30+i))
	}
	clustertest.Eventually(t, 5*time.Second, func() error {
		if n := fairWaiting(t, c, 0); n != 5 {
			return fmt.Errorf("%d waiting", n)
		}
		return nil
	})
	d, err = acquireOne(ctx, q, "c", &quotadv1.Admission{RequestId: 40, Domain: "caps", MaxWaitMs: 120000})
	if err != nil || d.Reason != "too_many_waiters" || d.Scope != "domain" || !strings.Contains(d.Message, `domain "caps" already has 5`) {
		t.Fatalf("a sixth waiter in the domain: %+v %v", d, err)
	}
	// Non-waiting admissions are not capped (they are decided at once).
	if d, err := acquireOne(ctx, q, "a", &quotadv1.Admission{RequestId: 41, Domain: "caps"}); err != nil || d.Reason == "too_many_waiters" {
		t.Fatalf("non-waiting: %+v %v", d, err)
	}
	if m := metricsText(t, c, 0); !strings.Contains(m, `quotad_fair_denials_total{domain="caps",reason="too_many_waiters",scope="client"} 1`) ||
		!strings.Contains(m, `quotad_fair_denials_total{domain="caps",reason="too_many_waiters",scope="domain"} 1`) {
		t.Fatalf("denials not counted:\n%s", grepLines(m, "too_many_waiters"))
	}
	// The waiters end (their callers give up): the slots come back.
	cancel()
	wg.Wait()
	clustertest.Eventually(t, 5*time.Second, func() error {
		if n := fairWaiting(t, c, 0); n != 0 {
			return fmt.Errorf("%d waiting", n)
		}
		return nil
	})
	ctx2, cancel2 := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel2()
	if d, err := acquireOne(ctx2, q, "a", &quotadv1.Admission{RequestId: 50, Domain: "caps", MaxWaitMs: 100}); err != nil || d.Reason == "too_many_waiters" {
		t.Fatalf("after the waiters ended: %+v %v", d, err)
	}
}

// TestOverCapWaiterRefusedBeforeItsPathIsRead: a waiting admission over a waiter cap whose
// exact path already has waiters queued is refused as before (too_many_waiters, the cap that
// refused it, counted) without the scheduler reading its path from the FSM under its lock; one
// on a path with nobody queued is read first (it might go straight to the FSM) and refused the
// same way.
func TestOverCapWaiterRefusedBeforeItsPathIsRead(t *testing.T) {
	var mu sync.Mutex
	read := map[uint64]int{}
	rpc.SetWaitReadHook(func(adm *quotadv1.Admission) {
		mu.Lock()
		read[adm.RequestId]++
		mu.Unlock()
	})
	t.Cleanup(func() { rpc.SetWaitReadHook(nil) })
	readOf := func(id uint64) int {
		mu.Lock()
		defer mu.Unlock()
		return read[id]
	}
	c := rpctest.Start(t, 1, capsLimits, func(_ int, cfg *rpc.AgentConfig) {
		cfg.Waiters = rpc.WaiterCaps{PerClient: 2, PerDomain: 3}
	})
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[0]))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if d, err := acquireOne(ctx, q, "x", &quotadv1.Admission{RequestId: 1, Domain: "caps"}); err != nil || !d.Admitted {
		t.Fatalf("first: %+v %v", d, err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	waitIn := func(client string, id uint64, n int) {
		wg.Go(func() {
			_, _ = acquireOne(ctx, q, client, &quotadv1.Admission{RequestId: id, Domain: "caps", MaxWaitMs: 120000})
		})
		clustertest.Eventually(t, 5*time.Second, func() error {
			if got := fairWaiting(t, c, 0); got != n {
				return fmt.Errorf("%d waiting, want %d", got, n)
			}
			return nil
		})
	}
	waitIn("a", 10, 1)
	waitIn("a", 11, 2)
	if readOf(10) == 0 {
		t.Fatal("the hook saw no path read of a queued waiter")
	}
	d, err := acquireOne(ctx, q, "a", &quotadv1.Admission{RequestId: 20, Domain: "caps", MaxWaitMs: 120000})
	if err != nil || d.Reason != "too_many_waiters" || d.Scope != "client" || d.RetryAfterMs <= 0 ||
		!strings.Contains(d.Message, `client_id "a" already has 2 admissions waiting on the leader, its limit (--max-waiters-per-client 2)`) {
		t.Fatalf("a third waiter of one client: %+v %v", d, err)
	}
	if n := readOf(20); n != 0 {
		t.Fatalf("the over-cap waiter's path was read %d times before its refusal", n)
	}
	waitIn("b", 30, 3)
	d, err = acquireOne(ctx, q, "c", &quotadv1.Admission{RequestId: 40, Domain: "caps", MaxWaitMs: 120000})
	if err != nil || d.Reason != "too_many_waiters" || d.Scope != "domain" || !strings.Contains(d.Message, `domain "caps" already has 3`) {
		t.Fatalf("a fourth waiter in the domain: %+v %v", d, err)
	}
	if n := readOf(40); n != 0 {
		t.Fatalf("the over-cap waiter's path was read %d times before its refusal", n)
	}
	// Nobody waits on this exact path: its path is read (it might have gone straight to the
	// FSM), and it is refused by the same cap.
	d, err = acquireOne(ctx, q, "c", &quotadv1.Admission{RequestId: 41, Domain: "caps", MaxWaitMs: 120000,
		Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "t1"}}})
	if err != nil || d.Reason != "too_many_waiters" || d.Scope != "domain" {
		t.Fatalf("a waiter on another path in a full domain: %+v %v", d, err)
	}
	if readOf(41) == 0 {
		t.Fatal("a waiter on a path nobody waits on was refused without reading its path")
	}
	if m := metricsText(t, c, 0); !strings.Contains(m, `quotad_fair_denials_total{domain="caps",reason="too_many_waiters",scope="client"} 1`) ||
		!strings.Contains(m, `quotad_fair_denials_total{domain="caps",reason="too_many_waiters",scope="domain"} 2`) {
		t.Fatalf("denials not counted:\n%s", grepLines(m, "too_many_waiters"))
	}
}

// BenchmarkOverCapWaiterRefusal: a flood of waiting admissions over the per-client cap on a
// path that already has a waiter queued, from 8 concurrent callers; each is refused
// too_many_waiters. ns/op is per refusal, gRPC round trip included.
func BenchmarkOverCapWaiterRefusal(b *testing.B) {
	c := rpctest.Start(b, 1, capsLimits, func(_ int, cfg *rpc.AgentConfig) {
		cfg.Waiters = rpc.WaiterCaps{PerClient: 1}
	})
	conn, err := grpc.NewClient(c.Addrs()[0], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	q := quotadv1.NewQuotaClient(conn)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if d, err := acquireOne(ctx, q, "x", &quotadv1.Admission{RequestId: 1, Domain: "caps"}); err != nil || !d.Admitted {
		b.Fatalf("first: %+v %v", d, err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() {
		_, _ = acquireOne(ctx, q, "a", &quotadv1.Admission{RequestId: 2, Domain: "caps", MaxWaitMs: 600000})
	})
	for deadline := time.Now().Add(5 * time.Second); fairWaiting(b, c, 0) != 1; {
		if time.Now().After(deadline) {
			b.Fatal("the waiter did not queue")
		}
		time.Sleep(10 * time.Millisecond)
	}
	var id atomic.Uint64
	id.Store(100)
	b.SetParallelism(4) // 4 × GOMAXPROCS callers
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			d, err := acquireOne(ctx, q, "a", &quotadv1.Admission{RequestId: id.Add(1), Domain: "caps", MaxWaitMs: 600000})
			if err != nil || d.Reason != "too_many_waiters" {
				b.Errorf("over-cap waiter: %+v %v", d, err)
				return
			}
		}
	})
}

func grepLines(s, word string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, word) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestLeaseTTLIsCapped: a ten-year lease TTL is granted as the limit's lease_ttl, and a Renew
// for ten years extends it by lease_ttl only.
func TestLeaseTTLIsCapped(t *testing.T) {
	c := rpctest.Start(t, 1, capsLimits)
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[0]))
	ctx := context.Background()
	tenYears := int64(10 * 365 * 24 * time.Hour / time.Millisecond)
	d, err := acquireOne(ctx, q, "l", &quotadv1.Admission{RequestId: 1, Domain: "caps", LeaseTtlMs: tenYears,
		Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "a"}}})
	if err != nil || !d.Admitted || d.LeaseId == 0 || d.LeaseTtlMs != 2000 {
		t.Fatalf("ten-year lease: %+v %v", d, err)
	}
	r, err := q.Renew(ctx, &quotadv1.RenewRequest{LeaseId: d.LeaseId, LeaseTtlMs: tenYears})
	if err != nil || r.LeaseTtlMs != 2000 {
		t.Fatalf("ten-year renew: %+v %v", r, err)
	}
	// Not renewed again, the permit comes back after lease_ttl.
	clustertest.Eventually(t, 10*time.Second, func() error {
		st, err := q.Status(ctx, &quotadv1.StatusRequest{Domain: "caps", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "a"}}})
		if err != nil {
			return err
		}
		if n := st.Buckets[1].InFlight; n != 0 {
			return fmt.Errorf("%d in flight", n)
		}
		return nil
	})
}

// TestRequestIDConflictThroughTheAPI: a reused request ID with a different request is an
// error, not the first decision; an identical retry gets the first decision.
func TestRequestIDConflictThroughTheAPI(t *testing.T) {
	c := rpctest.Start(t, 3, testLimits)
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[(c.Leader()+1)%3])) // through a follower
	ctx := context.Background()
	first, err := acquireOne(ctx, q, "rid", admission(7, 1, "endpoint=search"))
	if err != nil || !first.Admitted {
		t.Fatalf("first: %+v %v", first, err)
	}
	d, err := acquireOne(ctx, q, "rid", admission(7, 1, "endpoint=charges"))
	if err != nil || d.Admitted || d.Reason != "request_id_conflict" || !strings.Contains(d.Message, "already used for a different request") {
		t.Fatalf("reuse for another endpoint: %+v %v", d, err)
	}
	again, err := acquireOne(ctx, q, "rid", admission(7, 1, "endpoint=search"))
	if err != nil || !again.Admitted || again.Remaining != first.Remaining {
		t.Fatalf("identical retry: %+v %v, want %+v", again, err, first)
	}
	// Through the scheduler's path too (a waiting admission whose ID is remembered).
	w := admission(7, 2, "endpoint=search")
	w.MaxWaitMs = 1000
	if d, err := acquireOne(ctx, q, "rid", w); err != nil || d.Reason != "request_id_conflict" {
		t.Fatalf("waiting reuse with another cost: %+v %v", d, err)
	}
}
