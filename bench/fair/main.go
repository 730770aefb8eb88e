// Command fair is `make bench-fair`: it builds quotad, starts a real 3-node cluster of
// separate agent processes and runs the fair-sharing scenarios of issue 4 against it through
// the client library (client.Wait, which queues on the leader's fair scheduler), then writes
// bench/results/fairness.json.
//
// Run it from the module root: go run ./bench/fair [-scale 1].
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/proccluster"
	"github.com/quotad/quotad/rpc"
)

const limits = `domain: seed
rate_limit: {unit: second, requests_per_unit: 10}
descriptors:
  - key: tenant
---
domain: failover
rate_limit: {unit: second, requests_per_unit: 10}
descriptors:
  - key: tenant
---
domain: weighted
rate_limit: {unit: second, requests_per_unit: 20, burst: 2}
descriptors:
  - key: tenant
    value: t1
    weight: 1
  - key: tenant
    value: t2
    weight: 1
  - key: tenant
    value: t3
    weight: 2
  - key: tenant
---
domain: classes
rate_limit: {unit: second, requests_per_unit: 10}
work_classes:
  - {name: interactive, reserve_percent: 10}
  - name: backfill
descriptors:
  - key: tenant
---
domain: endpoints
# A pause of one endpoint ends exactly at the provider's Retry-After; requests refused as
# paused are told to come back at its end plus their share of this window.
resume_jitter: 2s
descriptors:
  - key: endpoint
    rate_limit: {unit: second, requests_per_unit: 20}
`

// Report is bench/results/fairness.json: the keys of issue 4 plus pause_resume_spread_ms (a
// key whose scenario could not run is null).
type Report struct {
	SeedSmallTenantWaitP99Ms     *float64  `json:"seed_small_tenant_wait_p99_ms"`
	SeedUtilization              *float64  `json:"seed_utilization"`
	WeightedShares               []float64 `json:"weighted_shares"`
	LoneTenantShare              *float64  `json:"lone_tenant_share"`
	InteractiveWaitP99Ms         *float64  `json:"interactive_wait_p99_ms"`
	AIMD429Rate                  *float64  `json:"aimd_429_rate"`
	AIMDUtilization              *float64  `json:"aimd_utilization"`
	PauseOtherEndpointsRateRatio *float64  `json:"pause_other_endpoints_rate_ratio"`
	FailoverSmallTenantWaitMaxMs *float64  `json:"failover_small_tenant_wait_max_ms"`
	// RateSweep is issue 16's sweep of burst-1 buckets from 10 to 10,000 tokens/s.
	RateSweep []SweepPoint `json:"rate_sweep"`
	// AIMDUtilizationRuns lists the AIMD scenario's utilization per run with -aimd-runs N > 1
	// (each run on a fresh domain of the same cluster; AIMD429Rate and AIMDUtilization are
	// the first run's), to 4 digits. Each run is its own minute of real time against a provider
	// of its own, but on a quiet machine the runs retrace one trajectory: every run starts at the
	// ceiling, the decreases come when the provider's burst runs dry (deterministic at a given
	// rate) and the increases every stable_window after them, so the same 30 s of the same
	// sawtooth is measured each time: 0.912 to 3 digits (1,641 or 1,642 of 1,800 requests) in
	// 16 of the 20 runs committed in fairness.json so far. Under load they differ (0.852, 0.603,
	// 0.709 at load 14-17, session 8).
	AIMDUtilizationRuns []float64 `json:"aimd_utilization_runs,omitempty"`
	// PauseResumeSpreadMs is, in the pause scenario, p90 − p10 of the paused endpoint's
	// workers' first re-admission after the pause ended (see pause).
	PauseResumeSpreadMs *float64 `json:"pause_resume_spread_ms"`
}

func ptr(f float64) *float64 { return &f }

var scale = flag.Float64("scale", 1, "multiplies every scenario's duration")

// identityWaiters is the agents' --max-waiters-per-identity. Every worker of the bench, of
// every tenant, uses the cluster's one client certificate — one identity, where real tenants
// have a credential each — and the agent's default (a quarter of --max-waiters-per-domain:
// 2,500) then capped all tenants together: at 10,000/s, rate_sweep's 4,000 heavy workers got
// 22,573 too_many_waiters refusals in 10 s, the small tenants among them, and the bucket
// idled whenever the 2,500 were all in flight (utilization 0.70, A:B 2.47, small p99 1.6 s).
var identityWaiters = flag.Int("max-waiters-per-identity", rpc.DefaultMaxWaitersPerDomain,
	"the agents' --max-waiters-per-identity (0: the agent's default, a quarter of --max-waiters-per-domain)")

