package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/quotad/quotad/internal/proccluster"
)

// RLSRatePoint is the Envoy RLS result at one concurrency, in an open loop as Envoy's traffic
// is: requests arrive at a set rate (Poisson) whatever the answers do, at most Concurrency
// outstanding, every latency timed from the request's intended send time (bench/loadgen
// openloop.go). The search tries rates (a ramp ×1.5 from -rls-start-rate, then bisection) and
// reports the highest one at which a majority of runs (2 of 2, or 2 of 3) met p99 ≤
// -rls-p99-target with no error and nothing abandoned, with the numbers of its median passing
// run; Steps lists every run, in order.
type RLSRatePoint struct {
	Concurrency       int     `json:"concurrency"`
	Met               bool    `json:"p99_target_met"`
	RateTried         float64 `json:"rate_tried_requests_per_sec"`
	RequestsPerSec    float64 `json:"rls_requests_per_sec"`
	DescriptorsPerSec float64 `json:"rls_descriptors_per_sec"`
	P50Ms             float64 `json:"rls_p50_ms"`
	P99Ms             float64 `json:"rls_p99_ms"`
	P999Ms            float64 `json:"rls_p999_ms"`
	Errors            int64   `json:"errors"`
	Late              int64   `json:"late"`
	// AgentCPUus is the three agents' CPU time per request over the step (µs), LoadgenCPUus the
	// load generator's: together what one request costs the 2-core machine.
	AgentCPUus   float64   `json:"agent_cpu_us_per_request"`
	LoadgenCPUus float64   `json:"loadgen_cpu_us_per_request"`
	Steps        []RLSStep `json:"steps"`
	LoadAvg      []float64 `json:"load_avg"`
}

// RLSStep is one open-loop run at one rate.
type RLSStep struct {
	Rate           float64 `json:"rate"`
	RequestsPerSec float64 `json:"requests_per_sec"`
	P50Ms          float64 `json:"p50_ms"`
	P99Ms          float64 `json:"p99_ms"`
	P999Ms         float64 `json:"p999_ms"`
	Errors         int64   `json:"errors,omitempty"`
	Late           int64   `json:"late,omitempty"`
	Abandoned      int64   `json:"abandoned,omitempty"`
	MaxQueued      int64   `json:"max_queued,omitempty"`
	AgentCPUus     float64 `json:"agent_cpu_us_per_request"`
	LoadgenCPUus   float64 `json:"loadgen_cpu_us_per_request"`
	Pass           bool    `json:"pass"`
	FirstError     string  `json:"first_error,omitempty"`
}

// rlsSearch is the open-loop search's settings.
type rlsSearch struct {
	start, maxRate float64       // first rate tried; the ramp stops there
	target         time.Duration // p99 bound
	step           time.Duration // measured time per step (after a 1 s warm-up)
	maxSteps       int
	rates          []float64 // if set, exactly these rates, no search (A/B comparisons)
	profileDir     string    // if set, every node's CPU profile of each step's measured part
}

