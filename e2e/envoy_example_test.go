package e2e

import (
	"context"
	"os"
	"testing"
	"time"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// TestEnvoyExample: examples/envoy/limits.yaml on a secure 3-node cluster of processes run with
// --rls-headers x-ratelimit, asked (through a follower) with the descriptors
// examples/envoy/envoy.yaml sends: a 429 names the limit that answered in X-RateLimit-Scope,
// consumer first, then tenant (seed 002's "which limit was hit").
func TestEnvoyExample(t *testing.T) {
	limits, err := os.ReadFile("../examples/envoy/limits.yaml")
	if err != nil {
		t.Fatal(err)
	}
	c := startClusterWith(t, 3, string(limits), "--rls-headers", "x-ratelimit")
	opts, err := c.DialOptions()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	leader := c.Leader(ctx)
	conn, err := grpc.NewClient(c.GRPCAddrs()[(leader+1)%3], opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	rls := rlsv3.NewRateLimitServiceClient(conn)
	entry := func(k, v string) *rlcommon.RateLimitDescriptor_Entry {
		return &rlcommon.RateLimitDescriptor_Entry{Key: k, Value: v}
	}
	req := func(tenant, consumer string, tenantHits, consumerHits uint64) *rlsv3.RateLimitRequest {
		return &rlsv3.RateLimitRequest{Domain: "platform", Descriptors: []*rlcommon.RateLimitDescriptor{
			{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("generic_key", "orders")}, HitsAddend: wrapperspb.UInt64(consumerHits)},
			{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("tenant", tenant)}, HitsAddend: wrapperspb.UInt64(tenantHits)},
			{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("tenant", tenant), entry("consumer", consumer)}, HitsAddend: wrapperspb.UInt64(consumerHits)},
		}}
	}
	ask := func(r *rlsv3.RateLimitRequest) (rlsv3.RateLimitResponse_Code, map[string]string) {
		t.Helper()
		resp, err := rls.ShouldRateLimit(ctx, r)
		if err != nil {
			t.Fatal(err)
		}
		h := map[string]string{}
		for _, kv := range resp.ResponseHeadersToAdd {
			h[kv.Key] = kv.Value
		}
		return resp.OverallCode, h
	}
	ok, over := rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OVER_LIMIT

	if code, h := ask(req("acme", "mobile", 600, 600)); code != ok || h["X-RateLimit-Remaining"] != "0" {
		t.Fatalf("the integration's 600: %s %v", code, h)
	}
	// Buckets refill continuously (600/min is 10/s): ask for more than seconds of refill.
	if code, h := ask(req("acme", "mobile", 30, 30)); code != over || h["X-RateLimit-Scope"] != "consumer" || h["X-RateLimit-Limit"] != "600" {
		t.Fatalf("601st: %s %v, want a 429 scoped to the consumer (limit 600)", code, h)
	}
	if code, h := ask(req("acme", "web", 4000, 1)); code != ok {
		t.Fatalf("the tenant's other integration up to 5000: %s %v", code, h)
	}
	if code, h := ask(req("acme", "web", 500, 1)); code != over || h["X-RateLimit-Scope"] != "tenant" || h["X-RateLimit-Limit"] != "5000" {
		t.Fatalf("over the tenant: %s %v, want a 429 scoped to the tenant (limit 5000)", code, h)
	}
	if code, h := ask(req("initech", "mobile", 1, 1)); code != ok || h["X-RateLimit-Scope"] == "" {
		t.Fatalf("another tenant: %s %v", code, h)
	}
}
