package main

import (
	"context"
	"fmt"
	"slices"
	"strconv"
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

// rlsCaller sends ShouldRateLimit calls over one connection per node (Envoy's gRPC client
// multiplexes its requests over a few HTTP/2 connections), round-robin.
type rlsCaller struct {
	conns  []rlsv3.RateLimitServiceClient
	domain string
	prefix string
	keys   int
	k      counters
}

func newRLSCaller(cfg client.Config, domain, prefix string, keys int) (*rlsCaller, func()) {
	opts, err := cfg.DialCredentials()
	if err != nil {
		fail(err)
	}
	r := &rlsCaller{domain: domain, prefix: prefix, keys: keys}
	var ccs []*grpc.ClientConn
	for _, a := range cfg.Addrs {
		cc, err := grpc.NewClient(a, opts...)
		if err != nil {
			fail(err)
		}
		ccs = append(ccs, cc)
		r.conns = append(r.conns, rlsv3.NewRateLimitServiceClient(cc))
	}
	return r, func() {
		for _, cc := range ccs {
			cc.Close()
		}
	}
}

func entry(k, v string) *rlcommon.RateLimitDescriptor_Entry {
	return &rlcommon.RateLimitDescriptor_Entry{Key: k, Value: v}
}

// call sends request i (tenant i mod keys, consumer i mod 7) to node conn and, if measured,
// counts its outcome.
func (r *rlsCaller) call(conn, i int, measured bool) {
	tenant := r.prefix + strconv.Itoa(i%r.keys)
	req := &rlsv3.RateLimitRequest{Domain: r.domain, Descriptors: []*rlcommon.RateLimitDescriptor{
		{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("generic_key", "orders")}},
		{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("tenant", tenant)}},
		{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("tenant", tenant), entry("consumer", "c"+strconv.Itoa(i%7))}},
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	resp, err := r.conns[conn%len(r.conns)].ShouldRateLimit(ctx, req)
	cancel()
	if !measured {
		return
	}
	switch {
	case err != nil:
		r.k.errors.Add(1)
		r.k.firstErr.CompareAndSwap(nil, err.Error())
	case resp.OverallCode == rlsv3.RateLimitResponse_OK:
		r.k.admitted.Add(1)
	default:
		r.k.denied.Add(1)
	}
}

// rlsLoad is the closed loop: conc goroutines call ShouldRateLimit back to back. At
// saturation it measures queueing: by Little's law the mean latency is conc ÷ throughput.
func rlsLoad(cfg client.Config, domain, prefix string, keys, conc int, warmup, dur time.Duration) Result {
	r, closeAll := newRLSCaller(cfg, domain, prefix, keys)
	defer closeAll()
	var (
		measure atomic.Bool
		stop    atomic.Bool
		wg      sync.WaitGroup
		lats    = make([][]int64, conc)
	)
	for w := range conc {
		wg.Go(func() {
			own := make([]int64, 0, 4096)
			for i := w; !stop.Load(); i += conc {
				m := measure.Load()
				t0 := time.Now()
				r.call(w, i, m)
				if m {
					own = append(own, int64(time.Since(t0)))
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
	res := summarize("rls", conc, &r.k, slices.Concat(lats...), elapsed)
	res.DescriptorsPerSec = res.PerSec * rlsDescriptors
	return res
}

// rlsOpenLoad is the open loop (-rate): requests arrive at rate per second (Poisson or evenly
// spaced), at most conc outstanding, each latency timed from its intended send time
// (openLoop). decisions_per_sec is the measured arrivals answered per second of the window.
func rlsOpenLoad(cfg client.Config, domain, prefix string, keys, conc int, rate float64, poisson bool, warmup, dur time.Duration) Result {
	if rate <= 0 {
		fail(fmt.Errorf("-rate %v: use a positive number of requests per second", rate))
	}
	r, closeAll := newRLSCaller(cfg, domain, prefix, keys)
	defer closeAll()
	st := openLoop(openLoopConfig{Rate: rate, Poisson: poisson, Concurrency: conc, Warmup: warmup, Duration: dur,
		Drain: 2 * time.Second, Seed: uint64(time.Now().UnixNano())},
		func(i int64, measured bool) { r.call(int(i), int(i), measured) })
	res := summarize("rls-open", conc, &r.k, st.Lats, dur)
	res.DescriptorsPerSec = res.PerSec * rlsDescriptors
	res.Rate, res.Intended, res.Late, res.Abandoned, res.MaxQueued = rate, st.Intended, st.Late, st.Abandoned, st.MaxQueued
	return res
}
