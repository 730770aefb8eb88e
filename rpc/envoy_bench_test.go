package rpc_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/quotad/quotad/rpc/rpctest"
)

const benchRLSLimits = `domain: rls
rate_limit: {unit: second, requests_per_unit: 100000000}
descriptors:
  - key: generic_key
    value: orders
    rate_limit: {unit: second, requests_per_unit: 100000000}
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 1000000}
    descriptors:
      - key: consumer
        rate_limit: {unit: second, requests_per_unit: 1000000}
`

// BenchmarkRLS drives the leader of an in-process 3-node cluster with concurrent
// ShouldRateLimit calls of examples/envoy/envoy.yaml's three descriptors (one op is one
// request). Compare with BenchmarkAcquireGroupCommit/callers=64/per=1: the same path with one
// native admission per call.
func BenchmarkRLS(b *testing.B) {
	for _, callers := range []int{1, 64, 256} {
		b.Run(fmt.Sprintf("callers=%d", callers), func(b *testing.B) {
			c := rpctest.Start(b, 3, benchRLSLimits)
			leader := c.WaitLeader(10e9)
			conn, err := grpc.NewClient(c.Agent(leader).GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()
			rls := rlsv3.NewRateLimitServiceClient(conn)
			var n atomic.Uint64
			var failed atomic.Value
			entry := func(k, v string) *rlcommon.RateLimitDescriptor_Entry {
				return &rlcommon.RateLimitDescriptor_Entry{Key: k, Value: v}
			}
			b.SetParallelism((callers + 1) / 2)
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					tenant := fmt.Sprintf("t%d", n.Add(1)%1000)
					resp, err := rls.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "rls",
						Descriptors: []*rlcommon.RateLimitDescriptor{
							{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("generic_key", "orders")}},
							{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("tenant", tenant)}},
							{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("tenant", tenant), entry("consumer", "c")}},
						}})
					if err != nil {
						failed.CompareAndSwap(nil, err.Error())
						return
					}
					if resp.OverallCode != rlsv3.RateLimitResponse_OK {
						failed.CompareAndSwap(nil, "refused")
					}
				}
			})
			b.StopTimer()
			if f := failed.Load(); f != nil {
				b.Fatal(f)
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "requests/s")
		})
	}
}
