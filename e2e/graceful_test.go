package e2e

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/quotad/quotad/client"
)

// TestSIGTERMLeaderHandsOver: SIGTERM (what Kubernetes, systemd and docker stop send) makes the
// leader hand leadership to another voter before it exits — its log says so, a new leader is
// there as it exits, and a client deciding back to back sees a short gap, not a failover.
func TestSIGTERMLeaderHandsOver(t *testing.T) {
	c := startCluster(t, 3)
	cl, err := client.New(c.ClientConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var (
		mu      sync.Mutex
		last    = time.Now()
		maxGap  time.Duration
		stopped = make(chan struct{})
		wg      sync.WaitGroup
	)
	wg.Go(func() {
		for {
			select {
			case <-stopped:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_, err := cl.Allow(ctx, client.Request{Domain: "provider", Descriptors: client.Descriptors("endpoint", "search")})
			cancel()
			if err == nil {
				mu.Lock()
				maxGap = max(maxGap, time.Since(last))
				last = time.Now()
				mu.Unlock()
			}
			time.Sleep(2 * time.Millisecond)
		}
	})
	time.Sleep(500 * time.Millisecond)
	leader := c.Leader(context.Background())
	mu.Lock()
	maxGap = 0
	mu.Unlock()
	start := time.Now()
	c.Stop(leader) // SIGTERM, waits for the exit
	exited := time.Since(start)
	next := -1
	for deadline := time.Now().Add(time.Second); next < 0 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		next = c.Leader(context.Background())
	}
	newLeader := time.Since(start)
	time.Sleep(time.Second)
	close(stopped)
	wg.Wait()
	if next < 0 || next == leader {
		t.Fatalf("no other leader within 1 s of the old one's exit (got %d)", next)
	}
	hits, _ := c.ScanLogs("leadership transfer before shutdown failed")
	if len(hits) > 0 {
		t.Fatalf("handover failed: %s", strings.Join(hits, "\n"))
	}
	mu.Lock()
	defer mu.Unlock()
	t.Logf("SIGTERM to exit %v; new leader %s seen after %v; longest gap between decisions %v", exited.Round(time.Millisecond),
		c.Nodes[next].ID, newLeader.Round(time.Millisecond), maxGap.Round(time.Millisecond))
	// The handover happens before the exit, so the new leader is there when the old one is
	// gone; after a crash it takes an election timeout (~0.8 s here with kill -9).
	if newLeader-exited > 500*time.Millisecond {
		t.Errorf("the new leader appeared %v after the old one exited: no handover", newLeader-exited)
	}
	if maxGap > time.Second {
		t.Errorf("decisions stopped for %v around the leader's SIGTERM: it did not hand over first", maxGap)
	}
}

// TestGracefulStopLogsNoError: a node stopped gracefully (SIGTERM) — the leader, which hands
// leadership over first, or a follower — logs no ERROR line on its way out, and neither do the
// other nodes while it is gone (it left gossip, so they know it left on purpose): an operator
// stopping a node for an upgrade should not see errors that mean nothing went wrong. Several
// rounds, since what raft logs while the node leaves depends on timing.
func TestGracefulStopLogsNoError(t *testing.T) {
	c := startCluster(t, 3)
	cl, err := client.New(c.ClientConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	stopped := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { // traffic, so replication is busy when a node leaves
		for {
			select {
			case <-stopped:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_, _ = cl.Allow(ctx, client.Request{Domain: "provider", Descriptors: client.Descriptors("endpoint", "search")})
			cancel()
			time.Sleep(time.Millisecond)
		}
	})
	defer func() { close(stopped); wg.Wait() }()
	for round := range 6 {
		leader, err := c.WaitLeader(10 * time.Second)
		if err != nil {
			t.Fatal(err)
		}
		i := leader
		if round%2 == 1 {
			i = (leader + 1) % 3
		}
		n := c.Nodes[i]
		sizes := make([]int64, len(c.Nodes))
		for j, m := range c.Nodes {
			st, err := os.Stat(m.LogPath)
			if err != nil {
				t.Fatal(err)
			}
			sizes[j] = st.Size()
		}
		c.Stop(i)
		// The others go on without it for a while: their replication and gossip meet a peer
		// that is gone, on purpose.
		time.Sleep(1500 * time.Millisecond)
		role := "leader"
		if i != leader {
			role = "follower"
		}
		for j, m := range c.Nodes {
			b, err := os.ReadFile(m.LogPath)
			if err != nil {
				t.Fatal(err)
			}
			var errs []string
			for _, l := range strings.Split(string(b[sizes[j]:]), "\n") {
				if strings.Contains(l, `"level":"ERROR"`) {
					errs = append(errs, l)
				}
			}
			if len(errs) == 0 {
				continue
			}
			if j == i {
				t.Errorf("round %d: %s %s logged ERROR while stopping gracefully:\n%s", round, role, n.ID, strings.Join(errs, "\n"))
			} else {
				t.Errorf("round %d: %s logged ERROR while %s %s stopped gracefully:\n%s", round, m.ID, role, n.ID, strings.Join(errs, "\n"))
			}
		}
		if err := c.Start(i); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Second) // it rejoins and catches up before the next round
	}
}
