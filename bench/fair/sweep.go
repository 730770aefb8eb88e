package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/proccluster"
	"github.com/quotad/quotad/rpc"
)

// The rate sweep (issue 16): one burst-1 domain per rate; two heavy tenants keep requests
// waiting (A three times as many as B), six small tenants send one request at a time at
// random moments, all through client.Wait. `go run ./bench/fair -only rate_sweep` runs it
// alone; -sweep-rates picks the rates.
var (
	sweepRates   = flag.String("sweep-rates", "10,100,1000,10000", "rate_sweep: the rates (tokens/s), comma-separated")
	sweepMeasure = flag.Duration("sweep-measure", 20*time.Second, "rate_sweep: measured time per rate (rates >= 1000/s use half)")
	sweepProfile = flag.String("cpuprofile", "", "rate_sweep: write the leader's CPU profile over each rate's measured time to FILE.<rate> (its /debug/pprof/profile)")
)

// sweepRatesList parses -sweep-rates.
func sweepRatesList() []int {
	var out []int
	for _, f := range strings.Split(*sweepRates, ",") {
		r, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || r <= 0 || r > 1_000_000 {
			check(fmt.Errorf("-sweep-rates: %q is not a rate in tokens/s (1 to 1000000); e.g. -sweep-rates 10,100,1000,10000", f))
		}
		out = append(out, r)
	}
	return out
}

// sweepLimits is a domain per rate: burst 1, tenants as the per-value level; and a probe
// domain no one contends, whose plain admissions measure a decision's round trip.
func sweepLimits() string {
	var b strings.Builder
	for _, r := range sweepRatesList() {
		fmt.Fprintf(&b, "---\ndomain: sweep%d\nrate_limit: {unit: second, requests_per_unit: %d, burst: 1}\ndescriptors:\n  - key: tenant\n", r, r)
	}
	b.WriteString("---\ndomain: probe\nrate_limit: {unit: second, requests_per_unit: 1000000}\n")
	return b.String()
}

// SweepPoint is one rate of rate_sweep in fairness.json.
type SweepPoint struct {
	Rate        int     `json:"rate"`
	Utilization float64 `json:"utilization"`
	// HeavyShareRatio is A's admissions over B's (max-min fair: 1).
	HeavyShareRatio       float64 `json:"heavy_share_ratio"`
	SmallWaitP99Ms        float64 `json:"small_wait_p99_ms"`
	SmallWaitP99Intervals float64 `json:"small_wait_p99_intervals"`
	SmallRequests         int     `json:"small_requests"`
	// CommitP99Ms is the leader's quotad_raft_commit_seconds p99 over the run (interpolated
	// in its power-of-two buckets); DecisionP99Ms that of a plain admission's round trip on
	// an uncontended domain, measured by a probe beside the load.
	CommitP99Ms   float64 `json:"commit_p99_ms"`
	DecisionP99Ms float64 `json:"decision_p99_ms"`
	// TargetMs is 2 token intervals + CommitP99Ms; Dominant names the larger term.
	TargetMs float64 `json:"target_ms"`
	Dominant string  `json:"dominant"`
	// TargetDecisionMs is 2 token intervals + DecisionP99Ms: the bar read with the commit
	// latency a caller sees (its RPC to the leader, the group commit, raft's commit and the
	// answer), which no admission — scheduled or not — can beat. CommitP99Ms is raft's
	// commit alone, inside the leader.
	TargetDecisionMs float64 `json:"target_decision_ms"`
	// ReleaseHorizonMs is the leader's release horizon (how far ahead of the bucket's next
	// unit grants are released: what a newcomer's grant lands behind), mean of the /debug/fair
	// readings. -1: none read.
	ReleaseHorizonMs float64 `json:"release_horizon_ms"`
	// BBacklogEmptyShare is the share of those readings in which tenant B (the smaller heavy
	// tenant) had no admission waiting: its waiters were all in flight, so it asked for less
	// than its max-min share and A:B above 1 is max-min's answer, not unfairness. -1: none read.
	BBacklogEmptyShare float64 `json:"b_backlog_empty_share"`
	// MomentExchanges is how many held moments newcomers took from grants released ahead
	// of them on the leader over the measured time (/debug/fair; -1: none read).
	MomentExchanges float64 `json:"moment_exchanges"`
	// LoadAvg is the machine's 1-minute load average at the end of this rate's run.
	LoadAvg float64 `json:"load_avg"`
	// BacklogEmptyShare is the share of the leader's quotad_fair_waiting readings (5 a second
	// over the measured time) that found no admission of this domain waiting: every heavy
	// waiter released and in flight (commit, hold, answer, the client's next request), so the
	// bench's backlog, not the scheduler, left the bucket idle then. -1: no reading.
	BacklogEmptyShare float64 `json:"backlog_empty_share"`
	// TooManyWaiters counts the admissions of this domain the leader refused too_many_waiters
	// over the measured time (client.Wait sleeps and asks again): every worker here uses the
	// cluster's one client certificate, whose waiters in a domain --max-waiters-per-identity
	// caps (a quarter of --max-waiters-per-domain, 2,500 by default). -1: unreadable.
	TooManyWaiters float64 `json:"too_many_waiters"`
}

