// Command run is `make bench`: it builds quotad and the load generator, starts a real 3-node
// cluster of separate agent processes (fsync on, the binary's defaults), and measures
// throughput and latency (a concurrency sweep, median of several runs), serial latency,
// failover after kill -9 of the leader, both Raft log store backends side by side
// (log_store_compare), memory with 1M active buckets, and snapshot + restore of 1M buckets. It
// prints a table and writes bench/results/latest.json.
//
// Run it from the module root: go run ./bench/run [-runs 3] [-duration 4s].
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/quotad/quotad/internal/proccluster"
)

// benchLimits: "bench" is roomy (the load measures deciding, not refusing; every decision
// still goes through the domain ceiling and a per-tenant bucket); "buckets" refills so slowly
// that each of the 1M tenant buckets the populate step creates stays stored (active), and its
// max_keys lets it hold them (the default is 100000).
const benchLimits = `domain: bench
rate_limit: {unit: second, requests_per_unit: 100000000}
max_keys: 10000000
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 1000000}
---
domain: rls
rate_limit: {unit: second, requests_per_unit: 100000000}
max_keys: 10000000
descriptors:
  - key: generic_key
    value: orders
    rate_limit: {unit: second, requests_per_unit: 100000000}
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 1000000}
    descriptors:
      - key: consumer
        rate_limit: {unit: second, requests_per_unit: 1000000}
---
domain: buckets
max_keys: 2000000
descriptors:
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 10}
`

// Report is bench/results/latest.json.
// Keys of steps that did not run are left out (omitempty), so a partial run never reports 0.
type Report struct {
	DecisionsPerSec  float64      `json:"decisions_per_sec,omitempty"`
	P99Ms            float64      `json:"p99_ms,omitempty"`
	SerialP50Ms      float64      `json:"serial_p50_ms,omitempty"`
	FailoverMedianMs float64      `json:"failover_median_ms,omitempty"`
	FailoverMaxMs    float64      `json:"failover_max_ms,omitempty"`
	RSSMB1MBuckets   []float64    `json:"rss_mb_1m_buckets,omitempty"`
	SnapshotRestoreS float64      `json:"snapshot_restore_s_1m,omitempty"`
	Sweep            []SweepPoint `json:"sweep,omitempty"`
	SweepDisk        *DiskProbe   `json:"sweep_disk_fsync,omitempty"`
	// The soak step (run only when asked for: -only soak) alternates load and idle and counts
	// leadership changes, which must stay 0: no node was killed.
	SoakSeconds       float64 `json:"soak_seconds,omitempty"`
	SoakDecisions     int64   `json:"soak_decisions,omitempty"`
	SoakLeaderChanges *int    `json:"soak_leader_changes,omitempty"`
	// log_store_compare (docs/performance.md, "Log store"): both --raft-log-store backends in
	// one run, alternating; the 1-minute load average at its start and end; the fsync probe
	// beside it.
	LogStoreCompare     map[string]*LogStorePoint `json:"log_store_compare,omitempty"`
	LogStoreCompareLoad []float64                 `json:"log_store_compare_load_avg,omitempty"`
	LogStoreCompareDisk *DiskProbe                `json:"log_store_compare_disk_fsync,omitempty"`
	// rls (issue 14): Envoy's ShouldRateLimit at -rls-concurrency: in an open loop, the
	// highest rate meeting the p99 target (RLSRatePoint); and closed loops at saturation
	// (RLSPoint), which measure throughput and the queueing it brings.
	RLS           []RLSRatePoint `json:"rls,omitempty"`
	RLSSaturation []RLSPoint     `json:"rls_saturation,omitempty"`
	// RLSIdleCores is the CPU the three idle agents used before the rls step (cores).
	RLSIdleCores float64 `json:"rls_idle_agents_cores,omitempty"`
	// ab (-only ab -ab-base DIR): a base build against this tree's, see abCompare.
	AB map[string]*ABPoint `json:"ab,omitempty"`
}

// SweepPoint is the median over runs at one concurrency.
type SweepPoint struct {
	Concurrency     int       `json:"concurrency"`
	DecisionsPerSec float64   `json:"decisions_per_sec"`
	P50Ms           float64   `json:"p50_ms"`
	P99Ms           float64   `json:"p99_ms"`
	P999Ms          float64   `json:"p999_ms"`
	Runs            []float64 `json:"runs_decisions_per_sec"`
}

