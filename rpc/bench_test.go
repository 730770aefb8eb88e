package rpc_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/rpc/rpctest"
)

const benchLimitsYAML = `domain: bench
rate_limit: {unit: second, requests_per_unit: 100000000}
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 1000000}
`

// BenchmarkAcquireGroupCommit drives the leader of an in-process 3-node cluster (real Raft,
// BoltDB with fsync, gRPC over loopback) with concurrent Acquire calls of `per` admissions
// each: validation, group commit (proposer), replication, FSM apply on every replica and the
// answer. One op is one admission decided; the cluster shares the CPU with the benchmark.
func BenchmarkAcquireGroupCommit(b *testing.B) {
	for _, tc := range []struct{ callers, per int }{{1, 1}, {64, 1}, {64, 16}, {256, 16}} {
		b.Run(fmt.Sprintf("callers=%d/per=%d", tc.callers, tc.per), func(b *testing.B) {
			c := rpctest.Start(b, 3, benchLimitsYAML)
			leader := c.WaitLeader(10e9)
			conn, err := grpc.NewClient(c.Agent(leader).GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()
			qc := quotadv1.NewQuotaClient(conn)
			var ids atomic.Uint64
			var failed atomic.Value
			b.SetParallelism((tc.callers + 1) / 2) // GOMAXPROCS is 2 here
			b.ReportAllocs()
			b.ResetTimer()
			calls := atomic.Int64{}
			calls.Store(int64(b.N / tc.per))
			b.RunParallel(func(pb *testing.PB) {
				req := &quotadv1.AcquireRequest{ClientId: "bench", Admissions: make([]*quotadv1.Admission, tc.per)}
				for pb.Next() {
					// b.N counts admissions: only every per-th iteration makes a call.
					if ids.Add(1)%uint64(tc.per) != 0 {
						continue
					}
					for i := range req.Admissions {
						id := ids.Add(1<<32) >> 32 // a distinct request ID per admission
						req.Admissions[i] = &quotadv1.Admission{RequestId: id, Domain: "bench",
							Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: fmt.Sprintf("t%d", id%1000)}}}
					}
					resp, err := qc.Acquire(context.Background(), req)
					if err != nil {
						failed.CompareAndSwap(nil, err.Error())
						return
					}
					for _, d := range resp.Decisions {
						if !d.Admitted {
							failed.CompareAndSwap(nil, "refused: "+d.Reason)
						}
					}
				}
			})
			b.StopTimer()
			if f := failed.Load(); f != nil {
				b.Fatal(f)
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
		})
	}
}
