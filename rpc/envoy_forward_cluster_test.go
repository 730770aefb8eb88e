package rpc_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/region"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

const forwardHardenLimits = `
domain: fw
descriptors:
  - key: one
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: two
    rate_limit: {unit: minute, requests_per_unit: 2}
`

// TestRLSForwardDeadlinesAndReroute, on a 3-node cluster:
//   - the leader answers a forwarded call whose caller's time (timeout_ns) ran out before it
//     was decided DEADLINE_EXCEEDED and charges nothing; a call without timeout_ns (an older
//     follower) has the batch's deadline and is decided;
//   - a follower whose batch reaches a node that no longer leads (it decided nothing and says
//     so) sends the batch once more, to the leader, and the call is decided there once
//     (review: a leader change mid-batch failed every call in it UNAVAILABLE).
func TestRLSForwardDeadlinesAndReroute(t *testing.T) {
	c := rpctest.Start(t, 3, forwardHardenLimits)
	leader := c.Leader()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	conn, err := grpc.NewClient(c.Addrs()[leader], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	data, err := proto.Marshal(rlsReq("fw", []string{"one", "x"}))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := quotadv1.NewPeerClient(conn).ForwardRateLimit(ctx, &quotadv1.ForwardRateLimitRequest{Calls: []*quotadv1.ForwardedCall{
		{Request: data, TimeoutNs: -1}, // its caller's time ran out on the way
		{Request: data},                // no timeout_ns: the batch's deadline
	}})
	if err != nil {
		t.Fatal(err)
	}
	if r := resp.Results[0]; codes.Code(r.Code) != codes.DeadlineExceeded || !strings.Contains(r.Message, "nothing was charged") {
		t.Fatalf("the expired call: code %v %q; want DEADLINE_EXCEEDED, nothing charged", codes.Code(r.Code), r.Message)
	}
	out := &rlsv3.RateLimitResponse{}
	if r := resp.Results[1]; r.Code != 0 || proto.Unmarshal(r.Response, out) != nil || out.OverallCode != rlsv3.RateLimitResponse_OK {
		t.Fatalf("the call without timeout_ns: code %v %q, answer %v; want OK (1 per minute, the expired call charged nothing)", codes.Code(r.Code), r.Message, out)
	}

	// A follower forwards to the other follower as if it led.
	f, n := (leader+1)%3, (leader+2)%3
	two := rlsReq("fw", []string{"two", "x"})
	r, err := rpc.ForwardVia(ctx, c.Agent(f), c.Addrs()[n], two)
	wantRLS(t, r, err, rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OK)
	// Decided once: 2 per minute leaves one more.
	lc := rlsv3.NewRateLimitServiceClient(conn)
	r, err = lc.ShouldRateLimit(ctx, two)
	wantRLS(t, r, err, rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OK)
	r, err = lc.ShouldRateLimit(ctx, two)
	wantRLS(t, r, err, rlsv3.RateLimitResponse_OVER_LIMIT, rlsv3.RateLimitResponse_OVER_LIMIT)
}

const forwardRegionalLimits = `
domain: edge
descriptors:
  - key: route
    value: orders
    rate_limit: {unit: second, requests_per_unit: 60, burst: 60, scope: global}
    shares: {lease: 3s, reserve_percent: 1}
`

// TestRLSForwardRegionalConcurrent: a regional leader decides the scope: global calls of a
// forwarded batch concurrently (each is a commit of its own; review: one at a time, 256 calls
// were 256 commit latencies).
func TestRLSForwardRegionalConcurrent(t *testing.T) {
	global := rpctest.Start(t, 1, forwardRegionalLimits)
	g := client.Config{Addrs: global.Addrs(), Insecure: true}
	rc := rpctest.Start(t, 1, forwardRegionalLimits, func(_ int, c *rpc.AgentConfig) { c.Region = region.Agent("ra", g) })
	var started atomic.Int32
	concurrent := make(chan bool, 1)
	rpc.SetForwardRegionalHook(func() {
		if started.Add(1) != 1 {
			return
		}
		// The first call waits (at most 10 s) for a second one to start beside it.
		for end := time.Now().Add(10 * time.Second); started.Load() < 2 && time.Now().Before(end); {
			time.Sleep(time.Millisecond)
		}
		concurrent <- started.Load() >= 2
	})
	defer rpc.SetForwardRegionalHook(nil)
	conn, err := grpc.NewClient(rc.Addrs()[0], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	data, err := proto.Marshal(rlsReq("edge", []string{"route", "orders"}))
	if err != nil {
		t.Fatal(err)
	}
	req := &quotadv1.ForwardRateLimitRequest{}
	for range 4 {
		req.Calls = append(req.Calls, &quotadv1.ForwardedCall{Request: data})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := quotadv1.NewPeerClient(conn).ForwardRateLimit(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range resp.Results {
		if r.Code != 0 {
			t.Fatalf("call %d: %v %s", i, codes.Code(r.Code), r.Message)
		}
	}
	if !<-concurrent {
		t.Fatal("the regional leader decided the batch's global calls one at a time")
	}
	if n := started.Load(); n != 4 {
		t.Fatalf("%d calls decided from the shares; want 4", n)
	}
}

const benchForwardRegionalLimits = `
domain: edge
descriptors:
  - key: route
    value: orders
    rate_limit: {unit: second, requests_per_unit: 1000000, scope: global}
    shares: {lease: 3s, reserve_percent: 1}
`

// BenchmarkForwardRegionalBatch: one op is a follower's batch of 256 Envoy calls on a scope:
// global rule, decided by the leader of a 3-node regional cluster (under a 1-node global
// one) through Peer/ForwardRateLimit; each call is a commit of its own.
func BenchmarkForwardRegionalBatch(b *testing.B) {
	global := rpctest.Start(b, 1, benchForwardRegionalLimits)
	g := client.Config{Addrs: global.Addrs(), Insecure: true}
	rc := rpctest.Start(b, 3, benchForwardRegionalLimits, func(_ int, c *rpc.AgentConfig) { c.Region = region.Agent("ra", g) })
	conn, err := grpc.NewClient(rc.Addrs()[rc.Leader()], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	data, err := proto.Marshal(rlsReq("edge", []string{"route", "orders"}))
	if err != nil {
		b.Fatal(err)
	}
	req := &quotadv1.ForwardRateLimitRequest{}
	for range rpc.MaxForwardBatch {
		req.Calls = append(req.Calls, &quotadv1.ForwardedCall{Request: data})
	}
	peer := quotadv1.NewPeerClient(conn)
	ctx := context.Background()
	b.ResetTimer()
	for b.Loop() {
		resp, err := peer.ForwardRateLimit(ctx, req)
		if err != nil {
			b.Fatal(err)
		}
		for i, r := range resp.Results {
			if r.Code != 0 {
				b.Fatalf("call %d: %v %s", i, codes.Code(r.Code), r.Message)
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms/batch")
}
