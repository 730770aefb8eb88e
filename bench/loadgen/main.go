// Command loadgen is the load-generator process of `make bench`: it drives a quotad cluster
// through the Go client library (client.Client, with its request batching) and prints one JSON
// object with what it measured on stdout. It never starts or stops servers; bench/run does.
//
// Modes:
//
//	load      -concurrency goroutines call Allow back to back for -duration (after -warmup);
//	          reports decisions/s and latency percentiles of every decision.
//	populate  decides -n admissions, one per distinct descriptor value (tenant=t0000000 ...),
//	          from -concurrency goroutines, so the cluster ends up holding -n active buckets.
//	rls       -concurrency goroutines call Envoy's ShouldRateLimit back to back, as an Envoy
//	          fleet does (one RPC per request, no client batching, spread over every node):
//	          each request carries envoy.yaml's three descriptors (route, tenant,
//	          tenant+consumer); reports requests/s (decisions_per_sec), descriptors/s and
//	          latency percentiles (rls.go). With -rate N it is an open loop instead: N
//	          requests/s arrive (Poisson, or evenly spaced with -arrivals uniform) whatever
//	          the answers do, at most -concurrency outstanding; latency runs from each
//	          request's intended send time (openloop.go), and late/abandoned count the
//	          arrivals that found every sender busy / were never sent.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"runtime/pprof"
	"runtime/trace"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quotad/quotad/client"
)

// Result is what loadgen prints; bench/run parses it.
type Result struct {
	Mode         string  `json:"mode"`
	Concurrency  int     `json:"concurrency"`
	Decisions    int64   `json:"decisions"`
	Admitted     int64   `json:"admitted"`
	Denied       int64   `json:"denied"`
	Errors       int64   `json:"errors"`
	FirstError   string  `json:"first_error,omitempty"`
	Seconds      float64 `json:"seconds"`
	PerSec       float64 `json:"decisions_per_sec"`
	P50Ms        float64 `json:"p50_ms"`
	P99Ms        float64 `json:"p99_ms"`
	P999Ms       float64 `json:"p999_ms"`
	MaxMs        float64 `json:"max_ms"`
	RPCs         uint64  `json:"rpcs"`
	ClientRetrys uint64  `json:"client_retries"`
	// Batches the client formed, and how many of them it held open for the batch window
	// because another was in flight (warmup included).
	Batches     uint64 `json:"batches"`
	BatchesHeld uint64 `json:"batches_held"`
	// rls mode: descriptors decided per second (3 per request).
	DescriptorsPerSec float64 `json:"descriptors_per_sec,omitempty"`
	// rls open loop (-rate): the offered rate, the measured arrivals, those due while every
	// sender was busy, those never sent (still queued 2 s after the window), and the most
	// arrivals waiting for a sender at once.
	Rate      float64 `json:"rate,omitempty"`
	Intended  int64   `json:"intended,omitempty"`
	Late      int64   `json:"late,omitempty"`
	Abandoned int64   `json:"abandoned,omitempty"`
	MaxQueued int64   `json:"max_queued,omitempty"`
}

func main() {
	var (
		addrs       = flag.String("addrs", "", "comma-separated gRPC addresses of the nodes")
		mode        = flag.String("mode", "load", "load or populate")
		concurrency = flag.Int("concurrency", 64, "goroutines calling Allow")
		duration    = flag.Duration("duration", 5*time.Second, "measured time (load)")
		warmup      = flag.Duration("warmup", time.Second, "unmeasured time before measuring (load)")
		domain      = flag.String("domain", "bench", "limits domain")
		keys        = flag.Int("keys", 1000, "distinct tenant values the load cycles through")
		prefix      = flag.String("prefix", "t", "tenant value prefix")
		n           = flag.Int("n", 1_000_000, "admissions (populate)")
		window      = flag.Duration("batch-window", 0, "client batch window (0: the client's default)")
		maxBatch    = flag.Int("batch-max", 0, "client batch size cap (0: the client's default)")
		noBatch     = flag.Bool("no-batch", false, "disable client batching")
		cpuProfile  = flag.String("cpuprofile", "", "write the load generator's CPU profile to this file")
		traceFile   = flag.String("trace", "", "write the load generator's execution trace to this file")
		rate        = flag.Float64("rate", 0, "rls: open loop at this many requests/s (0: closed loop)")
		arrivals    = flag.String("arrivals", "poisson", "rls -rate: poisson or uniform arrivals")
	)
	flag.Parse()
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			fail(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fail(err)
		}
		defer pprof.StopCPUProfile()
	}
	if *traceFile != "" {
		f, err := os.Create(*traceFile)
		if err != nil {
			fail(err)
		}
		if err := trace.Start(f); err != nil {
			fail(err)
		}
		defer trace.Stop()
	}
	cfg := client.DefaultConfig(strings.Split(*addrs, ",")...)
	cfg.LoadEnv() // credentials: QUOTAD_TOKEN, QUOTAD_CACERT, QUOTAD_CLIENT_CERT, QUOTAD_CLIENT_KEY
	if *window > 0 {
		cfg.Batch.Window = *window
	}
	if *maxBatch > 0 {
		cfg.Batch.MaxSize = *maxBatch
	}
	cfg.Batch.Disabled = *noBatch
	c, err := client.New(cfg)
	if err != nil {
		fail(err)
	}
	defer c.Close()

	var res Result
	if *mode == "rls" {
		switch {
		case *arrivals != "poisson" && *arrivals != "uniform":
			fail(fmt.Errorf("-arrivals %q: use poisson or uniform", *arrivals))
		case *rate > 0:
			res = rlsOpenLoad(cfg, *domain, *prefix, *keys, *concurrency, *rate, *arrivals == "poisson", *warmup, *duration)
		case *rate < 0:
			fail(fmt.Errorf("-rate %v: use a positive number of requests per second, or 0 for the closed loop", *rate))
		default:
			res = rlsLoad(cfg, *domain, *prefix, *keys, *concurrency, *warmup, *duration)
		}
		if err := json.NewEncoder(os.Stdout).Encode(res); err != nil {
			fail(err)
		}
		return
	}
	switch *mode {
	case "load":
		res = load(c, *domain, *prefix, *keys, *concurrency, *warmup, *duration)
	case "populate":
		res = populate(c, *domain, *prefix, *n, *concurrency)
	default:
		fail(fmt.Errorf("unknown -mode %q", *mode))
	}
	st := c.Stats()
	res.RPCs, res.ClientRetrys, res.Batches, res.BatchesHeld = st.RPCs, st.Retries, st.Batches, st.BatchesHeld
	if err := json.NewEncoder(os.Stdout).Encode(res); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "loadgen:", err)
	os.Exit(1)
}

