package region_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/region"
)

// Envoy's rate limit service on regional clusters: "edge" has a global rule (route=orders,
// 60/s) beside a regional one (route=search, 40/s per region); "gate" a global ceiling (50/s)
// over a regional per-user rule.
const rlsLimits = `
domain: edge
descriptors:
  - key: route
    value: orders
    name: orders
    replaces: [{name: pay}]
    rate_limit: {unit: second, requests_per_unit: 60, burst: 60, scope: global}
    shares: {lease: 3s, reserve_percent: 1}
  - key: route
    value: search
    rate_limit: {unit: second, requests_per_unit: 40, burst: 40}
  - key: route
    value: pay
    name: pay
    rate_limit: {unit: minute, requests_per_unit: 1, burst: 1}
---
domain: gate
rate_limit: {unit: second, requests_per_unit: 50, burst: 50, scope: global}
shares: {lease: 3s, reserve_percent: 1}
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 1000}
`

func rlsClient(t *testing.T, addr string) rlsv3.RateLimitServiceClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return rlsv3.NewRateLimitServiceClient(conn)
}

func rlsDesc(kv ...string) *ratelimitv3.RateLimitDescriptor {
	d := &ratelimitv3.RateLimitDescriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, &ratelimitv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return d
}

// hammer sends req to every client from 4 goroutines each for d and counts OK answers per
// client.
func hammer(t *testing.T, cs []rlsv3.RateLimitServiceClient, req *rlsv3.RateLimitRequest, d time.Duration) ([]int64, time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	ok := make([]atomic.Int64, len(cs))
	var over, errs atomic.Int64
	var lastErr atomic.Value
	var wg sync.WaitGroup
	start := time.Now()
	for i, c := range cs {
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for ctx.Err() == nil {
					resp, err := c.ShouldRateLimit(ctx, req)
					switch {
					case err != nil:
						if ctx.Err() == nil && status.Code(err) != codes.DeadlineExceeded {
							errs.Add(1)
							lastErr.Store(err.Error())
						}
					case resp.OverallCode == rlsv3.RateLimitResponse_OK:
						ok[i].Add(1)
					default:
						over.Add(1)
					}
					time.Sleep(2 * time.Millisecond)
				}
			}()
		}
	}
	wg.Wait()
	el := time.Since(start)
	out := make([]int64, len(cs))
	for i := range ok {
		out[i] = ok[i].Load()
	}
	if errs.Load() > 0 {
		t.Fatalf("%d RLS calls failed, the last: %v", errs.Load(), lastErr.Load())
	}
	if over.Load() == 0 {
		t.Fatalf("no request was over the limit: the regions were not driven past it")
	}
	return out, el
}

// Envoy's RLS on regional clusters decides global rules from the regional leaders' shares:
// the global limit holds across regions, for a global descriptor rule and a global ceiling.
// (Decided by each regional FSM alone, each region would admit the whole limit.)
func TestRegionsRLSGlobalBound(t *testing.T) {
	w := startWorldWith(t, rlsLimits)
	cs := []rlsv3.RateLimitServiceClient{rlsClient(t, w.regions[0].Addrs()[0]), rlsClient(t, w.regions[1].Addrs()[0])}
	for _, tc := range []struct {
		name        string
		req         *rlsv3.RateLimitRequest
		rate, burst float64
	}{
		{"descriptor rule edge route=orders", &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{rlsDesc("route", "orders")}}, 60, 60},
		{"ceiling of gate", &rlsv3.RateLimitRequest{Domain: "gate", Descriptors: []*ratelimitv3.RateLimitDescriptor{rlsDesc("user", "u1")}}, 50, 50},
	} {
		ok, el := hammer(t, cs, tc.req, 4*time.Second)
		total := float64(ok[0] + ok[1])
		bound := tc.burst + tc.rate*el.Seconds()*(1+1e-3)
		t.Logf("%s: OK %d + %d = %.0f in %v; B + R·T(1+ρ) = %.0f", tc.name, ok[0], ok[1], total, el.Round(time.Millisecond), bound)
		if total > bound {
			t.Fatalf("%s: %0.f OK across regions > B + R·T(1+ρ) = %.0f: the global rule is decided per region", tc.name, total, bound)
		}
		if ok[0] == 0 || ok[1] == 0 || total < 0.5*tc.rate*el.Seconds() {
			t.Fatalf("%s: OK %d, %d in %v: both regions should admit, together at least half the rate", tc.name, ok[0], ok[1], el)
		}
	}
}

