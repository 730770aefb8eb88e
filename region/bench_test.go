package region_test

// make bench-regions (issue 13): in-process clusters (a global one and two regional ones, one
// node each: real Raft, BoltDB, gRPC over loopback), results in bench/results/regions.json.
// Skipped unless QUOTAD_BENCH_REGIONS_OUT names the output file.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/region"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

const benchLimits = `
domain: bench
rate_limit: {unit: second, requests_per_unit: 100, burst: 100, scope: global}
shares: {lease: 6s, reserve_percent: 1, fallback_rate: 20}
`

const (
	benchR     = 100.0
	benchB     = 100.0
	benchLease = 6 * time.Second
)

// pacer offers rate requests per second to c (each its own goroutine, so a slow answer does
// not slow the offer) and records admission times.
type pacer struct {
	mu       sync.Mutex
	admitted []time.Time
	lat      []time.Duration
	rate     atomic.Int64 // per second
}

func (p *pacer) run(ctx context.Context, c *client.Client, domain string) {
	for ctx.Err() == nil {
		r := p.rate.Load()
		if r <= 0 {
			time.Sleep(10 * time.Millisecond)
			continue
		}
		time.Sleep(time.Second / time.Duration(r))
		go func() {
			start := time.Now()
			_, err := c.Allow(ctx, client.Request{Domain: domain, Cost: 1})
			el := time.Since(start)
			p.mu.Lock()
			defer p.mu.Unlock()
			if ctx.Err() != nil {
				return
			}
			p.lat = append(p.lat, el)
			if err == nil {
				p.admitted = append(p.admitted, time.Now())
			}
		}()
	}
}

func (p *pacer) snapshot() ([]time.Time, []time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.admitted), slices.Clone(p.lat)
}

func p99ms(l []time.Duration) float64 {
	if len(l) == 0 {
		return 0
	}
	slices.Sort(l)
	return float64(l[len(l)*99/100].Microseconds()) / 1000
}

// worstWindow returns the largest excess of admissions over B + R·w(1+ρ) over every window of
// length w in ws (negative: inside the bound).
func worstWindow(ts []time.Time, ws []time.Duration) float64 {
	slices.SortFunc(ts, func(a, b time.Time) int { return a.Compare(b) })
	worst := -1e18
	for _, w := range ws {
		j := 0
		for i := range ts {
			for ts[i].Sub(ts[j]) > w {
				j++
			}
			worst = max(worst, float64(i-j+1)-(benchB+benchR*w.Seconds()*(1+1e-3)))
		}
	}
	return worst
}

func countIn(ts []time.Time, from, to time.Time) int {
	n := 0
	for _, t := range ts {
		if !t.Before(from) && t.Before(to) {
			n++
		}
	}
	return n
}