func rateSweep(c *proccluster.Cluster) []SweepPoint {
	var out []SweepPoint
	for _, r := range sweepRatesList() {
		p := sweepOne(c, r)
		out = append(out, p)
		logf("rate_sweep %d/s: utilization %.3f, A:B %.3f, small p99 %.1f ms (%.2f intervals, %d requests), commit p99 %.1f ms, decision p99 %.1f ms, target %.1f ms (%s dominates; with decision p99 %.1f ms), release horizon %.1f ms, %.0f moment exchanges, load %.1f, backlog empty in %.3f of readings (B's: %.3f), %.0f refused too_many_waiters",
			r, p.Utilization, p.HeavyShareRatio, p.SmallWaitP99Ms, p.SmallWaitP99Intervals, p.SmallRequests, p.CommitP99Ms, p.DecisionP99Ms, p.TargetMs, p.Dominant, p.TargetDecisionMs, p.ReleaseHorizonMs, p.MomentExchanges, p.LoadAvg, p.BacklogEmptyShare, p.BBacklogEmptyShare, p.TooManyWaiters)
	}
	return out
}

func sweepOne(c *proccluster.Cluster, rate int) SweepPoint {
	cl := newClient(c)
	defer cl.Close()
	domain := fmt.Sprint("sweep", rate)
	interval := time.Second / time.Duration(rate)
	measure := dur(*sweepMeasure)
	if rate >= 1000 {
		measure /= 2
	}
	// About 200 ms of backlog at high rates, more at low ones: at 10,000/s a grant's round
	// trip (commit, hold, answer, the next request) took 75-150 ms on a loaded machine, and
	// with rate/20 B's waiters were all in flight, not waiting (A:B followed the 3:1 of
	// their numbers, not max-min's 1:1).
	nB := max(50, rate/10)
	nA := 3 * nB
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var counting atomic.Bool
	var a, b, small atomic.Int64
	closeA := backlogClients(ctx, c, &wg, nA, client.Request{Domain: domain, Descriptors: client.Descriptors("tenant", "A")}, &a, &counting)
	defer closeA()
	closeB := backlogClients(ctx, c, &wg, nB, client.Request{Domain: domain, Descriptors: client.Descriptors("tenant", "B")}, &b, &counting)
	defer closeB()
	time.Sleep(3 * time.Second) // the backlogs form

	// An election under load (seen at load 17: leadership lost and regained within 3 s)
	// must not end the bench: wait for the leader.
	leader, err := c.WaitLeader(30 * time.Second)
	check(err)
	hist0 := commitHistogram(c, leader)
	tmw0 := tooManyWaiters(c, leader, domain)
	var mu sync.Mutex
	var waits, probes []float64
	stop := time.Now().Add(measure)
	var others sync.WaitGroup
	// Small tenants: one request at a time, each after a random pause of 50..150 token
	// intervals (at least 5 ms): together about 6 % of the rate, so they rarely meet.
	for i := range 6 {
		cl := newClient(c) // a small tenant's worker: a client of its own
		defer cl.Close()
		others.Go(func() {
			tenant := fmt.Sprint("s", i)
			for {
				pause := time.Duration(50+rand.IntN(100)) * interval
				time.Sleep(max(pause, 5*time.Millisecond))
				if time.Now().After(stop) {
					return
				}
				wctx, wc := context.WithTimeout(ctx, 30*time.Second)
				start := time.Now()
				d, err := cl.Wait(wctx, client.Request{Domain: domain, Descriptors: client.Descriptors("tenant", tenant)})
				took := time.Since(start)
				wc()
				if err == nil && d.Admitted {
					small.Add(1)
					mu.Lock()
					waits = append(waits, float64(took)/float64(time.Millisecond))
					mu.Unlock()
				} else {
					logf("rate_sweep %d/s: small tenant %s: %v %+v", rate, tenant, err, d)
				}
			}
		})
	}
	others.Go(func() { // the probe: 50 plain admissions a second on an uncontended domain
		for time.Now().Before(stop) {
			time.Sleep(20 * time.Millisecond)
			pctx, pc := context.WithTimeout(ctx, 5*time.Second)
			start := time.Now()
			_, err := cl.Allow(pctx, client.Request{Domain: "probe"})
			pc()
			if err == nil {
				mu.Lock()
				probes = append(probes, float64(time.Since(start))/float64(time.Millisecond))
				mu.Unlock()
			}
		}
	})
	t0 := time.Now()
	counting.Store(true)
	var empty, readings atomic.Int64
	var views fairSamples
	others.Go(func() { // the leader's backlog, 5 readings a second
		for time.Now().Before(stop) {
			time.Sleep(200 * time.Millisecond)
			if n, ok := fairWaiting(c, leader, domain); ok {
				readings.Add(1)
				if n == 0 {
					empty.Add(1)
				}
			}
			views.sample(c, leader, domain)
		}
	})
	if *sweepProfile != "" {
		others.Go(func() { leaderProfile(c, leader, time.Until(stop), fmt.Sprint(*sweepProfile, ".", rate)) })
	}
	time.Sleep(time.Until(stop))
	counting.Store(false)
	elapsed := time.Since(t0)
	others.Wait()
	hist1 := commitHistogram(c, leader)
	tmw1 := tooManyWaiters(c, leader, domain)
	cancel()
	wg.Wait()

	slices.Sort(waits)
	slices.Sort(probes)
	logf("rate_sweep %d/s: small waits (ms) p50 %.1f p90 %.1f p99 %.1f max %.1f; A %d B %d small %d",
		rate, quantile(waits, 0.5), quantile(waits, 0.9), quantile(waits, 0.99), quantile(waits, 1), a.Load(), b.Load(), small.Load())
	n := a.Load() + b.Load() + small.Load()
	p := SweepPoint{Rate: rate, Utilization: round3(float64(n) / (float64(rate) * elapsed.Seconds())),
		SmallRequests: len(waits), SmallWaitP99Ms: quantile(waits, 0.99), DecisionP99Ms: quantile(probes, 0.99),
		CommitP99Ms: round3(histQuantile(hist0, hist1, 0.99) * 1000), LoadAvg: loadAvg(), BacklogEmptyShare: -1}
	p.TooManyWaiters = -1
	if tmw0 >= 0 && tmw1 >= 0 {
		p.TooManyWaiters = tmw1 - tmw0
	}
	if n := readings.Load(); n > 0 {
		p.BacklogEmptyShare = round3(float64(empty.Load()) / float64(n))
	}
	if b.Load() > 0 {
		p.HeavyShareRatio = round3(float64(a.Load()) / float64(b.Load()))
	}
	p.ReleaseHorizonMs, p.BBacklogEmptyShare = views.result()
	p.MomentExchanges = views.exchanges()
	iv := float64(interval) / float64(time.Millisecond)
	p.SmallWaitP99Intervals = round3(p.SmallWaitP99Ms / iv)
	p.TargetMs = round3(2*iv + p.CommitP99Ms)
	p.TargetDecisionMs = round3(2*iv + p.DecisionP99Ms)
	p.Dominant = "token intervals"
	if p.CommitP99Ms > 2*iv {
		p.Dominant = "commit"
	}
	return p
}