// rlsOpenStep finds, at each concurrency, the highest rate that meets the p99 target.
func rlsOpenStep(c *proccluster.Cluster, loadgen, addrs string, concs []int, s rlsSearch) ([]RLSRatePoint, float64) {
	// What the idle agents use (heartbeats, metrics, gossip): part of every step's CPU.
	cpu0 := agentsCPU(c)
	time.Sleep(2 * time.Second)
	idle := float64(agentsCPU(c)-cpu0) / float64(2*time.Second)
	logf("rls: the idle agents use %.3f of a core", idle)
	var pts []RLSRatePoint
	for _, conc := range concs {
		before := loadAvg()
		var steps []RLSStep
		// A rate is judged by a majority of up to 3 runs (2 when the first two agree): one
		// burst of another process on this shared machine neither passes nor fails a rate.
		type verdict struct {
			pass bool
			rep  RLSStep // the run with the median p99
		}
		judged := map[float64]verdict{}
		try := func(rate float64) bool {
			var runs []RLSStep
			passes := 0
			for len(runs) < 3 && passes < 2 && len(runs)-passes < 2 {
				st := rlsOpenRun(c, loadgen, addrs, conc, rate, s)
				steps = append(steps, st)
				runs = append(runs, st)
				if st.Pass {
					passes++
				}
			}
			v := verdict{pass: passes >= 2}
			if v.pass { // report a passing run: the median by p99 of the passing ones
				runs = slices.DeleteFunc(runs, func(st RLSStep) bool { return !st.Pass })
			}
			slices.SortFunc(runs, func(a, b RLSStep) int { return cmpF(a.P99Ms, b.P99Ms) })
			v.rep = runs[len(runs)/2] // of two, the higher p99
			judged[rate] = v
			return v.pass
		}
		// Ramp ×1.5 while the target holds, then bisect between the last pass and the first
		// failure until they are within 5 %.
		lo, hi := 0.0, 0.0
		for _, r := range s.rates {
			try(r)
		}
		for r := s.start; len(s.rates) == 0 && r <= s.maxRate && len(judged) < s.maxSteps; r *= 1.5 {
			if try(r) {
				lo = r
				continue
			}
			hi = r
			break
		}
		if lo == 0 && hi > 0 { // the first rate failed: halve until one passes
			for r := hi / 2; r >= 50 && len(judged) < s.maxSteps; r /= 2 {
				if try(r) {
					lo = r
					break
				}
				hi = r
			}
		}
		for len(s.rates) == 0 && lo > 0 && hi > lo*1.05 && len(judged) < s.maxSteps {
			mid := (lo + hi) / 2
			if try(mid) {
				lo = mid
			} else {
				hi = mid
			}
		}
		// The highest rate that passed; if none did, the lowest tried.
		var best verdict
		first := true
		for r, v := range judged {
			if first || v.pass && (!best.pass || r > best.rep.Rate) || !best.pass && !v.pass && r < best.rep.Rate {
				best, first = v, false
			}
		}
		b := best.rep
		pts = append(pts, RLSRatePoint{Concurrency: conc, Met: best.pass, RateTried: b.Rate,
			RequestsPerSec: b.RequestsPerSec, DescriptorsPerSec: b.RequestsPerSec * 3,
			P50Ms: b.P50Ms, P99Ms: b.P99Ms, P999Ms: b.P999Ms, Errors: b.Errors, Late: b.Late,
			AgentCPUus: b.AgentCPUus, LoadgenCPUus: b.LoadgenCPUus,
			Steps: steps, LoadAvg: []float64{before, loadAvg()}})
	}
	return pts, idle
}

// rlsOpenRun runs one open-loop step at rate requests/s.
func rlsOpenRun(c *proccluster.Cluster, loadgen, addrs string, conc int, rate float64, s rlsSearch) RLSStep {
	var res struct {
		loadResult
		Rate      float64 `json:"rate"`
		Late      int64   `json:"late"`
		Abandoned int64   `json:"abandoned"`
		MaxQueued int64   `json:"max_queued"`
	}
	var profiles sync.WaitGroup
	if s.profileDir != "" {
		for i := range c.Nodes {
			name := filepath.Join(s.profileDir, fmt.Sprintf("node%d-c%d-rate%.0f.pprof", i, conc, rate))
			profiles.Go(func() { cpuProfile(c, i, name, time.Second, s.step) })
		}
	}
	cpu0 := agentsCPU(c)
	lgCPU := runLoadgen(loadgen, &res, "-addrs", addrs, "-mode", "rls", "-domain", "rls", "-concurrency", strconv.Itoa(conc),
		"-rate", strconv.FormatFloat(rate, 'f', 0, 64), "-duration", s.step.String(), "-warmup", "1s")
	agents := agentsCPU(c) - cpu0
	profiles.Wait()
	// Every arrival of the warm-up and the measured window was sent (abandoned ones aside).
	sent := rate*(s.step+time.Second).Seconds() - float64(res.Abandoned)
	st := RLSStep{Rate: rate, RequestsPerSec: res.PerSec, P50Ms: res.P50Ms, P99Ms: res.P99Ms, P999Ms: res.P999Ms,
		Errors: res.Errors, Late: res.Late, Abandoned: res.Abandoned, MaxQueued: res.MaxQueued,
		AgentCPUus: float64(agents/time.Microsecond) / sent, LoadgenCPUus: float64(lgCPU/time.Microsecond) / sent,
		FirstError: res.FirstError}
	// With no error and nothing abandoned every measured arrival was answered: the load was
	// carried (requests/s differs from rate only by the Poisson count of arrivals).
	st.Pass = res.Errors == 0 && res.Abandoned == 0 && res.P99Ms <= float64(s.target)/1e6
	verdict := "miss"
	if st.Pass {
		verdict = "ok"
	}
	logf("rls open c=%-4d rate %7.0f/s: %7.0f req/s  p50 %6.2f  p99 %6.2f  p999 %7.2f ms  late %d abandoned %d errors %d  cpu/request agents %.0f µs loadgen %.0f µs  %s %s",
		conc, rate, res.PerSec, res.P50Ms, res.P99Ms, res.P999Ms, res.Late, res.Abandoned, res.Errors, st.AgentCPUus, st.LoadgenCPUus, verdict, res.FirstError)
	return st
}

