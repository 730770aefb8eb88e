package main

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/internal/proccluster"
)

// LogStorePoint is one backend's line of log_store_compare: the medians over the rounds of a
// serial run (concurrency 1) and a run at concurrency 64; c64_p99_ms is the p99 of the c=64
// run with the median throughput (as in the sweep). The per-round values are kept.
type LogStorePoint struct {
	SerialP50Ms   float64   `json:"serial_p50_ms"`
	C64PerSec     float64   `json:"c64_per_sec"`
	C64P99Ms      float64   `json:"c64_p99_ms"`
	SerialP50Runs []float64 `json:"serial_p50_runs_ms"`
	C64Runs       []float64 `json:"c64_runs_per_sec"`
	C64P99Runs    []float64 `json:"c64_p99_runs_ms"`
}

// logStoreBackends are the --raft-log-store values compared.
var logStoreBackends = []string{"boltdb", "wal"}

// logStoreCompare measures both Raft log store backends in one run: one 3-node cluster of
// each (separate processes, the binary's defaults plus --raft-log-store), both up for the whole
// step, and rounds that alternate which backend goes first (boltdb, wal, then wal, boltdb, ...)
// so that a machine getting busier or quieter during the step weighs on both alike. Each
// round runs the serial load (concurrency 1) and concurrency 64 against one backend, then the
// other. It returns the points and the 1-minute load average at the start and the end.
func logStoreCompare(bin, loadgen, limits, dir string, extra []string, rounds int, dur time.Duration) (map[string]*LogStorePoint, []float64) {
	load := []float64{loadAvg()}
	clusters := map[string]*proccluster.Cluster{}
	addrs := map[string]string{}
	defer func() {
		for _, c := range clusters {
			c.KillAll()
		}
	}()
	// One credential set for both clusters, so the load generator's $QUOTAD_* environment
	// serves either.
	creds, err := pkifiles.EnsureLocal(filepath.Join(dir, "logstore-credentials"), proccluster.ClusterName)
	check(err)
	for _, b := range logStoreBackends {
		cdir := filepath.Join(dir, "logstore-"+b)
		check(os.MkdirAll(cdir, 0o755))
		c, err := proccluster.Start(proccluster.Config{Binary: bin, Dir: cdir, Nodes: 3, LimitsFile: limits, Credentials: creds,
			ExtraArgs: append(slices.Clone(extra), "--raft-log-store", b)})
		check(err)
		clusters[b] = c
		atExit = append(atExit, c.KillAll)
		leader, err := c.WaitLeader(20 * time.Second)
		check(err)
		addrs[b] = strings.Join(c.GRPCAddrs(), ",")
		logf("log_store_compare: %s cluster up: leader %s", b, c.Nodes[leader].ID)
		for _, kv := range c.ClientEnv() {
			k, v, _ := strings.Cut(kv, "=")
			check(os.Setenv(k, v))
		}
	}
	runs := map[string][2][]loadResult{}
	for r := range rounds {
		order := slices.Clone(logStoreBackends)
		if r%2 == 1 {
			slices.Reverse(order)
		}
		for _, b := range order {
			var serial, c64 loadResult
			runLoadgen(loadgen, &serial, "-addrs", addrs[b], "-mode", "load", "-concurrency", "1",
				"-duration", dur.String(), "-warmup", "1s")
			runLoadgen(loadgen, &c64, "-addrs", addrs[b], "-mode", "load", "-concurrency", "64",
				"-duration", dur.String(), "-warmup", "1s")
			logf("log_store_compare round %d %-6s: c=1 p50 %5.2f ms (%4.0f/s, errors %d, batches held for the window %d/%d)  c=64 %6.0f/s p99 %6.2f ms (errors %d) %s%s",
				r+1, b, serial.P50Ms, serial.PerSec, serial.Errors, serial.Held, serial.Batches, c64.PerSec, c64.P99Ms, c64.Errors, serial.FirstError, c64.FirstError)
			rs := runs[b]
			rs[0], rs[1] = append(rs[0], serial), append(rs[1], c64)
			runs[b] = rs
		}
	}
	out := map[string]*LogStorePoint{}
	for _, b := range logStoreBackends {
		serial, c64 := runs[b][0], runs[b][1]
		p := &LogStorePoint{}
		for _, s := range serial {
			p.SerialP50Runs = append(p.SerialP50Runs, s.P50Ms)
		}
		for _, s := range c64 {
			p.C64Runs = append(p.C64Runs, s.PerSec)
			p.C64P99Runs = append(p.C64P99Runs, s.P99Ms)
		}
		p.SerialP50Ms = median(p.SerialP50Runs)
		m := medianPoint(64, c64)
		p.C64PerSec, p.C64P99Ms = m.DecisionsPerSec, m.P99Ms
		out[b] = p
	}
	for _, c := range clusters {
		hits, _ := c.ScanLogs("panic", "fatal error")
		for _, h := range hits {
			logf("agent log: %s", h)
		}
	}
	return out, append(load, loadAvg())
}

// loadAvg is the machine's 1-minute load average (0 if unreadable).
func loadAvg() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f, _ := strconv.ParseFloat(strings.Fields(string(b))[0], 64)
	return f
}

// printLogStoreCompare prints the comparison and the bar for changing the default:
// serial p50 ≤ 0.6× BoltDB's and c=64 throughput ≥ 1.5× at no worse p99.
func printLogStoreCompare(r *Report) {
	if r.LogStoreCompare == nil {
		return
	}
	fmt.Println("log store   serial p50 ms   c=64 decisions/s   c=64 p99 ms   (medians over rounds, alternating)")
	for _, b := range logStoreBackends {
		p := r.LogStoreCompare[b]
		if p == nil {
			continue
		}
		fmt.Printf("%-9s   %13.2f   %16.0f   %11.2f   serial %v  c=64 %v\n", b, p.SerialP50Ms, p.C64PerSec, p.C64P99Ms,
			roundAll(p.SerialP50Runs, 100), roundAll(p.C64Runs, 1))
	}
	bolt, wal := r.LogStoreCompare["boltdb"], r.LogStoreCompare["wal"]
	if bolt != nil && wal != nil && bolt.SerialP50Ms > 0 && bolt.C64PerSec > 0 {
		fmt.Printf("wal/boltdb  serial p50 %.2f× (bar ≤ 0.6×), c=64 throughput %.2f× (bar ≥ 1.5×), c=64 p99 %.2f× (bar ≤ 1×)\n",
			wal.SerialP50Ms/bolt.SerialP50Ms, wal.C64PerSec/bolt.C64PerSec, wal.C64P99Ms/bolt.C64P99Ms)
	}
	if len(r.LogStoreCompareLoad) == 2 {
		fmt.Printf("load average (1 min) at the start and end of the step: %.2f, %.2f\n", r.LogStoreCompareLoad[0], r.LogStoreCompareLoad[1])
	}
	if r.LogStoreCompareDisk != nil {
		fmt.Println(r.LogStoreCompareDisk)
	}
	fmt.Println()
}

func roundAll(xs []float64, scale float64) []float64 {
	out := make([]float64, len(xs))
	for i, x := range xs {
		out[i] = float64(int64(x*scale+0.5)) / scale
	}
	return out
}