// leaderProfile writes node i's CPU profile over the next d to file (-cpuprofile).
func leaderProfile(c *proccluster.Cluster, i int, d time.Duration, file string) {
	secs := max(1, int(d/time.Second))
	hc, err := proccluster.HTTPClient(c.Credentials(), time.Duration(secs+30)*time.Second)
	if err != nil {
		check(fmt.Errorf("-cpuprofile: an HTTP client: %w", err))
	}
	resp, err := hc.Get(c.URL(i, fmt.Sprint("/debug/pprof/profile?seconds=", secs)))
	if err != nil {
		check(fmt.Errorf("-cpuprofile: node%d's profile: %w", i+1, err))
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		check(fmt.Errorf("-cpuprofile: node%d's profile: %s", i+1, resp.Status))
	}
	b, err := io.ReadAll(resp.Body)
	if err == nil {
		err = os.WriteFile(file, b, 0o644)
	}
	check(err)
	logf("rate_sweep: node%d's CPU profile over %d s in %s", i+1, secs, file)
}

// fairWaiting reads node i's quotad_fair_waiting summed over domain's scopes; ok is false
// if the metrics could not be read.
func fairWaiting(c *proccluster.Cluster, i int, domain string) (float64, bool) {
	return metricSum(c, i, `quotad_fair_waiting{domain="`+domain+`"`)
}