// loadResult mirrors bench/loadgen's output.
type loadResult struct {
	Decisions  int64   `json:"decisions"`
	Errors     int64   `json:"errors"`
	FirstError string  `json:"first_error"`
	Seconds    float64 `json:"seconds"`
	PerSec     float64 `json:"decisions_per_sec"`
	P50Ms      float64 `json:"p50_ms"`
	P99Ms      float64 `json:"p99_ms"`
	P999Ms     float64 `json:"p999_ms"`
	MaxMs      float64 `json:"max_ms"`
	RPCs       uint64  `json:"rpcs"`
	Batches    uint64  `json:"batches"`
	Held       uint64  `json:"batches_held"`
}

func main() {
	var (
		runs        = flag.Int("runs", 3, "runs per concurrency (the median is reported)")
		duration    = flag.Duration("duration", 4*time.Second, "measured time per run")
		concs       = flag.String("concurrency", "1,64,256,512,1024", "concurrency sweep")
		kills       = flag.Int("kills", 5, "leader kill -9 trials")
		buckets     = flag.Int("buckets", 1_000_000, "active buckets for the memory step")
		only        = flag.String("only", "", "comma-separated steps to run (sweep,rls,failover,log_store_compare,memory,snapshot,soak,serial_profile,ab); empty: all but soak, serial_profile and ab")
		rlsConcs    = flag.String("rls-concurrency", "64,256", "rls step: concurrent ShouldRateLimit callers")
		cmpRounds   = flag.Int("compare-rounds", 4, "log_store_compare: rounds (each runs both backends, the order alternating)")
		soak        = flag.Duration("soak", 10*time.Minute, "length of the soak step (alternating 30 s of load and 30 s of idle)")
		soakBuckets = flag.Int("soak-buckets", 0, "stored buckets to create before the soak (e.g. 1000000: snapshots of a large state under load)")
		out         = flag.String("out", "bench/results/latest.json", "JSON report path")
		rlsProfile  = flag.String("rls-profile", "", "rls step: write every node's CPU profile of each run's measured part to this directory (node<i>-c<conc>-rate<r>.pprof open loop, node<i>-c<conc>-run<r>.pprof saturation)")
		rlsStart    = flag.Float64("rls-start-rate", 1000, "rls step: the open-loop search's first rate (requests/s)")
		rlsMaxRate  = flag.Float64("rls-max-rate", 50000, "rls step: the open-loop search's highest rate (requests/s)")
		rlsTarget   = flag.Duration("rls-p99-target", 20*time.Millisecond, "rls step: the p99 a rate must meet (Envoy's default timeout)")
		rlsStepDur  = flag.Duration("rls-step", 3*time.Second, "rls step: measured time per open-loop rate (after a 1 s warm-up)")
		rlsSteps    = flag.Int("rls-max-steps", 12, "rls step: open-loop rates tried per concurrency at most")
		rlsRates    = flag.String("rls-rates", "", "rls step: open-loop rates to try instead of the search (requests/s, comma-separated; for A/B runs)")
		rlsSat      = flag.Bool("rls-saturation", true, "rls step: also run the closed loop at saturation (-runs runs of -duration)")
		keep        = flag.Bool("keep", false, "keep the cluster running at the end (for profiling) until interrupted")
		agentArgs   = flag.String("agent-args", "", "extra agent flags, space-separated")
		snapProf    = flag.String("snapshot-cpuprofile", "", "write a CPU profile of the snapshot step's timed part to this file")
		profDir     = flag.String("profile-dir", "", "serial_profile: where the traces and profiles go (default: a new directory under the system's temp dir, logged)")
		profBackend = flag.String("profile-backend", "wal", "serial_profile: the --raft-log-store backend to trace")
		profConc    = flag.Int("profile-concurrency", 1, "serial_profile: concurrent callers of the profiled runs (e.g. 64 for the c=64 runs of log_store_compare)")
		abBase      = flag.String("ab-base", "", "ab: the source tree of the base to compare this tree against (e.g. git archive of the commit before a change)")
	)
	flag.Parse()
	steps := map[string]bool{}
	for _, s := range strings.Split(*only, ",") {
		if s != "" {
			steps[s] = true
		}
	}
	want := func(s string) bool {
		return steps[s] || len(steps) == 0 && s != "soak" && s != "serial_profile" && s != "ab"
	}

	dir, err := os.MkdirTemp("", "quotad-bench-")
	check(err)
	defer os.RemoveAll(dir)
	atExit = append(atExit, func() { os.RemoveAll(dir) })
	logf("building quotad and loadgen in %s", dir)
	bin, err := proccluster.Build(".", dir)
	check(err)
	loadgen := filepath.Join(dir, "loadgen")
	build := exec.Command("go", "build", "-o", loadgen, "./bench/loadgen")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	check(build.Run())
	limits := filepath.Join(dir, "limits.yaml")
	check(os.WriteFile(limits, []byte(benchLimits), 0o644))

	var rep Report
	var c *proccluster.Cluster
	killC := func() {
		if c != nil {
			c.KillAll()
		}
	}
	defer killC()
	atExit = append(atExit, killC)
	// startCluster starts a fresh cluster in a new directory (replacing c).
	startCluster := func(name string) {
		if c != nil {
			c.KillAll()
		}
		cdir := filepath.Join(dir, name)
		check(os.MkdirAll(cdir, 0o755))
		var err error
		c, err = proccluster.Start(proccluster.Config{Binary: bin, Dir: cdir, Nodes: 3,
			LimitsFile: limits, ExtraArgs: strings.Fields(*agentArgs)})
		check(err)
		leader, err := c.WaitLeader(20 * time.Second)
		check(err)
		// The loadgen processes connect with the cluster's admin credentials (client.LoadEnv).
		for _, kv := range c.ClientEnv() {
			k, v, _ := strings.Cut(kv, "=")
			check(os.Setenv(k, v))
		}
		logf("cluster %s up: leader %s, nodes %v", name, c.Nodes[leader].ID, c.GRPCAddrs())
	}
	var addrs string
	if want("soak") || want("sweep") || want("rls") || want("failover") {
		startCluster("cluster1")
		addrs = strings.Join(c.GRPCAddrs(), ",")
	}

	if want("soak") {
		if *soakBuckets > 0 {
			populate(loadgen, addrs, *soakBuckets)
		}
		n, decisions := soakRun(c, loadgen, addrs, *soak)
		rep.SoakSeconds, rep.SoakDecisions, rep.SoakLeaderChanges = soak.Seconds(), decisions, &n
	}
	if want("sweep") {
		stop := make(chan struct{})
		probed := make(chan DiskProbe, 1)
		go func() {
			p, err := probeDisk(dir, stop)
			check(err)
			probed <- p
		}()
		rep.Sweep = sweep(loadgen, addrs, parseInts(*concs), *runs, *duration)
		close(stop)
		p := <-probed
		rep.SweepDisk = &p
		logf("%s", p)
		best := rep.Sweep[0]
		for _, p := range rep.Sweep {
			if p.DecisionsPerSec > best.DecisionsPerSec {
				best = p
			}
			if p.Concurrency == 1 {
				rep.SerialP50Ms = p.P50Ms
			}
		}
		rep.DecisionsPerSec, rep.P99Ms = best.DecisionsPerSec, best.P99Ms
	}
	if want("rls") {
		rep.RLS, rep.RLSIdleCores = rlsOpenStep(c, loadgen, addrs, parseInts(*rlsConcs), rlsSearch{start: *rlsStart, maxRate: *rlsMaxRate,
			target: *rlsTarget, step: *rlsStepDur, maxSteps: max(1, *rlsSteps), profileDir: *rlsProfile,
			rates: parseFloats(*rlsRates)})
		if *rlsSat {
			rep.RLSSaturation = rlsStep(c, *rlsProfile, loadgen, addrs, parseInts(*rlsConcs), *runs, *duration)
		}
	}
	if want("failover") {
		times := failover(c, *kills)
		if len(times) > 0 {
			ms := make([]float64, len(times))
			for i, t := range times {
				ms[i] = float64(t) / 1e6
			}
			rep.FailoverMedianMs, rep.FailoverMaxMs = median(ms), slices.Max(ms)
		}
	}
	if want("log_store_compare") {
		killC() // its own two clusters only
		stop := make(chan struct{})
		probed := make(chan DiskProbe, 1)
		go func() {
			p, err := probeDisk(dir, stop)
			check(err)
			probed <- p
		}()
		rep.LogStoreCompare, rep.LogStoreCompareLoad = logStoreCompare(bin, loadgen, limits, dir,
			strings.Fields(*agentArgs), *cmpRounds, *duration)
		close(stop)
		p := <-probed
		rep.LogStoreCompareDisk = &p
	}
	if want("ab") {
		if *abBase == "" {
			check(fmt.Errorf("-only ab needs -ab-base DIR"))
		}
		rep.AB = abCompare(bin, loadgen, *abBase, limits, dir, strings.Fields(*agentArgs), *cmpRounds, *duration)
	}
	if want("serial_profile") {
		if *profDir == "" {
			*profDir, err = os.MkdirTemp("", "quotad-serial-profile-")
			check(err)
		}
		serialProfile(bin, loadgen, limits, dir, *profBackend, *profDir, strings.Fields(*agentArgs), *duration, max(1, *profConc))
	}
	if want("memory") {
		// A fresh cluster, so the dedup records of the load above (a 2-minute window of
		// them) do not count as memory for buckets.
		startCluster("cluster2")
		rep.RSSMB1MBuckets = memory(c, loadgen, strings.Join(c.GRPCAddrs(), ","), *buckets)
	}
	if want("snapshot") {
		s, err := snapshotRestore(*buckets, *snapProf)
		check(err)
		rep.SnapshotRestoreS = s
	}
	if c != nil {
		hits, _ := c.ScanLogs("panic", "fatal error")
		for _, h := range hits {
			logf("agent log: %s", h)
		}
	}
	printTable(&rep)
	data, err := json.MarshalIndent(&rep, "", "  ")
	check(err)
	check(os.MkdirAll(filepath.Dir(*out), 0o755))
	check(os.WriteFile(*out, append(data, '\n'), 0o644))
	logf("wrote %s", *out)
	if *keep && c != nil {
		logf("cluster kept running (HTTPS %s, admin credentials in %s); interrupt to stop", c.Nodes[0].HTTPAddr, c.Credentials().Dir)
		select {}
	}
}

