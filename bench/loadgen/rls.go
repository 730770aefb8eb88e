package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"

	"github.com/quotad/quotad/client"
)

// rlsDescriptors is what examples/envoy/envoy.yaml sends per request.
const rlsDescriptors = 3

// rlsLoad drives ShouldRateLimit from conc goroutines over one connection per node (Envoy's
// gRPC client multiplexes its requests over a few HTTP/2 connections).
func rlsLoad(cfg client.Config, domain, prefix string, keys, conc int, warmup, dur time.Duration) Result {
	opts, err := cfg.DialCredentials()
	if err != nil {
		fail(err)
	}
	var conns []rlsv3.RateLimitServiceClient
	for _, a := range cfg.Addrs {
		cc, err := grpc.NewClient(a, opts...)
		if err != nil {
			fail(err)
		}
		defer cc.Close()
		conns = append(conns, rlsv3.NewRateLimitServiceClient(cc))
	}
	entry := func(k, v string) *rlcommon.RateLimitDescriptor_Entry {
		return &rlcommon.RateLimitDescriptor_Entry{Key: k, Value: v}
	}
	var (
		k       counters
		measure atomic.Bool
		stop    atomic.Bool
		wg      sync.WaitGroup
		lats    = make([][]int64, conc)
	)
	for w := range conc {
		wg.Go(func() {
			rls := conns[w%len(conns)]
			own := make([]int64, 0, 4096)
			for i := w; !stop.Load(); i += conc {
				tenant := fmt.Sprintf("%s%d", prefix, i%keys)
				req := &rlsv3.RateLimitRequest{Domain: domain, Descriptors: []*rlcommon.RateLimitDescriptor{
					{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("generic_key", "orders")}},
					{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("tenant", tenant)}},
					{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("tenant", tenant), entry("consumer", "c"+fmt.Sprint(i%7))}},
				}}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				t0 := time.Now()
				resp, err := rls.ShouldRateLimit(ctx, req)
				took := time.Since(t0)
				cancel()
				if measure.Load() {
					switch {
					case err != nil:
						k.errors.Add(1)
						k.firstErr.CompareAndSwap(nil, err.Error())
					case resp.OverallCode == rlsv3.RateLimitResponse_OK:
						k.admitted.Add(1)
					default:
						k.denied.Add(1)
					}
					own = append(own, int64(took))
				}
			}
			lats[w] = own
		})
	}
	time.Sleep(warmup)
	measure.Store(true)
	start := time.Now()
	time.Sleep(dur)
	measure.Store(false)
	elapsed := time.Since(start)
	stop.Store(true)
	wg.Wait()
	r := summarize("rls", conc, &k, slices.Concat(lats...), elapsed)
	r.DescriptorsPerSec = r.PerSec * rlsDescriptors
	return r
}