// identityStreams is the agents' --max-streams-per-identity: the bench's clients (up to ~20 in
// rate_sweep at 10,000/s, each a worker process's one stream) all use the one certificate, so
// the agent's default (16) would send some of them unary and change what is measured.
var identityStreams = flag.Int("max-streams-per-identity", 1000,
	"the agents' --max-streams-per-identity (0: the agent's default)")

func dur(d time.Duration) time.Duration { return time.Duration(float64(d) * *scale) }

func main() {
	out := flag.String("out", "bench/results/fairness.json", "JSON report path")
	keep := flag.Bool("keep", false, "keep the cluster's data dirs and logs")
	only := flag.String("only", "", "run one scenario: seed, weighted, lone, interactive, pause, aimd, failover, rate_sweep")
	flag.Parse()
	// Every way out — main returning, check failing on any goroutine, SIGINT or SIGTERM, a
	// panic of main's goroutine — runs the cleanups: the agents are processes of their own and
	// outlive this one otherwise (an orphaned cluster kept two cores busy and, started under
	// flock without -o, held /work/bench.lock).
	defer runCleanups()
	defer func() {
		if r := recover(); r != nil {
			runCleanups()
			panic(r)
		}
	}()
	go cleanupOnSignal()
	dir, err := os.MkdirTemp("", "quotad-bench-fair-")
	check(err)
	if *keep {
		atExit(func() { logf("kept %s (node logs: node*.log)", dir) })
	} else {
		atExit(func() { os.RemoveAll(dir) })
	}
	logf("building quotad in %s", dir)
	bin, err := proccluster.Build(".", dir)
	check(err)
	lf := filepath.Join(dir, "limits.yaml")
	check(os.WriteFile(lf, []byte(limits+"---\n"+aimdLimits()+sweepLimits()), 0o644))
	var extra []string
	if *identityWaiters > 0 {
		extra = []string{"--max-waiters-per-identity", fmt.Sprint(*identityWaiters)}
	}
	if *identityStreams > 0 {
		extra = append(extra, "--max-streams-per-identity", fmt.Sprint(*identityStreams))
	}
	c, err := proccluster.Start(proccluster.Config{Binary: bin, Dir: dir, Nodes: 3, LimitsFile: lf, ExtraArgs: extra})
	check(err) // Start kills the nodes it started before failing
	atExit(c.KillAll)
	_, err = c.WaitLeader(30 * time.Second)
	check(err)

	var rep Report
	want := func(s string) bool { return *only == "" || *only == s }
	if want("seed") {
		p99, _, util := seed(c, "seed", dur(25*time.Second), false)
		rep.SeedSmallTenantWaitP99Ms, rep.SeedUtilization = ptr(p99), ptr(util)
		logf("seed: B/C wait p99 %.0f ms, utilization %.3f", p99, util)
	}
	if want("weighted") {
		rep.WeightedShares = weighted(c, []string{"t1", "t2", "t3"}, dur(30*time.Second))
		logf("weighted 1/1/2: shares %v", rep.WeightedShares)
	}
	if want("lone") {
		s := weighted(c, []string{"t1"}, dur(10*time.Second))
		rep.LoneTenantShare = ptr(s[0])
		logf("lone tenant: %.3f of capacity", s[0])
	}
	if want("interactive") {
		p99 := interactive(c, dur(25*time.Second))
		rep.InteractiveWaitP99Ms = ptr(p99)
		logf("interactive under backfill flood: wait p99 %.0f ms", p99)
	}
	var failed []string
	target := func(ok bool, format string, args ...any) {
		verdict := "ok"
		if !ok {
			verdict = "MISSED"
			failed = append(failed, fmt.Sprintf(format, args...))
		}
		logf("target %s: "+format, append([]any{verdict}, args...)...)
	}
	if want("pause") {
		r, spread := pause(c, dur(5*time.Second))
		if r >= 0 {
			rep.PauseOtherEndpointsRateRatio = ptr(r)
			target(r >= 0.95, "paused endpoint: the others keep %.3f of their rate (>= 0.95)", r)
		}
		if spread >= 0 {
			rep.PauseResumeSpreadMs = ptr(spread)
			floor := pauseSpreadFraction * float64(pauseJitter/time.Millisecond)
			target(spread >= floor, "resumption spread p10..p90 %.0f ms (>= %.2f x resume_jitter %v = %.0f ms)",
				spread, pauseSpreadFraction, pauseJitter, floor)
		}
		logf("pause of one endpoint: others keep %.3f of their rate; resumption spread %.0f ms", r, spread)
	}
	if want("aimd") {
		for run := 1; run <= max(*aimdRuns, 1); run++ {
			conv, steady := aimd(c, aimdDomainName(run), dur(30*time.Second), dur(30*time.Second))
			if run == 1 {
				rep.AIMD429Rate, rep.AIMDUtilization = ptr(round4(steady.rate429())), ptr(round3(steady.utilization()))
			}
			if *aimdRuns > 1 {
				rep.AIMDUtilizationRuns = append(rep.AIMDUtilizationRuns, round4(steady.utilization()))
			}
			target(steady.sent > 0 && steady.rate429() < 0.01, "aimd run %d: 429s %.2f%% of requests after 30 s (< 1%%; first 30 s: %.2f%%)",
				run, 100*steady.rate429(), 100*conv.rate429())
			target(steady.utilization() >= 0.85, "aimd run %d: %.1f%% of the hidden capacity used after 30 s (>= 85%%; first 30 s: %.1f%%)",
				run, 100*steady.utilization(), 100*conv.utilization())
		}
	}
	if want("rate_sweep") {
		rep.RateSweep = rateSweep(c)
		for _, p := range rep.RateSweep {
			target(p.Utilization >= 0.98, "rate_sweep %d/s: utilization %.3f (>= 0.98)", p.Rate, p.Utilization)
			target(math.Abs(p.HeavyShareRatio-1) <= 0.05, "rate_sweep %d/s: heavy tenants' share ratio %.3f (1.00 +- 0.05)", p.Rate, p.HeavyShareRatio)
			target(p.SmallWaitP99Ms <= p.TargetMs, "rate_sweep %d/s: small-tenant wait p99 %.1f ms (<= 2 intervals + commit p99 = %.1f ms; %s dominates)",
				p.Rate, p.SmallWaitP99Ms, p.TargetMs, p.Dominant)
			target(p.SmallWaitP99Ms <= p.TargetDecisionMs, "rate_sweep %d/s: small-tenant wait p99 %.1f ms (<= 2 intervals + a plain decision's p99 beside it = %.1f ms)",
				p.Rate, p.SmallWaitP99Ms, p.TargetDecisionMs)
		}
	}
	if want("failover") {
		_, mx, _ := seed(c, "failover", dur(20*time.Second), true)
		rep.FailoverSmallTenantWaitMaxMs = ptr(mx)
		logf("failover: B/C max wait %.0f ms", mx)
	}
	if len(failed) > 0 {
		logf("%d target(s) missed: %v", len(failed), failed)
	}
	data, err := json.MarshalIndent(rep, "", "  ")
	check(err)
	check(os.MkdirAll(filepath.Dir(*out), 0o755))
	check(os.WriteFile(*out, append(data, '\n'), 0o644))
	fmt.Println(string(data))
}

