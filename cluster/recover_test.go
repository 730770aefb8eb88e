package cluster_test

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/cluster/clustertest"
)

// TestRecoverAfterLosingTheMajority: two of three nodes are lost for good (killed, data dirs
// gone). The survivor alone never elects a leader; recovered offline with itself as the only
// voter it leads with every entry it held, and replacement nodes join and catch up. Both log
// store backends.
func TestRecoverAfterLosingTheMajority(t *testing.T) {
	for _, backend := range []string{cluster.LogStoreWAL, cluster.LogStoreBoltDB} {
		t.Run(backend, func(t *testing.T) {
			t.Parallel()
			c := clustertest.Start(t, 3, newCounterFSM, clustertest.WithConfig(func(_ int, cfg *cluster.Config) { cfg.LogStore = backend }))
			l := c.WaitLeader(leaderTimeout)
			const n = 25
			for range n {
				add(t, c.Node(l), 1)
			}
			waitCount(t, c, n)
			addr := c.Node(l).RaftAddr()
			id := c.Node(l).ID()
			for i := range 3 {
				c.Kill(i)
				if i != l {
					wipe(t, c, i)
				}
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
			dir := c.Config(l).DataDir

			st, err := cluster.InspectDataDir(dir, log)
			if err != nil {
				t.Fatal(err)
			}
			if st.NodeID != id || st.LastIndex == 0 || len(st.Servers) != 3 || st.Recovering || st.LogStore != backend {
				t.Fatalf("inspect %s: %+v; want node %s, a log, 3 servers, not recovering, %s", dir, st, id, backend)
			}

			// Alone, the survivor cannot win an election: a majority of its configuration is gone.
			c.Restart(l)
			time.Sleep(3 * time.Second)
			if c.Node(l).IsLeader() {
				t.Fatal("the survivor became leader of a 3-voter configuration alone")
			}
			c.Kill(l)

			// The voters must name this node; nothing changes when they do not.
			if _, err := cluster.RecoverDataDir(dir, []raft.Server{{ID: "node9", Address: "127.0.0.1:1", Suffrage: raft.Voter}}, newCounterFSM(), log); err == nil || !strings.Contains(err.Error(), id) {
				t.Fatalf("recover without the node itself: err = %v, want one naming %s", err, id)
			}
			two := []raft.Server{{ID: raft.ServerID(id), Address: raft.ServerAddress(addr), Suffrage: raft.Voter}, {ID: "node9", Address: "127.0.0.1:1", Suffrage: raft.Voter}}
			if _, err := cluster.RecoverDataDir(dir, two, newCounterFSM(), log); err == nil || !strings.Contains(err.Error(), "exactly one") {
				t.Fatalf("recover with two voters: err = %v, want a refusal asking for exactly one", err)
			}
			if again, err := cluster.InspectDataDir(dir, log); err != nil || len(again.Servers) != 3 || again.LastIndex != st.LastIndex {
				t.Fatalf("a refused recovery changed the data dir: %+v, %v", again, err)
			}

			after, err := cluster.RecoverDataDir(dir, []raft.Server{{ID: raft.ServerID(id), Address: raft.ServerAddress(addr), Suffrage: raft.Voter}}, newCounterFSM(), log)
			if err != nil {
				t.Fatal(err)
			}
			if len(after.Servers) != 1 || string(after.Servers[0].ID) != id || after.SnapshotIndex < st.LastIndex {
				t.Fatalf("after recovery: %+v; want one voter %s and a snapshot at ≥ %d", after, id, st.LastIndex)
			}

			c.Restart(l)
			if got := c.WaitLeader(leaderTimeout); got != l {
				t.Fatalf("node%d leads, want the recovered node%d", got, l)
			}
			if got := counter(c, l).Count(); got != n {
				t.Fatalf("recovered count %d, want %d", got, n)
			}
			add(t, c.Node(l), 1)

			// Replacement nodes (new IDs, empty data dirs) join and catch up.
			a, b := c.AddNode(), c.AddNode()
			clustertest.Eventually(t, 30*time.Second, func() error {
				s := suffrages(c.Node(l))
				for _, i := range []int{a, b} {
					if s[c.Node(i).ID()] != cluster.SuffrageVoter {
						return fmt.Errorf("%s is %q", c.Node(i).ID(), s[c.Node(i).ID()])
					}
				}
				return nil
			})
			add(t, c.Node(l), 1)
			clustertest.Eventually(t, 10*time.Second, func() error {
				for _, i := range []int{l, a, b} {
					if got := counter(c, i).Count(); got != n+2 {
						return fmt.Errorf("node%d count %d, want %d", i, got, n+2)
					}
				}
				return nil
			})
		})
	}
}

// TestRecoverRefuses: a dir that is not a data dir, a running node's, and a node that was
// still catching up after a wipe are refused with errors that say what to do.
func TestRecoverRefuses(t *testing.T) {
	t.Parallel()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	self := func(c *clustertest.Cluster, i int) []raft.Server {
		return []raft.Server{{ID: raft.ServerID(c.Config(i).ID), Address: "127.0.0.1:1", Suffrage: raft.Voter}}
	}

	if _, err := cluster.RecoverDataDir(t.TempDir(), []raft.Server{{ID: "node0", Address: "127.0.0.1:1", Suffrage: raft.Voter}}, newCounterFSM(), log); !errors.Is(err, cluster.ErrNotDataDir) {
		t.Fatalf("empty dir: err = %v, want ErrNotDataDir", err)
	}

	c := clustertest.Start(t, 3, newCounterFSM)
	l := c.WaitLeader(leaderTimeout)
	add(t, c.Node(l), 1)
	waitCount(t, c, 1)
	if _, err := cluster.RecoverDataDir(c.Config(l).DataDir, self(c, l), newCounterFSM(), log); err == nil || !strings.Contains(err.Error(), "stop the node") {
		t.Fatalf("running node: err = %v, want one asking to stop the node", err)
	}

	// A wiped follower restarted while the others are down stays recovering (no leader to
	// catch up from): its log may lack committed entries.
	f := (l + 1) % 3
	for i := range 3 {
		c.Kill(i)
	}
	wipe(t, c, f)
	c.Restart(f)
	add := time.Now().Add(5 * time.Second)
	for !c.Node(f).Recovering() && time.Now().Before(add) {
		time.Sleep(10 * time.Millisecond)
	}
	c.Kill(f)
	if _, err := os.Stat(filepath.Join(c.Config(f).DataDir, "recovering")); err != nil {
		t.Fatalf("the wiped node left no recovering marker: %v", err)
	}
	if _, err := cluster.RecoverDataDir(c.Config(f).DataDir, self(c, f), newCounterFSM(), log); err == nil || !strings.Contains(err.Error(), "recover another survivor") {
		t.Fatalf("recovering node: err = %v, want one pointing at another survivor", err)
	}
}
