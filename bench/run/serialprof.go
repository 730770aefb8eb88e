package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/quotad/quotad/internal/proccluster"
)

// serialProfile (-only serial_profile) is a tool for looking at the serial exact path, not a
// measurement of record: a 3-node cluster of one --raft-log-store backend, the serial load
// (concurrency 1) for dur after a 1 s warm-up, and, over the middle of the measured part, an
// execution trace of every node (node<i>-<role>.trace, for `go tool trace` and its -pprof=sched,
// net, sync and syscall profiles) and of the load generator (loadgen.trace). A second serial
// run without tracing is logged beside it, so the tracing's own cost is visible, and a run with
// every node's CPU profile over the middle of it (node<i>.cpu.pprof, loadgen.cpu.pprof).
// With conc > 1 (-profile-concurrency) the same runs happen at that many concurrent callers,
// e.g. 64 to see where the CPU of the c=64 runs of log_store_compare goes.
func serialProfile(bin, loadgen, limits, dir, backend, outDir string, extra []string, dur time.Duration, conc int) {
	cs := strconv.Itoa(conc)
	check(os.MkdirAll(outDir, 0o755))
	cdir := filepath.Join(dir, "serialprof-"+backend)
	check(os.MkdirAll(cdir, 0o755))
	c, err := proccluster.Start(proccluster.Config{Binary: bin, Dir: cdir, Nodes: 3, LimitsFile: limits,
		ExtraArgs: append(extra, "--raft-log-store", backend)})
	check(err)
	defer c.KillAll()
	atExit = append(atExit, c.KillAll)
	leader, err := c.WaitLeader(20 * time.Second)
	check(err)
	for _, kv := range c.ClientEnv() {
		k, v, _ := strings.Cut(kv, "=")
		check(os.Setenv(k, v))
	}
	addrs := strings.Join(c.GRPCAddrs(), ",")
	var plain loadResult
	entries0, _ := scrapeMetric(c, leader, "quotad_entry_ops_count")
	runLoadgen(loadgen, &plain, "-addrs", addrs, "-mode", "load", "-concurrency", cs,
		"-duration", dur.String(), "-warmup", "1s")
	entries1, _ := scrapeMetric(c, leader, "quotad_entry_ops_count")
	// Both counts include the warm-up's RPCs and entries: per-decision ratios are a little low.
	logf("serial_profile %s: untraced c=%d p50 %.3f ms p99 %.3f ms (%.0f/s; %.1f decisions per RPC, %.1f per log entry, %d of %d batches held for the window)",
		backend, conc, plain.P50Ms, plain.P99Ms, plain.PerSec, float64(plain.Decisions)/float64(max(plain.RPCs, 1)),
		float64(plain.Decisions)/max(entries1-entries0, 1), plain.Held, plain.Batches)

	var profiles sync.WaitGroup
	for i := range c.Nodes {
		name := filepath.Join(outDir, fmt.Sprintf("node%d.cpu.pprof", i))
		profiles.Go(func() { cpuProfile(c, i, name, time.Second+dur/4, dur/2) })
	}
	var profiled loadResult
	runLoadgen(loadgen, &profiled, "-addrs", addrs, "-mode", "load", "-concurrency", cs,
		"-duration", dur.String(), "-warmup", "1s", "-cpuprofile", filepath.Join(outDir, "loadgen.cpu.pprof"))
	profiles.Wait()
	logf("serial_profile %s: CPU-profiled c=%d p50 %.3f ms p99 %.3f ms (%.0f/s, %d decisions)", backend, conc, profiled.P50Ms, profiled.P99Ms, profiled.PerSec, profiled.Decisions)

	// The nodes' traces start only now: overlapping the CPU-profiled run, tracing's own cost
	// would show up in those profiles.
	secs := max(1, int(dur/time.Second)/2)
	var wg sync.WaitGroup
	for i := range c.Nodes {
		role := "follower"
		if i == leader {
			role = "leader"
		}
		name := filepath.Join(outDir, fmt.Sprintf("node%d-%s.trace", i, role))
		wg.Go(func() { fetchTrace(c, i, name, time.Second+dur/4, secs) })
	}
	var traced loadResult
	runLoadgen(loadgen, &traced, "-addrs", addrs, "-mode", "load", "-concurrency", cs,
		"-duration", dur.String(), "-warmup", "1s", "-trace", filepath.Join(outDir, "loadgen.trace"))
	wg.Wait()
	logf("serial_profile %s: traced c=%d p50 %.3f ms p99 %.3f ms (%.0f/s); traces in %s", backend, conc, traced.P50Ms, traced.P99Ms, traced.PerSec, outDir)
}

// fetchTrace writes node i's execution trace of secs seconds, starting after wait, to name.
func fetchTrace(c *proccluster.Cluster, i int, name string, wait time.Duration, secs int) {
	time.Sleep(wait)
	hc := *c.HTTPClient()
	hc.Timeout = time.Duration(secs)*time.Second + 30*time.Second
	resp, err := hc.Get(c.URL(i, "/debug/pprof/trace?seconds="+strconv.Itoa(secs)))
	if err != nil {
		logf("trace of node %d: %v", i, err)
		return
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		logf("trace of node %d: %s %v", i, resp.Status, err)
		return
	}
	check(os.WriteFile(name, b, 0o644))
}