func newClient(c *proccluster.Cluster) *client.Client {
	cl, err := client.New(c.ClientConfig())
	check(err)
	return cl
}

// backlog keeps n admissions of tenant waiting until ctx ends, counting admitted ones in
// admitted (only while counting is set).
func backlog(ctx context.Context, cl *client.Client, wg *sync.WaitGroup, n int, req client.Request, admitted *atomic.Int64, counting *atomic.Bool) {
	for range n {
		wg.Go(func() {
			for ctx.Err() == nil {
				wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
				d, err := cl.Wait(wctx, req)
				cancel()
				if err == nil && d.Admitted && counting.Load() {
					admitted.Add(1)
				}
				if err != nil && ctx.Err() == nil {
					time.Sleep(10 * time.Millisecond)
				}
			}
		})
	}
}

// workersPerClient is how many of a tenant's waiting workers share one client (client_id):
// the leader caps the admissions waiting per client_id (--max-waiters-per-client, 1000, since
// 7757cab). With every scenario's workers on one client, seed's 1,000 waiters of A held all
// 1,000 slots and B and C were refused too_many_waiters for seconds (p99 9.8 s, failover
// max 18 s), and in rate_sweep A's and B's 4,000 waiters shared 1,000 slots (A:B 3:1).
// Workers of a tenant are processes of their own in practice; a few hundred per client is
// what a worker fleet's client looks like.
const workersPerClient = 250

