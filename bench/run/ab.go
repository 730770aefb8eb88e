package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/internal/proccluster"
)

// ABPoint is one side of the ab step: medians over rounds of the serial p50 and the c=64
// throughput, with the per-round values.
type ABPoint struct {
	SerialP50Ms   float64   `json:"serial_p50_ms"`
	C64PerSec     float64   `json:"c64_per_sec"`
	C64P99Ms      float64   `json:"c64_p99_ms"`
	SerialP50Runs []float64 `json:"serial_p50_runs_ms"`
	C64Runs       []float64 `json:"c64_runs_per_sec"`
	// SerialCPUUs is the CPU time (user + system) all three agents used per serial decision,
	// median over rounds: a measure of the path's fixed work that the machine's noise moves
	// much less than latency.
	SerialCPUUs   float64   `json:"serial_cpu_us_per_decision"`
	SerialCPURuns []float64 `json:"serial_cpu_us_runs"`
}

// clusterCPU is the CPU time (user + system) c's running agents have used so far.
func clusterCPU(c *proccluster.Cluster) time.Duration {
	var total time.Duration
	for i := range c.Nodes {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", c.Pid(i)))
		if err != nil {
			continue
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
		u, _ := strconv.ParseInt(f[11], 10, 64)         // utime, field 14
		k, _ := strconv.ParseInt(f[12], 10, 64)         // stime, field 15
		total += time.Duration(u+k) * time.Second / 100 // USER_HZ
	}
	return total
}

// abCompare (-only ab -ab-base DIR) measures a code change the way log_store_compare measures
// the backends: a 3-node cluster and load generator built from the source tree DIR (the
// "base", e.g. `git archive` of the commit before the change) and one built from this tree
// ("new"), both up for the whole step, both with the same agent flags, rounds alternating which
// goes first, each round c=1 then c=64. Both sides run their own client library, so a
// client-side change is measured too.
func abCompare(newBin, newLoadgen, baseDir, limits, dir string, extra []string, rounds int, dur time.Duration) map[string]*ABPoint {
	baseOut := filepath.Join(dir, "ab-base-bin")
	check(os.MkdirAll(baseOut, 0o755))
	baseBin, err := proccluster.Build(baseDir, baseOut)
	check(err)
	baseLoadgen := filepath.Join(baseOut, "loadgen")
	build := exec.Command("go", "build", "-o", baseLoadgen, "./bench/loadgen")
	build.Dir, build.Stdout, build.Stderr = baseDir, os.Stderr, os.Stderr
	check(build.Run())

	sides := []string{"base", "new"}
	bins := map[string][2]string{"base": {baseBin, baseLoadgen}, "new": {newBin, newLoadgen}}
	creds, err := pkifiles.EnsureLocal(filepath.Join(dir, "ab-credentials"), proccluster.ClusterName)
	check(err)
	addrs := map[string]string{}
	clusters := map[string]*proccluster.Cluster{}
	for _, s := range sides {
		cdir := filepath.Join(dir, "ab-"+s)
		check(os.MkdirAll(cdir, 0o755))
		c, err := proccluster.Start(proccluster.Config{Binary: bins[s][0], Dir: cdir, Nodes: 3, LimitsFile: limits,
			Credentials: creds, ExtraArgs: slices.Clone(extra)})
		check(err)
		clusters[s] = c
		defer c.KillAll()
		atExit = append(atExit, c.KillAll)
		leader, err := c.WaitLeader(20 * time.Second)
		check(err)
		addrs[s] = strings.Join(c.GRPCAddrs(), ",")
		logf("ab: %s cluster up: leader %s", s, c.Nodes[leader].ID)
		for _, kv := range c.ClientEnv() {
			k, v, _ := strings.Cut(kv, "=")
			check(os.Setenv(k, v))
		}
	}
	runs := map[string][2][]loadResult{}
	cpus := map[string][]float64{}
	for r := range rounds {
		order := slices.Clone(sides)
		if r%2 == 1 {
			slices.Reverse(order)
		}
		for _, s := range order {
			var serial, c64 loadResult
			cpu0 := clusterCPU(clusters[s])
			runLoadgen(bins[s][1], &serial, "-addrs", addrs[s], "-mode", "load", "-concurrency", "1",
				"-duration", dur.String(), "-warmup", "1s")
			// The warm-up's decisions are not counted: scale by the measured share of the run.
			cpu := float64(clusterCPU(clusters[s])-cpu0) / float64(time.Microsecond) * dur.Seconds() / (dur.Seconds() + 1)
			cpuPer := cpu / float64(max(serial.Decisions, 1))
			runLoadgen(bins[s][1], &c64, "-addrs", addrs[s], "-mode", "load", "-concurrency", "64",
				"-duration", dur.String(), "-warmup", "1s")
			logf("ab round %d %-4s: c=1 p50 %5.3f ms (%4.0f/s, errors %d, %3.0f µs agent CPU each)  c=64 %6.0f/s p99 %6.2f ms (errors %d) %s%s",
				r+1, s, serial.P50Ms, serial.PerSec, serial.Errors, cpuPer, c64.PerSec, c64.P99Ms, c64.Errors, serial.FirstError, c64.FirstError)
			cpus[s] = append(cpus[s], cpuPer)
			rs := runs[s]
			rs[0], rs[1] = append(rs[0], serial), append(rs[1], c64)
			runs[s] = rs
		}
	}
	out := map[string]*ABPoint{}
	for _, s := range sides {
		p := &ABPoint{}
		for _, x := range runs[s][0] {
			p.SerialP50Runs = append(p.SerialP50Runs, x.P50Ms)
		}
		for _, x := range runs[s][1] {
			p.C64Runs = append(p.C64Runs, x.PerSec)
		}
		p.SerialP50Ms = median(p.SerialP50Runs)
		p.SerialCPURuns = cpus[s]
		p.SerialCPUUs = median(cpus[s])
		m := medianPoint(64, runs[s][1])
		p.C64PerSec, p.C64P99Ms = m.DecisionsPerSec, m.P99Ms
		out[s] = p
		logf("ab %-4s: serial p50 %.3f ms %v, %.0f µs agent CPU per decision %v; c=64 %.0f/s p99 %.2f ms", s, p.SerialP50Ms, roundAll(p.SerialP50Runs, 1000),
			p.SerialCPUUs, roundAll(p.SerialCPURuns, 1), p.C64PerSec, p.C64P99Ms)
	}
	if out["base"].SerialP50Ms > 0 && out["base"].C64PerSec > 0 {
		logf("ab new/base: serial p50 %.3f×, agent CPU per serial decision %.3f×, c=64 throughput %.3f×, c=64 p99 %.3f×", out["new"].SerialP50Ms/out["base"].SerialP50Ms,
			out["new"].SerialCPUUs/out["base"].SerialCPUUs,
			out["new"].C64PerSec/out["base"].C64PerSec, out["new"].C64P99Ms/out["base"].C64P99Ms)
	}
	return out
}