func sweep(loadgen, addrs string, concs []int, runs int, dur time.Duration) []SweepPoint {
	var pts []SweepPoint
	for _, conc := range concs {
		var rs []loadResult
		for r := range runs {
			var res loadResult
			runLoadgen(loadgen, &res, "-addrs", addrs, "-mode", "load", "-concurrency", strconv.Itoa(conc),
				"-duration", dur.String(), "-warmup", "1s")
			logf("c=%-5d run %d: %8.0f decisions/s  p50 %6.2f ms  p99 %6.2f ms  p999 %6.2f ms  errors %d %s",
				conc, r+1, res.PerSec, res.P50Ms, res.P99Ms, res.P999Ms, res.Errors, res.FirstError)
			rs = append(rs, res)
		}
		pts = append(pts, medianPoint(conc, rs))
	}
	return pts
}

// medianPoint takes the run with the median throughput and reports its latencies too, so one
// row is one real run rather than a mix of runs.
func medianPoint(conc int, rs []loadResult) SweepPoint {
	slices.SortFunc(rs, func(a, b loadResult) int { return cmpF(a.PerSec, b.PerSec) })
	m := rs[len(rs)/2]
	p := SweepPoint{Concurrency: conc, DecisionsPerSec: m.PerSec, P50Ms: m.P50Ms, P99Ms: m.P99Ms, P999Ms: m.P999Ms}
	for _, r := range rs {
		p.Runs = append(p.Runs, r.PerSec)
	}
	return p
}