// backlogClients is backlog over clients of their own, workersPerClient workers each. The
// returned function closes them (after wg is done).
func backlogClients(ctx context.Context, c *proccluster.Cluster, wg *sync.WaitGroup, n int, req client.Request, admitted *atomic.Int64, counting *atomic.Bool) func() {
	var cls []*client.Client
	for left := n; left > 0; left -= workersPerClient {
		cl := newClient(c)
		cls = append(cls, cl)
		backlog(ctx, cl, wg, min(left, workersPerClient), req, admitted, counting)
	}
	return func() {
		for _, cl := range cls {
			cl.Close()
		}
	}
}

// seed: tenant A keeps 1,000 admissions waiting on a 10/s bucket; B and C each send one at
// random moments. Returns B/C wait p99 and max (ms) and the bucket's utilization. With kill,
// the leader is killed a third of the way in.
func seed(c *proccluster.Cluster, domain string, d time.Duration, kill bool) (p99, mx, util float64) {
	cl := newClient(c)
	defer cl.Close()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var admitted atomic.Int64
	var counting atomic.Bool
	closeA := backlogClients(ctx, c, &wg, 1000, client.Request{Domain: domain, Descriptors: client.Descriptors("tenant", "A")}, &admitted, &counting)
	defer closeA()
	time.Sleep(3 * time.Second) // A's backlog forms; the burst is spent
	var mu sync.Mutex
	var waits []float64
	var small sync.WaitGroup
	stop := time.Now().Add(d)
	for _, t := range []string{"B", "C"} {
		cl := newClient(c) // a small tenant's worker: a client of its own
		defer cl.Close()
		small.Go(func() {
			for time.Now().Before(stop) {
				time.Sleep(time.Duration(300+rand.IntN(900)) * time.Millisecond)
				wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				start := time.Now()
				dd, err := cl.Wait(wctx, client.Request{Domain: domain, Descriptors: client.Descriptors("tenant", t)})
				cancel()
				if err == nil && dd.Admitted {
					admitted.Add(1)
					mu.Lock()
					waits = append(waits, float64(time.Since(start))/float64(time.Millisecond))
					mu.Unlock()
				} else {
					logf("%s: %s: %v %+v", domain, t, err, dd)
				}
			}
		})
	}
	t0 := time.Now()
	counting.Store(true)
	if kill {
		time.Sleep(d / 3)
		if l := c.Leader(ctx); l >= 0 {
			logf("killing the leader node%d", l+1)
			c.Kill(l)
			defer func() { check(c.Start(l)); _, _ = c.WaitLeader(30 * time.Second) }()
		}
	}
	small.Wait()
	counting.Store(false)
	elapsed := time.Since(t0)
	n := admitted.Load()
	cancel()
	wg.Wait()
	slices.Sort(waits)
	return quantile(waits, 0.99), quantile(waits, 1), float64(n) / (10 * elapsed.Seconds())
}

// weighted: each tenant keeps 50 admissions waiting; returns each tenant's share of the
// admissions over d.
func weighted(c *proccluster.Cluster, tenants []string, d time.Duration) []float64 {
	cl := newClient(c)
	defer cl.Close()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var counting atomic.Bool
	counts := make([]atomic.Int64, len(tenants))
	for i, t := range tenants {
		backlog(ctx, cl, &wg, 50, client.Request{Domain: "weighted", Descriptors: client.Descriptors("tenant", t)}, &counts[i], &counting)
	}
	time.Sleep(3 * time.Second)
	counting.Store(true)
	t0 := time.Now()
	time.Sleep(d)
	counting.Store(false)
	el := time.Since(t0)
	cancel()
	wg.Wait()
	out := make([]float64, len(tenants))
	var total int64
	for i := range counts {
		total += counts[i].Load()
	}
	for i := range counts {
		if len(tenants) == 1 {
			out[i] = round3(float64(counts[i].Load()) / (20 * el.Seconds())) // share of capacity
		} else {
			out[i] = round3(float64(counts[i].Load()) / float64(total))
		}
	}
	return out
}