// tooManyWaiters reads node i's too_many_waiters refusals in domain so far (-1: unreadable).
func tooManyWaiters(c *proccluster.Cluster, i int, domain string) float64 {
	n, ok := metricSum(c, i, `quotad_fair_denials_total{domain="`+domain+`",reason="too_many_waiters"`)
	if !ok {
		return -1
	}
	return n
}

// metricSum sums node i's /metrics samples whose line starts with prefix; ok is false if the
// metrics could not be read.
func metricSum(c *proccluster.Cluster, i int, prefix string) (float64, bool) {
	hc, err := proccluster.HTTPClient(c.Credentials(), 2*time.Second)
	if err != nil {
		return 0, false
	}
	resp, err := hc.Get(c.URL(i, "/metrics"))
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, false
	}
	var n float64
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, prefix) {
			f := strings.Fields(line)
			if v, err := strconv.ParseFloat(f[len(f)-1], 64); err == nil {
				n += v
			}
		}
	}
	return n, sc.Err() == nil
}

// commitHistogram reads node i's quotad_raft_commit_seconds buckets: upper bound (s) →
// cumulative count.
func commitHistogram(c *proccluster.Cluster, i int) map[float64]float64 {
	out := map[float64]float64{}
	if i < 0 {
		check(fmt.Errorf("rate_sweep: no leader to read the commit latency from"))
	}
	// The agents serve HTTPS with the cluster's credentials (a plain http.Get was refused, so
	// commit_p99_ms read -1 and every latency target failed).
	hc, err := proccluster.HTTPClient(c.Credentials(), 5*time.Second)
	if err != nil {
		check(fmt.Errorf("rate_sweep: an HTTP client for the metrics: %w", err))
	}
	resp, err := hc.Get(c.URL(i, "/metrics"))
	if err != nil {
		check(fmt.Errorf("rate_sweep: reading node%d's metrics: %w", i+1, err))
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		check(fmt.Errorf("rate_sweep: reading node%d's metrics: %s", i+1, resp.Status))
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		const prefix = `quotad_raft_commit_seconds_bucket{le="`
		if !strings.HasPrefix(line, prefix) {
			continue
		}
		rest := line[len(prefix):]
		q := strings.IndexByte(rest, '"')
		f := strings.Fields(rest)
		if q < 0 || len(f) < 2 {
			continue
		}
		le, err1 := strconv.ParseFloat(rest[:q], 64)
		if rest[:q] == "+Inf" {
			le, err1 = math.Inf(1), nil
		}
		v, err2 := strconv.ParseFloat(f[len(f)-1], 64)
		if err1 == nil && err2 == nil {
			out[le] = v
		}
	}
	return out
}

