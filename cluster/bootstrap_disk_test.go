package cluster_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/cluster/clustertest"
)

// fullDisk is a Raft log store whose writes fail with ENOSPC's text while full is set, as a
// data dir too small for the WAL's preallocated 64 MiB segment does (a Kubernetes volume
// claim of 50Mi, say): "wal: create segment …: fallocate …: no space left on device".
type fullDisk struct {
	raft.LogStore
	full  *atomic.Bool
	fails *atomic.Int64
}

var errNoSpace = errors.New("fallocate wal segment: no space left on device")

func (d fullDisk) StoreLog(l *raft.Log) error {
	if d.full.Load() {
		d.fails.Add(1)
		return errNoSpace
	}
	return d.LogStore.StoreLog(l)
}

func (d fullDisk) StoreLogs(ls []*raft.Log) error {
	if d.full.Load() {
		d.fails.Add(1)
		return errNoSpace
	}
	return d.LogStore.StoreLogs(ls)
}

// TestBootstrapAfterLogWriteFailed: every node of a new cluster fails to write the bootstrap
// configuration entry (a full disk), then the disk is fixed. raft's BootstrapCluster records
// term 1 before it writes the entry, so every later attempt answered ErrCantBootstrap ("has
// existing state"), which the bootstrap loop took for success: each node logged "bootstrapped
// cluster" holding no configuration, and the cluster never elected a leader, not even after
// the disk was fixed and the nodes restarted. The loop now undoes the failed attempt's term
// and bootstraps once the entry can be written.
func TestBootstrapAfterLogWriteFailed(t *testing.T) {
	t.Parallel()
	var full atomic.Bool
	full.Store(true)
	fails := make([]*atomic.Int64, 3)
	for i := range fails {
		fails[i] = new(atomic.Int64)
	}
	logs := &syncBuffer{}
	c := clustertest.Start(t, 3, newCounterFSM, clustertest.WithConfig(func(i int, cfg *cluster.Config) {
		cfg.WrapLogStore = func(l raft.LogStore) raft.LogStore { return fullDisk{LogStore: l, full: &full, fails: fails[i]} }
		if i == 0 {
			cfg.Logger = slog.New(slog.NewTextHandler(logs, nil)) // not t.Output(): memberlist logs after the test ends
		}
	}))
	// Each node tried (and failed) to write the bootstrap entry at least twice: the second
	// attempt is the one that used to answer ErrCantBootstrap.
	clustertest.Eventually(t, 15*time.Second, func() error {
		for i, f := range fails {
			if f.Load() < 1 {
				return errors.New("node " + c.Node(i).ID() + " has not tried to bootstrap yet")
			}
		}
		return nil
	})
	time.Sleep(2 * time.Second)
	if li := c.Leader(); li >= 0 {
		t.Fatalf("node %d leads while every disk is full", li)
	}
	// It retries every 200 ms; its log says so once (it said so at each try, with another
	// line for each term cleared: 10 lines a second onto what may be the full disk).
	if n0 := fails[0].Load(); n0 < 5 {
		t.Fatalf("node0 tried to bootstrap %d times in 2 s, want every 200 ms", n0)
	}
	for _, msg := range []string{"bootstrap failed; retrying", "cleared it, bootstrapping again"} {
		if got := strings.Count(logs.String(), msg); got != 1 {
			t.Errorf("node0 logged %q %d times while its disk was full, want once", msg, got)
		}
	}
	full.Store(false)
	li := c.WaitLeader(15 * time.Second)
	if got := add(t, c.Node(li), 3); got != 3 {
		t.Fatalf("Apply response %d, want 3", got)
	}
}

// TestUndoFailedBootstrapKeepsALeadersTerm: node0's disk is full, so its bootstrap fails and
// leaves term 1; nodes 1 and 2 bootstrap a second later and elect a leader, whose messages make
// node0's raft record term 2 — here exactly while node0's bootstrap loop is between reading
// term 1 and clearing it. The clear overwrote the leader's term with 0 (raft kept 2 in memory,
// and later messages of the same term never wrote it again: a restart would forget the term,
// and a bootstrap once the disk had room rewound raft to term 1). The check and the clear now
// hold the stable store's write lock, so raft writes its term after the clear.
func TestUndoFailedBootstrapKeepsALeadersTerm(t *testing.T) {
	cluster.SetBootstrapHold(func(id string) time.Duration {
		if strings.HasSuffix(id, "0") {
			return 0
		}
		return time.Second
	})
	t.Cleanup(func() { cluster.SetBootstrapHold(nil) })
	var full atomic.Bool
	full.Store(true)
	var dir0 atomic.Value
	var fired, learned atomic.Bool
	cluster.SetUndoBootstrapCheck(func(dataDir string, raftTerm func() uint64) {
		if d, _ := dir0.Load().(string); d != dataDir || fired.Swap(true) {
			return
		}
		// Wait for the leader's term to reach node0's raft (at most 5 s: with the lock held,
		// raft cannot record it before this returns).
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if raftTerm() >= 2 {
				learned.Store(true)
				return
			}
		}
	})
	t.Cleanup(func() { cluster.SetUndoBootstrapCheck(nil) })
	c := clustertest.Start(t, 3, newCounterFSM, clustertest.WithConfig(func(i int, cfg *cluster.Config) {
		if i == 0 {
			dir0.Store(cfg.DataDir)
			cfg.WrapLogStore = func(l raft.LogStore) raft.LogStore {
				return fullDisk{LogStore: l, full: &full, fails: new(atomic.Int64)}
			}
		}
	}))
	li := c.WaitLeader(15 * time.Second)
	clustertest.Eventually(t, 15*time.Second, func() error {
		if !fired.Load() {
			return errors.New("node0 has not cleared a failed bootstrap's term yet")
		}
		return nil
	})
	n0 := c.Node(0)
	clustertest.Eventually(t, 10*time.Second, func() error {
		term, err := n0.PersistedTerm()
		if err != nil {
			return err
		}
		if rt := n0.RaftTerm(); term < 2 || term != rt {
			return fmt.Errorf("node0's stored term is %d, its raft's %d (learned during the clear: %v): the leader's term was overwritten", term, rt, learned.Load())
		}
		return nil
	})
	full.Store(false)
	if got := add(t, c.Node(li), 3); got != 3 {
		t.Fatalf("Apply response %d, want 3", got)
	}
}

// TestLastSnapshotIndex: LastSnapshotIndex (the quotad_raft_snapshot_index gauge) is 0 before
// the first snapshot and the snapshot's index after one, on the leader that took it and on a
// node restarted from it.
func TestLastSnapshotIndex(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 1, newCounterFSM)
	li := c.WaitLeader(leaderTimeout)
	n := c.Node(li)
	if got := n.LastSnapshotIndex(); got != 0 {
		t.Fatalf("LastSnapshotIndex before any snapshot = %d, want 0", got)
	}
	add(t, n, 2)
	meta, rc, err := n.SaveSnapshot(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	rc.Close()
	if got := n.LastSnapshotIndex(); got != meta.Index || got == 0 {
		t.Fatalf("LastSnapshotIndex after a snapshot at %d = %d", meta.Index, got)
	}
	c.Stop(li)
	c.Restart(li)
	li = c.WaitLeader(leaderTimeout)
	if got := c.Node(li).LastSnapshotIndex(); got != meta.Index {
		t.Fatalf("LastSnapshotIndex after a restart = %d, want %d", got, meta.Index)
	}
}