// interactive: a backfill tenant floods a 10/s bucket; an interactive request arrives at
// random moments (about 5 % of the rate). Returns the interactive wait p99 (ms).
func interactive(c *proccluster.Cluster, d time.Duration) float64 {
	cl := newClient(c)
	defer cl.Close()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var bf atomic.Int64
	var counting atomic.Bool
	counting.Store(true)
	backlog(ctx, cl, &wg, 300, client.Request{Domain: "classes", WorkClass: "backfill", Descriptors: client.Descriptors("tenant", "bulk")}, &bf, &counting)
	time.Sleep(3 * time.Second)
	var waits []float64
	stop := time.Now().Add(d)
	for time.Now().Before(stop) {
		time.Sleep(time.Duration(1000+rand.IntN(1000)) * time.Millisecond)
		wctx, cc := context.WithTimeout(ctx, 30*time.Second)
		start := time.Now()
		// Interactive work of a tenant that also has backfill queued: only the reserve helps.
		dd, err := cl.Wait(wctx, client.Request{Domain: "classes", WorkClass: "interactive", Descriptors: client.Descriptors("tenant", "bulk")})
		cc()
		if err == nil && dd.Admitted {
			waits = append(waits, float64(time.Since(start))/float64(time.Millisecond))
		}
	}
	cancel()
	wg.Wait()
	logf("interactive: %d requests; backfill admitted %d", len(waits), bf.Load())
	slices.Sort(waits)
	return quantile(waits, 0.99)
}

// The pause scenario's resumption check.
const (
	// pauseJitter is domain endpoints' resume_jitter (limits).
	pauseJitter = 2 * time.Second
	// pauseSpreadFraction: the p10..p90 spread of re-admissions must cover at least this share
	// of the jitter window. Re-admissions uniform over [0, window) give 0.8; 0.5 leaves room
	// for the sampling error of 20 workers.
	pauseSpreadFraction = 0.5
	// pauseWorkers on the paused endpoint e1, each holding an admission for pauseWork.
	pauseWorkers = 20
	pauseWork    = time.Second
)