// TestRegionsRLSThroughFollowers: Envoy calls that reach a 3-node regional cluster's followers
// (which forward them to the leader, concurrent ones batched in one Peer/ForwardRateLimit) are
// decided from the regional leader's shares like calls to the leader: the global rule holds
// across both regions. (Decided by the regional FSM alone, region 0 would admit the whole
// limit by itself.)
func TestRegionsRLSThroughFollowers(t *testing.T) {
	w := startWorldSized(t, rlsLimits, 3, 1)
	r0 := w.regions[0]
	l := r0.Leader()
	cs := []rlsv3.RateLimitServiceClient{rlsClient(t, r0.Addrs()[(l+1)%3]), rlsClient(t, r0.Addrs()[(l+2)%3]), rlsClient(t, w.regions[1].Addrs()[0])}
	req := &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{rlsDesc("route", "orders")}}
	ok, el := hammer(t, cs, req, 4*time.Second)
	total := float64(ok[0] + ok[1] + ok[2])
	bound := 60 + 60*el.Seconds()*(1+1e-3)
	t.Logf("OK via followers %d + %d, region 1 %d = %.0f in %v; B + R·T(1+ρ) = %.0f", ok[0], ok[1], ok[2], total, el.Round(time.Millisecond), bound)
	if total > bound {
		t.Fatalf("%.0f OK across regions > B + R·T(1+ρ) = %.0f: calls forwarded by followers skipped the regional leader's shares", total, bound)
	}
	if ok[0]+ok[1] == 0 || ok[2] == 0 {
		t.Fatalf("OK %v: both regions should admit", ok)
	}
}

// Envoy's per-descriptor meaning holds on a regional cluster: with the global rule's share
// spent, a request with a global and a regional descriptor is OVER_LIMIT, the global one
// answered with its rule's limit, the regional one OK — and charged (its remaining falls).
func TestRegionsRLSPerDescriptor(t *testing.T) {
	w := startWorldWith(t, rlsLimits)
	c := rlsClient(t, w.regions[0].Addrs()[0])
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// Spend region 0's share of route=orders.
	var over *rlsv3.RateLimitResponse
	for range 500 {
		resp, err := c.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{rlsDesc("route", "orders")}})
		if err != nil {
			t.Fatal(err)
		}
		if resp.OverallCode == rlsv3.RateLimitResponse_OVER_LIMIT {
			over = resp
			break
		}
	}
	if over == nil {
		t.Fatal("500 requests at route=orders (60/s global) were never over the limit")
	}
	req := &rlsv3.RateLimitRequest{Domain: "edge", HitsAddend: 1, Descriptors: []*ratelimitv3.RateLimitDescriptor{rlsDesc("route", "orders"), rlsDesc("route", "search")}}
	var remaining []uint32
	for try := 0; try < 20 && len(remaining) < 3; try++ {
		resp, err := c.ShouldRateLimit(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		g, r := resp.Statuses[0], resp.Statuses[1]
		if resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT || g.Code != rlsv3.RateLimitResponse_OVER_LIMIT || r.Code != rlsv3.RateLimitResponse_OK {
			// The share refills at about 30/s: a request may find a token; try again.
			continue
		}
		if g.CurrentLimit.GetName() != "orders" || g.CurrentLimit.GetRequestsPerUnit() != 60 || g.LimitRemaining != 0 || g.DurationUntilReset.AsDuration() < time.Second {
			t.Fatalf("the global descriptor's status: %v, want its rule (orders, 60/s), 0 remaining, a reset ≥ 1 s", g)
		}
		remaining = append(remaining, r.LimitRemaining)
	}
	t.Logf("regional descriptor remaining across requests whose global descriptor was over: %v", remaining)
	if len(remaining) < 2 || remaining[len(remaining)-1] >= remaining[0] {
		t.Fatalf("the regional descriptor's remaining %v: it should be charged although the global one was over (Envoy counts each descriptor)", remaining)
	}
	// A rule the global one replaces stays replaced when the global one is over: OK, no limit,
	// not charged (route=pay admits 1 a minute: charged, the second would be over).
	pay := &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{rlsDesc("route", "orders"), rlsDesc("route", "pay")}}
	checked := 0
	for try := 0; try < 40 && checked < 3; try++ {
		resp, err := c.ShouldRateLimit(ctx, pay)
		if err != nil {
			t.Fatal(err)
		}
		if resp.Statuses[0].Code != rlsv3.RateLimitResponse_OVER_LIMIT {
			continue // the share had a token: this one spent it
		}
		checked++
		if p := resp.Statuses[1]; p.Code != rlsv3.RateLimitResponse_OK || p.CurrentLimit != nil {
			t.Fatalf("route=pay beside a refused route=orders (which replaces it): %v, want OK without a limit (replaced)", p)
		}
	}
	if checked < 3 {
		t.Fatalf("route=orders was over in only %d of 40 requests", checked)
	}
	// A descriptor's own limit replaces the global rule: decided (regionally) by it.
	resp, err := c.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{{
		Entries: rlsDesc("route", "orders").Entries, Limit: &ratelimitv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 1000, Unit: 1}}}})
	if err != nil || resp.OverallCode != rlsv3.RateLimitResponse_OK {
		t.Fatalf("an override of the global rule: %v, %v; want OK (its own limit decides)", resp, err)
	}
	// hits_addend 0 checks without charging: OVER_LIMIT right after a hit was refused (the
	// share refills at about 30/s, so a check may find a new token: tried several times).
	one := &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{rlsDesc("route", "orders")}}
	zero := &rlsv3.RateLimitRequest{Domain: "edge", Descriptors: []*ratelimitv3.RateLimitDescriptor{rlsDesc("route", "orders")}}
	zero.Descriptors[0].HitsAddend = wrapperspb.UInt64(0)
	zeroOver := 0
	for range 20 {
		if resp, err := c.ShouldRateLimit(ctx, one); err != nil || resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
			continue
		}
		resp, err := c.ShouldRateLimit(ctx, zero)
		if err != nil {
			t.Fatal(err)
		}
		if resp.OverallCode == rlsv3.RateLimitResponse_OVER_LIMIT {
			zeroOver++
		}
	}
	t.Logf("hits 0 right after a refused hit: OVER_LIMIT %d of 20", zeroOver)
	if zeroOver == 0 {
		t.Fatal("hits_addend 0 at a spent global rule was never OVER_LIMIT (the next hit would be refused)")
	}
}

