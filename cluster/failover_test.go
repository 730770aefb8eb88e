package cluster_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/cluster/clustertest"
)

// TestFailoverTimes measures crash failover (kill -9 of the leader until a new leader has
// established its clock) and counts spurious elections under load. Opt in:
//
//	QUOTAD_FAILOVER_TRIALS=20 go test -run TestFailoverTimes -v ./cluster/
//
// QUOTAD_FAILOVER_HB=600ms overrides HeartbeatTimeout and ElectionTimeout to compare values.
func TestFailoverTimes(t *testing.T) {
	trials, _ := strconv.Atoi(os.Getenv("QUOTAD_FAILOVER_TRIALS"))
	if trials <= 0 {
		t.Skip("set QUOTAD_FAILOVER_TRIALS to measure failover")
	}
	var hb time.Duration
	if s := os.Getenv("QUOTAD_FAILOVER_HB"); s != "" {
		var err error
		if hb, err = time.ParseDuration(s); err != nil {
			t.Fatal(err)
		}
	}
	c := clustertest.Start(t, 3, newCounterFSM, clustertest.WithConfig(func(i int, cfg *cluster.Config) {
		if hb > 0 {
			cfg.HeartbeatTimeout, cfg.ElectionTimeout = hb, hb
			cfg.LeaderLeaseTimeout = min(cfg.LeaderLeaseTimeout, hb/2)
		}
	}))
	li := c.WaitLeader(leaderTimeout)

	// Load: writers applying as fast as they can plus CPU burners on every core, for a
	// while, counting term changes (there should be none).
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var applied atomic.Int64
	for range runtime.GOMAXPROCS(0) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			x := 0
			for {
				select {
				case <-stop:
					return
				default:
				}
				for k := range 100000 {
					x += k
				}
			}
		}()
	}
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				n := c.Node(li)
				ts, err := n.Now()
				if err != nil {
					continue
				}
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				if _, err := n.Apply(ctx, encodeAdd(ts, 1)); err == nil {
					applied.Add(1)
				}
				cancel()
			}
		}()
	}
	term0 := c.Node(li).Raft().CurrentTerm()
	loadFor := 10 * time.Second
	time.Sleep(loadFor) // measuring under load for a fixed period is the point here
	term1 := c.Node(li).Raft().CurrentTerm()
	close(stop)
	wg.Wait()
	t.Logf("under load for %s: %d applies, term %d -> %d (%d spurious elections)",
		loadFor, applied.Load(), term0, term1, term1-term0)

	var took []time.Duration
	for range trials {
		li = c.WaitLeader(leaderTimeout)
		start := time.Now()
		c.Kill(li)
		ni := c.WaitLeader(10 * time.Second)
		took = append(took, time.Since(start))
		t.Logf("trial %d: node%d killed, node%d leads (term %d) after %s", len(took), li, ni,
			c.Node(ni).Raft().CurrentTerm(), took[len(took)-1].Round(time.Millisecond))
		c.Restart(li)
		// let the restarted node catch up before the next kill
		clustertest.Eventually(t, 10*time.Second, func() error {
			l := c.Node(c.WaitLeader(leaderTimeout))
			for _, m := range l.Members() {
				if m.State != cluster.StateLeader && m.State != cluster.StateFollower {
					return fmt.Errorf("member %s %s", m.ID, m.State)
				}
			}
			return nil
		})
	}
	slices.Sort(took)
	t.Logf("failover over %d trials: min %s median %s p90 %s max %s", trials,
		took[0].Round(time.Millisecond), took[len(took)/2].Round(time.Millisecond),
		took[len(took)*9/10].Round(time.Millisecond), took[len(took)-1].Round(time.Millisecond))
}