// counters are shared by the workers of one run.
type counters struct {
	admitted, denied, errors atomic.Int64
	firstErr                 atomic.Value
}

func (k *counters) record(d client.Decision, err error) {
	switch {
	case err == nil:
		k.admitted.Add(1)
	case d.Reason != "" && d.Reason != client.ReasonInvalid && d.Reason != client.ReasonUnknownDomain:
		k.denied.Add(1)
	default:
		k.errors.Add(1)
		k.firstErr.CompareAndSwap(nil, err.Error())
	}
}

func load(c *client.Client, domain, prefix string, keys, conc int, warmup, dur time.Duration) Result {
	tenants := make([]string, keys)
	for i := range tenants {
		tenants[i] = fmt.Sprintf("%s%d", prefix, i)
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
			req := client.Request{Domain: domain, Descriptors: []client.Entry{{Key: "tenant"}}}
			own := make([]int64, 0, 4096)
			for i := w; !stop.Load(); i += conc {
				req.Descriptors[0].Value = tenants[i%keys]
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				t0 := time.Now()
				d, err := c.Allow(ctx, req)
				took := time.Since(t0)
				cancel()
				if measure.Load() {
					k.record(d, err)
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
	return summarize("load", conc, &k, slices.Concat(lats...), elapsed)
}

func populate(c *client.Client, domain, prefix string, n, conc int) Result {
	var (
		k    counters
		next atomic.Int64
		wg   sync.WaitGroup
		lats = make([][]int64, conc)
	)
	start := time.Now()
	for w := range conc {
		wg.Go(func() {
			req := client.Request{Domain: domain, Descriptors: []client.Entry{{Key: "tenant"}}}
			var own []int64
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					break
				}
				req.Descriptors[0].Value = fmt.Sprintf("%s%07d", prefix, i)
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				t0 := time.Now()
				d, err := c.Allow(ctx, req)
				own = append(own, int64(time.Since(t0)))
				cancel()
				k.record(d, err)
			}
			lats[w] = own
		})
	}
	wg.Wait()
	return summarize("populate", conc, &k, slices.Concat(lats...), time.Since(start))
}

func summarize(mode string, conc int, k *counters, lats []int64, elapsed time.Duration) Result {
	slices.Sort(lats)
	pct := func(p float64) float64 {
		if len(lats) == 0 {
			return 0
		}
		i := int(p * float64(len(lats)))
		if i >= len(lats) {
			i = len(lats) - 1
		}
		return float64(lats[i]) / 1e6
	}
	r := Result{
		Mode: mode, Concurrency: conc,
		Admitted: k.admitted.Load(), Denied: k.denied.Load(), Errors: k.errors.Load(),
		Seconds: elapsed.Seconds(),
		P50Ms:   pct(0.50), P99Ms: pct(0.99), P999Ms: pct(0.999), MaxMs: pct(1),
	}
	if e, ok := k.firstErr.Load().(string); ok {
		r.FirstError = e
	}
	r.Decisions = r.Admitted + r.Denied
	r.PerSec = float64(r.Decisions) / elapsed.Seconds()
	return r
}