// pause: three endpoints at 20/s each, kept busy; a provider 429 with Retry-After 5 s on
// endpoint e1 is reported. Returns the other endpoints' rate during the pause / before it,
// and the spread (ms, p90 − p10) of e1's workers' first re-admission after the pause ended
// (-1 when it could not be measured).
//
// e2 and e3 are kept busy by waiting admissions (client.Wait, queued on the leader). e1's
// workers do not wait on the leader: they decide with Allow, work pauseWork after an
// admission, and after a denial sleep until exactly Decision.RetryAt (a job rescheduled
// durably) — no client-side jitter, so what spreads their return is the cluster's resume
// jitter alone. (Waiters queued on the leader through a pause are released at the bucket's
// pace when it ends instead; the jitter is for requests refused as paused.)
func pause(c *proccluster.Cluster, d time.Duration) (ratio, spreadMs float64) {
	cl := newClient(c)
	defer cl.Close()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var counting atomic.Bool
	counts := make([]atomic.Int64, 3)
	for i := 1; i < 3; i++ {
		backlog(ctx, cl, &wg, 20, client.Request{Domain: "endpoints", Descriptors: client.Descriptors("endpoint", fmt.Sprint("e", i+1))}, &counts[i], &counting)
	}
	readmit := make([]time.Time, pauseWorkers)
	pausedDenials := make([]int, pauseWorkers)
	e1 := client.Request{Domain: "endpoints", Descriptors: client.Descriptors("endpoint", "e1")}
	for i := range pauseWorkers {
		wg.Go(func() {
			sleep := func(t time.Duration) {
				select {
				case <-ctx.Done():
				case <-time.After(t):
				}
			}
			sleep(time.Duration(rand.Int64N(int64(pauseWork))))
			for ctx.Err() == nil {
				rctx, rc := context.WithTimeout(ctx, 5*time.Second)
				dd, err := cl.Allow(rctx, e1)
				rc()
				switch {
				case err == nil && dd.Admitted:
					if pausedDenials[i] > 0 && readmit[i].IsZero() {
						readmit[i] = dd.At
					}
					counts[0].Add(1)
					sleep(pauseWork)
				case errors.Is(err, client.ErrDenied):
					if dd.Reason == client.ReasonPaused {
						pausedDenials[i]++
					}
					sleep(time.Until(dd.RetryAt()))
				default:
					sleep(10 * time.Millisecond)
				}
			}
		})
	}
	time.Sleep(2 * time.Second)
	counting.Store(true)
	time.Sleep(d)
	before := counts[1].Load() + counts[2].Load()
	counts[1].Store(0)
	counts[2].Store(0)
	fctx, fc := context.WithTimeout(ctx, 5*time.Second)
	sent := time.Now()
	res, err := cl.Feedback(fctx, client.Feedback{Domain: "endpoints", Descriptors: client.Descriptors("endpoint", "e1"),
		StatusCode: 429, RetryAfter: 5 * time.Second, Reason: "endpoint_rate_limit"})
	got := time.Now()
	fc()
	if err != nil {
		logf("pause: Feedback failed: %v", err)
		cancel()
		wg.Wait()
		return -1, -1
	}
	// The pause ends PausedFor after the FSM applied the feedback, somewhere between sent and
	// got: take the middle (error at most half the round trip).
	end := sent.Add(got.Sub(sent)/2 + res.PausedFor)
	logf("pause: e1 paused for %v (feedback round trip %v)", res.PausedFor, got.Sub(sent).Round(time.Millisecond))
	time.Sleep(d)
	during := counts[1].Load() + counts[2].Load()
	// Let every paused worker come back: the pause end, the jitter window, some slack.
	time.Sleep(time.Until(end.Add(pauseJitter + 2*pauseWork)))
	cancel()
	wg.Wait()
	ratio = round3(float64(during) / float64(before))

	var rel []float64
	paused, early := 0, 0
	for i := range pauseWorkers {
		if pausedDenials[i] == 0 {
			continue
		}
		paused++
		if readmit[i].IsZero() {
			continue
		}
		ms := float64(readmit[i].Sub(end)) / float64(time.Millisecond)
		if ms < -float64(got.Sub(sent)/time.Millisecond) {
			early++
		}
		rel = append(rel, ms)
	}
	slices.Sort(rel)
	if len(rel) < 5 {
		logf("pause: only %d of %d workers were refused as paused and admitted again; no spread", len(rel), paused)
		return ratio, -1
	}
	p10, p90 := quantile(rel, 0.10), quantile(rel, 0.90)
	logf("pause: %d/%d e1 workers refused as paused, %d re-admitted; first re-admission after the pause end (ms): min %.0f p10 %.0f p50 %.0f p90 %.0f max %.0f; %d before the end",
		paused, pauseWorkers, len(rel), rel[0], p10, quantile(rel, 0.5), p90, rel[len(rel)-1], early)
	return ratio, round3(p90 - p10)
}

func quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return -1
	}
	i := int(q*float64(len(sorted))+0.999999) - 1
	return round3(sorted[min(max(i, 0), len(sorted)-1)])
}

func round3(f float64) float64 { return float64(int64(f*1000+0.5)) / 1000 }

func round4(f float64) float64 { return float64(int64(f*10000+0.5)) / 10000 }

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, time.Now().Format("15:04:05 ")+format+"\n", args...)
}

// check ends the bench on err, from any goroutine, after the cleanups (runCleanups).
func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench-fair:", err)
		runCleanups()
		os.Exit(1)
	}
}

// cleanups run once, last registered first, on every way out of the bench (see main).
var cleanups struct {
	mu   sync.Mutex
	fns  []func()
	done bool
}

// atExit registers fn to run on the bench's way out.
func atExit(fn func()) {
	cleanups.mu.Lock()
	defer cleanups.mu.Unlock()
	cleanups.fns = append(cleanups.fns, fn)
}

// runCleanups runs the registered cleanups once; a concurrent caller (check on another
// goroutine) waits until they are done, so none exits while agents still run.
func runCleanups() {
	cleanups.mu.Lock()
	defer cleanups.mu.Unlock()
	if cleanups.done {
		return
	}
	cleanups.done = true
	for i := len(cleanups.fns) - 1; i >= 0; i-- {
		cleanups.fns[i]()
	}
}

// cleanupOnSignal runs the cleanups and exits on SIGINT or SIGTERM (killed by a timeout, or
// ^C where the agents are not in the terminal's process group).
func cleanupOnSignal() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	s := <-sig
	logf("%v: stopping the cluster", s)
	runCleanups()
	os.Exit(1)
}