// runLoadgen runs the load generator and parses its report into into; it returns the CPU
// time the load generator used.
func runLoadgen(loadgen string, into any, args ...string) time.Duration {
	cmd := exec.Command(loadgen, args...)
	var stdout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		check(fmt.Errorf("loadgen %v: %w", args, err))
	}
	check(json.Unmarshal(stdout.Bytes(), into))
	return cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
}

// memory creates n active buckets through the API (batched by the client library) and reads
// every node's resident set size from its /metrics.
func memory(c *proccluster.Cluster, loadgen, addrs string, n int) []float64 {
	populate(loadgen, addrs, n)
	// Let every follower apply the tail of the log.
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		var idx []uint64
		for i := range c.Nodes {
			s, err := c.State(context.Background(), i)
			if err == nil {
				idx = append(idx, s.AppliedIndex)
			}
		}
		if len(idx) == len(c.Nodes) && slices.Min(idx) == slices.Max(idx) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	var mbs []float64
	for i, nd := range c.Nodes {
		rss, err := scrapeRSS(c, i)
		check(err)
		st, _ := c.State(context.Background(), i)
		mb := rss / (1 << 20)
		logf("%s: RSS %.0f MB after %d active buckets (applied index %d)", nd.ID, mb, n, st.AppliedIndex)
		mbs = append(mbs, float64(int(mb*10))/10)
	}
	return mbs
}

// populate creates n stored buckets through the API: admissions with distinct tenant values
// in a domain that refills so slowly that every bucket stays stored.
func populate(loadgen, addrs string, n int) {
	var res loadResult
	runLoadgen(loadgen, &res, "-addrs", addrs, "-mode", "populate", "-domain", "buckets", "-n", strconv.Itoa(n),
		"-concurrency", "2048")
	logf("populate: %d decisions in %.1fs (%.0f/s), %d RPCs, errors %d %s", res.Decisions, res.Seconds, res.PerSec, res.RPCs, res.Errors, res.FirstError)
}

