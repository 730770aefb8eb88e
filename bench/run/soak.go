package main

import (
	"strconv"
	"time"

	"github.com/quotad/quotad/internal/proccluster"
)

// soakRun alternates 30 s of load (concurrency 256, through the client library) and 30 s of
// idle for d, and returns how many leadership changes the nodes observed meanwhile (the sum
// over nodes of quotad_leader_changes_total's increase; nothing is killed, so every one is a
// spurious election) and the decisions made.
func soakRun(c *proccluster.Cluster, loadgen, addrs string, d time.Duration) (changes int, decisions int64) {
	changesNow := func() []float64 {
		var out []float64
		for i := range c.Nodes {
			v, err := scrapeMetric(c, i, "quotad_leader_changes_total")
			check(err)
			out = append(out, v)
		}
		return out
	}
	before := changesNow()
	const phase = 30 * time.Second
	end := time.Now().Add(d)
	for load := true; time.Now().Before(end); load = !load {
		left := min(phase, time.Until(end))
		if load {
			var res loadResult
			runLoadgen(loadgen, &res, "-addrs", addrs, "-mode", "load", "-concurrency", "256",
				"-duration", left.String(), "-warmup", "0s")
			logf("soak: %.0fs of load: %.0f decisions/s, p99 %.1f ms, errors %d %s", res.Seconds, res.PerSec, res.P99Ms, res.Errors, res.FirstError)
			decisions += res.Decisions
		} else {
			logf("soak: %s idle", left.Round(time.Second))
			time.Sleep(left)
		}
	}
	after := changesNow()
	for i := range after {
		if n := int(after[i] - before[i]); n != 0 {
			logf("soak: %s observed %s leadership changes", c.Nodes[i].ID, strconv.Itoa(n))
			changes += n
		}
	}
	if changes > 0 {
		// Say why: raft logs the timeout that started each election, and we log snapshots.
		hits, _ := c.ScanLogs("heartbeat timeout", "election", "lost leadership", "snapshot", "stepping down")
		for _, h := range hits {
			logf("soak: agent log: %s", h)
		}
	}
	return changes, decisions
}
