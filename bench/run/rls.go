package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/quotad/quotad/internal/proccluster"
)

// RLSPoint is the Envoy RLS step at one concurrency: ShouldRateLimit calls from a separate
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

// rlsStep runs the RLS load at each concurrency (runs times, median reported).
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