// The global ceiling is charged only when the request is OK: a request a descriptor makes
// OVER_LIMIT (here its own blocking limit) gives the ceiling's units back to the share.
func TestRegionsRLSCeilingGivenBack(t *testing.T) {
	w := startWorldWith(t, rlsLimits)
	rc := w.regions[0]
	c := rlsClient(t, rc.Addrs()[0])
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	gate := func() (admitted, undone uint64) {
		h, _ := rc.Agent(rc.Leader()).Region().(*region.Holder)
		for _, s := range h.Shares() {
			if s.Domain == "gate" {
				return s.Admitted, s.Undone
			}
		}
		t.Fatal("no share of gate's ceiling")
		return 0, 0
	}
	// The region holds a lent share of gate's ceiling that admits before the counts start: with
	// no demand yet its first share may be too small (CI under -race: the first blocked request
	// was refused by the ceiling, "want OVER_LIMIT with the other descriptor OK").
	ok := &rlsv3.RateLimitRequest{Domain: "gate", Descriptors: []*ratelimitv3.RateLimitDescriptor{rlsDesc("user", "u1")}}
	clustertest.Eventually(t, 15*time.Second, func() error {
		resp, err := c.ShouldRateLimit(ctx, ok)
		if err != nil {
			return err
		}
		h, _ := rc.Agent(rc.Leader()).Region().(*region.Holder)
		for _, s := range h.Shares() {
			if s.Domain == "gate" && (s.Status != "lent" || resp.OverallCode != rlsv3.RateLimitResponse_OK) {
				return fmt.Errorf("gate's share %s (%s), warm-up request %v", s.Status, s.Message, resp.OverallCode)
			}
		}
		return nil
	})
	a0, u0 := gate()
	blocked := &rlsv3.RateLimitRequest{Domain: "gate", Descriptors: []*ratelimitv3.RateLimitDescriptor{rlsDesc("user", "u1"), {
		Entries: rlsDesc("user", "u2").Entries, Limit: &ratelimitv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 0, Unit: 1}}}}
	for range 10 {
		resp, err := c.ShouldRateLimit(ctx, blocked)
		if err != nil {
			t.Fatal(err)
		}
		if resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT || resp.Statuses[0].Code != rlsv3.RateLimitResponse_OK {
			t.Fatalf("a request with a blocking descriptor: %v, want OVER_LIMIT with the other descriptor OK", resp)
		}
	}
	for range 5 {
		if resp, err := c.ShouldRateLimit(ctx, ok); err != nil || resp.OverallCode != rlsv3.RateLimitResponse_OK {
			t.Fatalf("an OK request: %v, %v", resp, err)
		}
	}
	a1, u1 := gate()
	t.Logf("gate's share: admitted %d → %d, given back %d → %d", a0, a1, u0, u1)
	if a1-a0 != 15 || u1-u0 != 10 {
		t.Fatalf("gate's share: %d admitted and %d given back over 10 OVER_LIMIT and 5 OK requests; want 15 and 10", a1-a0, u1-u0)
	}
}