// histQuantile is the q-quantile of what a cumulative histogram counted between two readings,
// interpolated linearly within its bucket (as Prometheus' histogram_quantile); -1 if empty.
func histQuantile(h0, h1 map[float64]float64, q float64) float64 {
	var les []float64
	for le := range h1 {
		les = append(les, le)
	}
	slices.Sort(les)
	if len(les) == 0 {
		return -1
	}
	total := h1[les[len(les)-1]] - h0[les[len(les)-1]]
	if total <= 0 {
		return -1
	}
	want := q * total
	prevLe, prevN := 0.0, 0.0
	for _, le := range les {
		n := h1[le] - h0[le]
		if n >= want {
			if math.IsInf(le, 1) {
				return prevLe
			}
			return prevLe + (le-prevLe)*(want-prevN)/max(n-prevN, 1e-9)
		}
		prevLe, prevN = le, n
	}
	return prevLe
}

// loadAvg is the 1-minute load average (-1 where /proc/loadavg is missing).
func loadAvg() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return -1
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return -1
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return -1
	}
	return v
}

// fairSamples collects the leader's /debug/fair readings of one rate's run.
type fairSamples struct {
	mu            sync.Mutex
	n, bEmpty, nB int
	horizon       float64
	exLo, exHi    uint64 // the leader's moment_exchanges, first and last read
}

// sample reads node i's /debug/fair once: the release horizon, and whether tenant B had an
// admission waiting on domain. A failed read is skipped.
func (s *fairSamples) sample(c *proccluster.Cluster, i int, domain string) {
	hc, err := proccluster.HTTPClient(c.Credentials(), 2*time.Second)
	if err != nil {
		return
	}
	resp, err := hc.Get(c.URL(i, "/debug/fair"))
	if err != nil {
		return
	}
	defer resp.Body.Close()
	var v rpc.FairView
	if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&v) != nil || !v.IsLeader {
		return
	}
	waitingB := 0
	for _, b := range v.Buckets {
		if b.Domain != domain {
			continue
		}
		for _, f := range b.Flows {
			if f.Flow == "tenant=B" { // flowOf: key=value
				waitingB += f.Waiting
			}
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.n == 0 || v.MomentExchanges < s.exLo {
		s.exLo = v.MomentExchanges
	}
	s.exHi = max(s.exHi, v.MomentExchanges)
	s.n++
	s.horizon += v.ReleaseHorizonMs
	s.nB++
	if waitingB == 0 {
		s.bEmpty++
	}
}

// exchanges is how many moment exchanges the leader made between the first and the last
// reading (-1: no reading).
func (s *fairSamples) exchanges() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.n == 0 {
		return -1
	}
	return float64(s.exHi - s.exLo)
}

// result is the mean horizon (ms) and the share of readings with B's backlog empty (-1, -1:
// no reading).
func (s *fairSamples) result() (horizonMs, bEmpty float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.n == 0 {
		return -1, -1
	}
	return round3(s.horizon / float64(s.n)), round3(float64(s.bEmpty) / float64(s.nB))
}
