package client

import (
	"context"
	"testing"
	"time"
)

// BenchmarkClusterAllow measures Allow throughput against a real 3-node cluster with 64
// concurrent callers (b.SetParallelism × GOMAXPROCS ≥ 64), batching on and off. Reported
// extra metrics: admissions per Acquire RPC.
//
//	go test -run '^$' -bench BenchmarkClusterAllow -benchtime 20000x ./client/
func BenchmarkClusterAllow(b *testing.B) {
	for _, bc := range []struct {
		name string
		cfg  BatchConfig
	}{
		{"batched", BatchConfig{}},
		{"unbatched", BatchConfig{Disabled: true}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			tc := startClusterB(b)
			c := newTestClient(b, tc.addrs(), func(cfg *Config) { cfg.Batch = bc.cfg })
			// Warm up: learn the leader, open the connection.
			ctx := context.Background()
			if _, err := c.Allow(ctx, Request{Domain: "bench"}); err != nil {
				b.Fatal(err)
			}
			before := c.Stats()
			b.SetParallelism(64/max(1, testingProcs()) + 1)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					_, err := c.Allow(ctx, Request{Domain: "bench"})
					cancel()
					if err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			s := c.Stats()
			rpcs := s.RPCs - before.RPCs
			b.ReportMetric(float64(s.Admissions-before.Admissions)/float64(max(rpcs, 1)), "admissions/rpc")
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
		})
	}
}