func scrapeRSS(c *proccluster.Cluster, i int) (float64, error) {
	return scrapeMetric(c, i, "process_resident_memory_bytes")
}

// scrapeMetric reads one unlabelled sample from node i's /metrics.
func scrapeMetric(c *proccluster.Cluster, i int, name string) (float64, error) {
	httpAddr := c.Nodes[i].HTTPAddr
	resp, err := c.HTTPClient().Get(c.URL(i, "/metrics"))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	s := bufio.NewScanner(resp.Body)
	s.Buffer(nil, 1<<20)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), name+" "); ok {
			return strconv.ParseFloat(v, 64)
		}
	}
	return 0, fmt.Errorf("%s/metrics has no %s", httpAddr, name)
}

func printTable(r *Report) {
	fmt.Println()
	fmt.Println("concurrency  decisions/s     p50 ms    p99 ms   p999 ms   runs")
	for _, p := range r.Sweep {
		var runs []string
		for _, x := range p.Runs {
			runs = append(runs, fmt.Sprintf("%.0f", x))
		}
		fmt.Printf("%11d  %11.0f  %9.2f %9.2f %9.2f   %s\n", p.Concurrency, p.DecisionsPerSec, p.P50Ms, p.P99Ms, p.P999Ms, strings.Join(runs, " "))
	}
	if r.SweepDisk != nil {
		fmt.Println(r.SweepDisk)
	}
	fmt.Println()
	fmt.Printf("decisions_per_sec      %10.0f   (target ≥ 100000, at least 50000)\n", r.DecisionsPerSec)
	fmt.Printf("p99_ms                 %10.2f   (target ≤ 10, at least ≤ 20)\n", r.P99Ms)
	fmt.Printf("serial_p50_ms          %10.2f   (target ≤ 1.5)\n", r.SerialP50Ms)
	fmt.Printf("failover_median_ms     %10.0f   (target ≤ 1000)\n", r.FailoverMedianMs)
	fmt.Printf("failover_max_ms        %10.0f   (target ≤ 2000)\n", r.FailoverMaxMs)
	fmt.Printf("rss_mb_1m_buckets      %10v   (target ≤ 300 per node)\n", r.RSSMB1MBuckets)
	fmt.Printf("snapshot_restore_s_1m  %10.2f   (target ≤ 3)\n", r.SnapshotRestoreS)
	for _, p := range r.RLS {
		met := "met"
		if !p.Met {
			met = "NOT met at any rate tried"
		}
		fmt.Printf("rls c=%-4d rls_descriptors_per_sec %9.0f  rls_p99_ms %6.2f (open loop at %.0f requests/s; target ≤ 20, Envoy's default timeout: %s)  p50 %.2f p999 %.2f  cpu/request agents %.0f µs loadgen %.0f µs  load %v\n",
			p.Concurrency, p.DescriptorsPerSec, p.P99Ms, p.RateTried, met, p.P50Ms, p.P999Ms, p.AgentCPUus, p.LoadgenCPUus, p.LoadAvg)
	}
	for _, p := range r.RLSSaturation {
		fmt.Printf("rls saturation (closed loop) c=%-4d descriptors/s %9.0f  p50 %6.2f  p99 %6.2f ms (queueing: mean ≈ c ÷ requests/s)  load %v\n",
			p.Concurrency, p.DescriptorsPerSec, p.P50Ms, p.P99Ms, p.LoadAvg)
	}
	if r.SoakLeaderChanges != nil {
		fmt.Printf("soak_leader_changes    %10d   (target 0 in %.0f s of mixed idle and load, %d decisions)\n",
			*r.SoakLeaderChanges, r.SoakSeconds, r.SoakDecisions)
	}
	fmt.Println()
	printLogStoreCompare(r)
}

func parseFloats(s string) []float64 {
	var out []float64
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		x, err := strconv.ParseFloat(f, 64)
		if err != nil || x <= 0 {
			check(fmt.Errorf("rate %q: use positive numbers of requests per second, comma-separated", f))
		}
		out = append(out, x)
	}
	return out
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func cmpF(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func parseInts(s string) []int {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		check(err)
		out = append(out, n)
	}
	return out
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s bench: %s\n", time.Now().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}

// atExit runs before a failed check exits (deferred calls do not run on os.Exit).
var atExit []func()

func check(err error) {
	if err != nil {
		logf("FAILED: %v", err)
		for _, f := range slices.Backward(atExit) {
			f()
		}
		os.Exit(1)
	}
}