func TestBenchRegions(t *testing.T) {
	out := os.Getenv("QUOTAD_BENCH_REGIONS_OUT")
	if out == "" {
		t.Skip("set QUOTAD_BENCH_REGIONS_OUT (make bench-regions)")
	}
	T := 60 * time.Second
	if s, err := strconv.Atoi(os.Getenv("QUOTAD_BENCH_REGIONS_SECONDS")); err == nil && s > 0 {
		T = time.Duration(s) * time.Second
	}
	// The global outage of step 3: 60 s as issue 13 asks (10 lease terms), at least 3 terms.
	outage := 60 * time.Second
	if s, err := strconv.Atoi(os.Getenv("QUOTAD_BENCH_REGIONS_OUTAGE_SECONDS")); err == nil && s > 0 {
		outage = max(time.Duration(s)*time.Second, 3*benchLease)
	}
	global := rpctest.Start(t, 1, benchLimits)
	var (
		regions []*rpctest.Cluster
		clients []*client.Client
		wan     []*atomic.Bool
	)
	for i := range 2 {
		on := &atomic.Bool{}
		g := client.Config{Addrs: global.Addrs(), Insecure: true, DialOptions: []grpc.DialOption{wanDialer(on)}}
		name := fmt.Sprintf("r%d", i)
		rc := rpctest.Start(t, 1, benchLimits, func(_ int, c *rpc.AgentConfig) { c.Region = region.Agent(name, g) })
		c, err := client.New(client.Config{Addrs: rc.Addrs(), Insecure: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		regions, clients, wan = append(regions, rc), append(clients, c), append(wan, on)
	}
	load := func() string { b, _ := os.ReadFile("/proc/loadavg"); return strings.TrimSpace(string(b)) }
	res := map[string]any{"loadavg_start": load(), "scenario": fmt.Sprintf("in-process: a global cluster and two regional ones (1 node each), R=%v/s B=%v, lease %v, demand 1.5R split 80/20 for %v then flipped for %v", benchR, benchB, benchLease, T/2, T/2)}

	// 1. Bound, utilization, flip.
	ctx, cancel := context.WithCancel(context.Background())
	var ps [2]pacer
	ps[0].rate.Store(int64(1.5 * benchR * 0.8))
	ps[1].rate.Store(int64(1.5 * benchR * 0.2))
	for i := range ps {
		go ps[i].run(ctx, clients[i], "bench")
	}
	start := time.Now()
	time.Sleep(T / 2)
	flip := time.Now()
	ps[0].rate.Store(int64(1.5 * benchR * 0.2))
	ps[1].rate.Store(int64(1.5 * benchR * 0.8))
	time.Sleep(T / 2)
	end := time.Now()
	cancel()
	time.Sleep(100 * time.Millisecond)
	a0, l0 := ps[0].snapshot()
	a1, l1 := ps[1].snapshot()
	all := append(slices.Clone(a0), a1...)
	worst := worstWindow(all, []time.Duration{time.Second, 5 * time.Second, 10 * time.Second, end.Sub(start)})
	steady := start.Add(benchLease) // after the first term: shares have followed demand
	util := float64(countIn(all, steady, end)) / (benchR * end.Sub(steady).Seconds())
	// Flip: the busy region (1) reaches ≥ 90 % of its share, in 1 s bins. Its share: the
	// lendable rate (R less the reserve, max(reserve_percent, 2 × the largest cost) = 2/s)
	// less what region 0 now needs (its 30/s attempted; needs are filled before headroom,
	// command version 4).
	share := benchR - 2 - 1.5*benchR*0.2
	converge := -1.0
	// Sustained: every 1 s bin of the next 3 s at ≥ 90 % (the first bins after the flip can
	// pass on the tokens region 1 saved while quiet, not on its share).
	for s := flip; s.Before(end.Add(-4 * time.Second)); s = s.Add(250 * time.Millisecond) {
		ok := true
		for k := range 3 {
			b := s.Add(time.Duration(k) * time.Second)
			ok = ok && float64(countIn(a1, b, b.Add(time.Second))) >= 0.9*share
		}
		if ok {
			converge = s.Add(time.Second).Sub(flip).Seconds()
			break
		}
	}
	res["admitted_total"] = len(all)
	res["bound_worst_window_excess"] = worst
	res["bound_ok"] = worst <= 0
	res["global_utilization"] = util
	res["flip_converge_s"] = converge
	res["flip_target_share_per_s"] = share
	res["flip_converge_ok"] = converge >= 0 && converge <= 2*benchLease.Seconds()
	for i, rc := range regions {
		if h, _ := rc.Agent(rc.Leader()).Region().(*region.Holder); h != nil && len(h.Shares()) > 0 {
			res[fmt.Sprintf("share_rate_at_end_r%d", i)] = h.Shares()[0].Rate
		}
	}
	res["loaded_p99_ms"] = p99ms(append(l0, l1...))
	t.Logf("bound worst excess %.1f, utilization %.3f, flip converge %.1fs", worst, util, converge)

	// 2. Regional decision latency with and without 100 ms (50–150) on the global links, at
	// a light load (40/s per region, inside the shares), both regions measured at the same
	// time (the machine's load hits both alike): first neither delayed (calibration), then
	// region 0's global links delayed and region 1's not.
	var maxDelayed float64
	lat := func() (float64, float64) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var p [2]pacer
		var wg sync.WaitGroup
		for i := range p {
			p[i].rate.Store(40)
			wg.Add(1)
			go func() { defer wg.Done(); p[i].run(ctx, clients[i], "bench") }()
		}
		wg.Wait()
		time.Sleep(100 * time.Millisecond)
		_, l0 := p[0].snapshot()
		_, l1 := p[1].snapshot()
		if len(l0) > 0 {
			maxDelayed = float64(slices.Max(l0).Microseconds()) / 1000
		}
		return p99ms(l0), p99ms(l1)
	}
	c0, c1 := lat()
	wan[0].Store(true)
	time.Sleep(benchLease / 3) // region 0's renewals cross the "WAN" now
	delayed, base := lat()
	wan[0].Store(false)
	res["regional_p99_ms"] = base
	res["regional_p99_ms_with_wan_delay"] = delayed
	res["regional_p99_ratio_with_wan_delay"] = delayed / max(base, 1e-3)
	res["regional_p99_ratio_calibration_no_delay"] = c0 / max(c1, 1e-3)
	// A decision that crossed to the global cluster would take ≥ 50 ms.
	res["regional_max_ms_with_wan_delay"] = maxDelayed
	res["regional_no_hop_ok"] = maxDelayed < 50
	t.Logf("regional p99: region 0 %.2f ms with 50–150 ms on its global links, region 1 %.2f ms without (calibration, neither delayed: %.2f / %.2f ms)", delayed, base, c0, c1)

	// 3. Global cluster down for the outage (60 s): the regions decide until their grants end, then at
	// the fallback slices (20/s in total); after a restart, shares are local again within 2
	// terms.
	ctx, cancel = context.WithCancel(context.Background())
	var down [2]pacer
	for i := range down {
		down[i].rate.Store(100)
		go down[i].run(ctx, clients[i], "bench")
	}
	time.Sleep(benchLease)
	global.Kill(0)
	killed := time.Now()
	time.Sleep(outage)
	global.Restart(0)
	restarted := time.Now()
	var recovered float64 = -1
	clustertest.Eventually(t, 4*benchLease, func() error {
		for i, rc := range regions {
			h, _ := rc.Agent(rc.Leader()).Region().(*region.Holder)
			if h == nil || !h.Shares()[0].Local || h.Shares()[0].Status != "lent" {
				return fmt.Errorf("region %d has no share yet", i)
			}
		}
		recovered = time.Since(restarted).Seconds()
		return nil
	})
	time.Sleep(2 * time.Second)
	cancel()
	time.Sleep(100 * time.Millisecond)
	d0, _ := down[0].snapshot()
	d1, _ := down[1].snapshot()
	dall := append(d0, d1...)
	onShare := countIn(dall, killed, killed.Add(benchLease/2))
	fallbackFrom := killed.Add(benchLease + time.Second)
	fallbackSecs := restarted.Sub(fallbackFrom).Seconds()
	fallbackRate := float64(countIn(dall, fallbackFrom, restarted)) / fallbackSecs
	res["global_down_s"] = restarted.Sub(killed).Seconds()
	res["global_down_admitted_on_share_first_half_term"] = onShare
	res["global_down_fallback_rate_per_s"] = fallbackRate
	res["global_down_recovered_s"] = recovered
	res["global_down_ok"] = onShare > 0 && fallbackRate > 0 && fallbackRate <= 20*1.2+benchB/fallbackSecs && recovered >= 0 && recovered <= 2*benchLease.Seconds()
	t.Logf("global down: %d admitted in the first half term, fallback %.1f/s (total 20/s), shares back %.1fs after the restart", onShare, fallbackRate, recovered)

	res["loadavg_end"] = load()
	b, _ := json.MarshalIndent(res, "", "  ")
	if err := os.WriteFile(out, append(b, '\n'), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s", b)
}
