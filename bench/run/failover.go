package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/proccluster"
)

// failover kills the leader with SIGKILL `kills` times while probers keep asking for
// decisions, and returns, per kill, the time from the kill to the first admitted decision of
// a call that started after the kill. The killed node is restarted and caught up between
// trials.
func failover(c *proccluster.Cluster, kills int) []time.Duration {
	cfg := c.ClientConfig()
	cfg.AttemptTimeout = 300 * time.Millisecond
	cfg.Backoff = client.BackoffConfig{Initial: 5 * time.Millisecond, Max: 50 * time.Millisecond, Factor: 2}
	cl, err := client.New(cfg)
	check(err)
	defer cl.Close()

	var (
		killedAt atomic.Int64 // unix ns of the current kill, 0 between trials
		firstOK  atomic.Int64 // unix ns of the first admission started after it
		stop     atomic.Bool
		wg       sync.WaitGroup
	)
	for w := range 8 {
		wg.Go(func() {
			req := client.Request{Domain: "bench", Descriptors: []client.Entry{{Key: "tenant", Value: fmt.Sprintf("probe%d", w)}}}
			for !stop.Load() {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				start := time.Now().UnixNano()
				_, err := cl.Allow(ctx, req)
				cancel()
				if k := killedAt.Load(); err == nil && k != 0 && start >= k {
					firstOK.CompareAndSwap(0, time.Now().UnixNano())
				}
				if err != nil {
					time.Sleep(2 * time.Millisecond)
				}
			}
		})
	}
	defer func() { stop.Store(true); wg.Wait() }()

	var out []time.Duration
	for k := range kills {
		leader, err := c.WaitLeader(20 * time.Second)
		check(err)
		waitCaughtUp(c)
		time.Sleep(500 * time.Millisecond) // steady probing against this leader
		firstOK.Store(0)
		t0 := time.Now()
		killedAt.Store(t0.UnixNano())
		c.Kill(leader)
		deadline := time.Now().Add(15 * time.Second)
		for firstOK.Load() == 0 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		f := firstOK.Load()
		killedAt.Store(0)
		if f == 0 {
			check(fmt.Errorf("kill %d: no admitted decision within 15s of killing %s", k+1, c.Nodes[leader].ID))
		}
		d := time.Duration(f - t0.UnixNano())
		logf("kill %d: %s killed; first admitted decision after %v", k+1, c.Nodes[leader].ID, d.Round(time.Millisecond))
		out = append(out, d)
		check(c.Start(leader))
	}
	_, err = c.WaitLeader(20 * time.Second)
	check(err)
	waitCaughtUp(c)
	return out
}

// waitCaughtUp waits until every node answers and all report the same applied index within
// a few hundred entries (the probers keep the log moving, and followers apply a little after
// the leader), or 30 s pass.
func waitCaughtUp(c *proccluster.Cluster) {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		var lo, hi uint64
		ok := true
		for i := range c.Nodes {
			s, err := c.State(context.Background(), i)
			if err != nil {
				ok = false
				break
			}
			if lo == 0 || s.AppliedIndex < lo {
				lo = s.AppliedIndex
			}
			hi = max(hi, s.AppliedIndex)
		}
		if ok && hi-lo <= 256 {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	logf("warning: nodes did not catch up within 30s")
}