// agentsCPU is the CPU time (user + system) the cluster's running agents have used so far.
func agentsCPU(c *proccluster.Cluster) time.Duration {
	var total time.Duration
	for i := range c.Nodes {
		if pid := c.Pid(i); pid > 0 {
			total += processCPU(pid)
		}
	}
	return total
}

// processCPU reads utime + stime from /proc/<pid>/stat (0 if unreadable). The kernel counts
// them in clock ticks of 1/100 s (USER_HZ on Linux).
func processCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// The command name (field 2) may contain spaces; the fields after its ")" are fixed.
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond
}

// RLSPoint is the Envoy RLS closed loop (saturation) at one concurrency: ShouldRateLimit calls from a separate
// load generator process, one RPC per request spread over the three nodes (followers
// forward), each request carrying examples/envoy/envoy.yaml's three descriptors. The median
// run by throughput, with its latencies, and the 1-minute load average around the runs.
type RLSPoint struct {
	Concurrency          int       `json:"concurrency"`
	RequestsPerSec       float64   `json:"rls_requests_per_sec"`
	DescriptorsPerSec    float64   `json:"rls_descriptors_per_sec"`
	P50Ms                float64   `json:"rls_p50_ms"`
	P99Ms                float64   `json:"rls_p99_ms"`
	P999Ms               float64   `json:"rls_p999_ms"`
	Errors               int64     `json:"errors,omitempty"`
	RunsDescriptorsPerSe []float64 `json:"runs_rls_descriptors_per_sec"`
	LoadAvg              []float64 `json:"load_avg"`
}

// rlsStep runs the closed-loop RLS load at each concurrency (runs times, median reported):
// c callers back to back, so it measures the throughput at saturation and the queueing there
// (by Little's law the mean latency is c ÷ requests/s).
//
// With profileDir set, every node's CPU profile over the measured part of each run (after the
// loadgen's 1 s warm-up) is written there.
func rlsStep(c *proccluster.Cluster, profileDir, loadgen, addrs string, concs []int, runs int, dur time.Duration) []RLSPoint {
	var pts []RLSPoint
	for _, conc := range concs {
		before := loadAvg()
		var rs []loadResult
		var descs []float64
		errs := int64(0)
		for r := range runs {
			var res struct {
				loadResult
				DescriptorsPerSec float64 `json:"descriptors_per_sec"`
			}
			var profiles sync.WaitGroup
			if profileDir != "" {
				for i := range c.Nodes {
					name := filepath.Join(profileDir, fmt.Sprintf("node%d-c%d-run%d.pprof", i, conc, r+1))
					profiles.Go(func() { cpuProfile(c, i, name, time.Second, dur) })
				}
			}
			runLoadgen(loadgen, &res, "-addrs", addrs, "-mode", "rls", "-domain", "rls", "-concurrency", strconv.Itoa(conc),
				"-duration", dur.String(), "-warmup", "1s")
			profiles.Wait()
			logf("rls c=%-4d run %d: %8.0f requests/s  %8.0f descriptors/s  p50 %6.2f ms  p99 %6.2f ms  p999 %6.2f ms  errors %d %s",
				conc, r+1, res.PerSec, res.DescriptorsPerSec, res.P50Ms, res.P99Ms, res.P999Ms, res.Errors, res.FirstError)
			rs = append(rs, res.loadResult)
			descs = append(descs, res.DescriptorsPerSec)
			errs += res.Errors
		}
		m := medianPoint(conc, rs)
		pts = append(pts, RLSPoint{Concurrency: conc, RequestsPerSec: m.DecisionsPerSec, DescriptorsPerSec: m.DecisionsPerSec * 3,
			P50Ms: m.P50Ms, P99Ms: m.P99Ms, P999Ms: m.P999Ms, Errors: errs, RunsDescriptorsPerSe: descs,
			LoadAvg: []float64{before, loadAvg()}})
	}
	return pts
}

// cpuProfile writes node i's CPU profile of length d, starting after wait, to name.
func cpuProfile(c *proccluster.Cluster, i int, name string, wait, d time.Duration) {
	time.Sleep(wait)
	secs := max(1, int(d/time.Second))
	hc := *c.HTTPClient() // its timeout is for short requests
	hc.Timeout = time.Duration(secs)*time.Second + 30*time.Second
	resp, err := hc.Get(c.URL(i, "/debug/pprof/profile?seconds="+strconv.Itoa(secs)))
	if err != nil {
		logf("profile of node %d: %v", i, err)
		return
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		logf("profile of node %d: %s %v", i, resp.Status, err)
		return
	}
	check(os.MkdirAll(filepath.Dir(name), 0o755))
	check(os.WriteFile(name, b, 0o644))
}
