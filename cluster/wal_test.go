package cluster_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/cluster/clustertest"
)

// stores records the durable log store each node last opened (through Config.WrapLogStore),
// so a test can see what a node's log holds.
type stores struct {
	mu   sync.Mutex
	logs map[int]raft.LogStore
}

func (s *stores) wrap(i int, c *cluster.Config) {
	c.WrapLogStore = func(l raft.LogStore) raft.LogStore {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.logs == nil {
			s.logs = map[int]raft.LogStore{}
		}
		s.logs[i] = l
		return l
	}
}

func (s *stores) firstIndex(t *testing.T, i int) uint64 {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	first, err := s.logs[i].FirstIndex()
	if err != nil {
		t.Fatal(err)
	}
	return first
}

// withLogStores gives node i the backend backends[i] (and small snapshot settings, so that a
// node that was down catches up by snapshot install and logs are compacted).
func withLogStores(st *stores, backends ...string) clustertest.Option {
	return clustertest.WithConfig(func(i int, c *cluster.Config) {
		c.LogStore = backends[i%len(backends)]
		c.SnapshotThreshold = 32
		c.TrailingLogs = 8
		c.SnapshotInterval = 200 * time.Millisecond
		st.wrap(i, c)
	})
}

// checkDataDir fails unless dir holds exactly backend's files.
func checkDataDir(t *testing.T, dir, backend string) {
	t.Helper()
	has := func(name string) bool { _, err := os.Stat(filepath.Join(dir, name)); return err == nil }
	bolt, wal := has("raft.db"), has("wal") && has("stable.db")
	if (backend == cluster.LogStoreWAL) != wal || (backend == cluster.LogStoreBoltDB) != bolt {
		t.Fatalf("data dir %s of a %s node: raft.db %v, wal/ and stable.db %v", dir, backend, bolt, wal)
	}
}

func lastSnapshotIndex(t *testing.T, n *cluster.Node) uint64 {
	t.Helper()
	v, err := strconv.ParseUint(n.Raft().Stats()["last_snapshot_index"], 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// exerciseCluster runs the same story on a 3-node cluster whatever its nodes' backends: writes,
// a follower down while the leader snapshots and compacts past it (it comes back through a
// snapshot install, then appends after it), a leader crash, and a total restart; nothing
// acknowledged is lost.
func exerciseCluster(t *testing.T, c *clustertest.Cluster, st *stores) {
	t.Helper()
	li := c.WaitLeader(leaderTimeout)
	var want int64
	for range 10 {
		want = add(t, c.Node(li), 1)
	}
	waitCount(t, c, want)

	f := 2 // the last node that is not the leader (the WAL node of TestMixedLogStores, if it is not leading)
	if f == li {
		f = 1
	}
	c.Kill(f)
	for range 100 {
		want = add(t, c.Node(li), 1)
	}
	if err := c.Node(li).Raft().Snapshot().Error(); err != nil {
		t.Fatalf("leader snapshot: %v", err)
	}
	snap := lastSnapshotIndex(t, c.Node(li))
	// The leader compacted its log past everything the follower has: it can only catch up
	// by installing the leader's snapshot.
	fLast := c.FSM(f).AppliedIndex()
	if first := st.firstIndex(t, li); first <= fLast+1 {
		t.Fatalf("leader's log starts at %d after a snapshot at %d; node%d stopped at %d and would not need the snapshot",
			first, snap, f, fLast)
	}
	c.Restart(f)
	waitCount(t, c, want)
	// Raft records the installed snapshot's index just after restoring the FSM from it, so
	// the count can be there a moment before the index (CI flake: "last snapshot 0").
	clustertest.Eventually(t, 5*time.Second, func() error {
		if got := lastSnapshotIndex(t, c.Node(f)); got < snap {
			return fmt.Errorf("node%d caught up with last snapshot %d, want the leader's %d installed", f, got, snap)
		}
		return nil
	})
	for range 5 { // appends after the installed snapshot
		want = add(t, c.Node(li), 1)
	}
	waitCount(t, c, want)

	c.Kill(li)
	ni := c.WaitLeader(leaderTimeout)
	want = add(t, c.Node(ni), 1)
	c.Restart(li)
	waitCount(t, c, want)

	for i := range 3 {
		c.Kill(i)
	}
	for i := range 3 {
		c.Restart(i)
	}
	li = c.WaitLeader(leaderTimeout)
	waitCount(t, c, want)
	want = add(t, c.Node(li), 1)
	waitCount(t, c, want)
}

func TestWALCluster(t *testing.T) {
	t.Parallel()
	var st stores
	c := clustertest.Start(t, 3, newCounterFSM, withLogStores(&st, cluster.LogStoreWAL))
	exerciseCluster(t, c, &st)
	for i := range 3 {
		checkDataDir(t, c.Config(i).DataDir, cluster.LogStoreWAL)
	}
}

// TestMixedLogStores: the backend is a node's own business — two BoltDB nodes and a WAL node
// form one cluster, and the WAL node also leads.
func TestMixedLogStores(t *testing.T) {
	t.Parallel()
	var st stores
	c := clustertest.Start(t, 3, newCounterFSM, withLogStores(&st, cluster.LogStoreBoltDB, cluster.LogStoreBoltDB, cluster.LogStoreWAL))
	exerciseCluster(t, c, &st)
	li := c.WaitLeader(leaderTimeout)
	if li != 2 {
		if err := c.Node(li).TransferLeadership("node2"); err != nil {
			t.Fatal(err)
		}
	}
	clustertest.Eventually(t, 5*time.Second, func() error {
		if !c.Node(2).IsLeader() {
			return errors.New("node2 (wal) is not the leader yet")
		}
		return nil
	})
	want := add(t, c.Node(2), 1)
	waitCount(t, c, want)
	for i, b := range []string{cluster.LogStoreBoltDB, cluster.LogStoreBoltDB, cluster.LogStoreWAL} {
		checkDataDir(t, c.Config(i).DataDir, b)
	}
}

// TestReplaceNodesWithWAL is the documented upgrade path: a BoltDB cluster (written by a
// build whose default was boltdb) restarted on this build with no LogStore setting keeps
// BoltDB and its state; under writes it becomes a WAL cluster by replacing one node at a
// time — stop it, start it with the same ID and an empty data dir (no setting: a new data dir
// gets the WAL; or LogStore wal); it catches up by snapshot before the next one.
func TestReplaceNodesWithWAL(t *testing.T) {
	t.Parallel()
	store := []string{cluster.LogStoreBoltDB, cluster.LogStoreBoltDB, cluster.LogStoreBoltDB}
	dirs := map[int]string{}
	// The replacements' data dirs, made before the cluster: t.Cleanup runs last-in first-out,
	// so a dir made later would be removed while its node still runs ("directory not empty").
	spare := [3]string{t.TempDir(), t.TempDir(), t.TempDir()}
	c := clustertest.Start(t, 3, newCounterFSM, clustertest.WithConfig(func(i int, cfg *cluster.Config) {
		cfg.LogStore = store[i]
		if d, ok := dirs[i]; ok {
			cfg.DataDir = d
		}
		cfg.SnapshotThreshold, cfg.TrailingLogs, cfg.SnapshotInterval = 32, 8, 200*time.Millisecond
	}))
	li := c.WaitLeader(leaderTimeout)
	var want int64
	for range 50 {
		want = add(t, c.Node(li), 1)
	}
	// The upgrade: every node restarted without a LogStore setting keeps its BoltDB log.
	for i := range 3 {
		c.Stop(i)
		store[i] = cluster.LogStoreAuto
		c.Restart(i)
		if got := c.Node(i).LogStore(); got != cluster.LogStoreBoltDB {
			t.Fatalf("node%d restarted on its BoltDB data dir without a LogStore setting opened %q", i, got)
		}
		checkDataDir(t, c.Config(i).DataDir, cluster.LogStoreBoltDB)
		li = c.WaitLeader(leaderTimeout)
		want = add(t, c.Node(li), 1)
		waitCount(t, c, want)
	}
	for i := range 3 {
		old := c.Config(i).DataDir
		c.Stop(i) // graceful: a leader hands over first
		li = c.WaitLeader(leaderTimeout)
		for range 20 { // the cluster goes on without it
			want = add(t, c.Node(li), 1)
		}
		// Starting the old data dir with the other backend is refused.
		cfg := c.Config(i)
		cfg.LogStore = cluster.LogStoreWAL
		if _, err := cluster.NewNode(cfg, newCounterFSM()); !errors.Is(err, cluster.ErrLogStoreMismatch) {
			t.Fatalf("node%d: NewNode on its BoltDB data dir with LogStore wal: %v, want ErrLogStoreMismatch", i, err)
		}
		// The replacement: an empty data dir, with no setting (nodes 0 and 2) or wal.
		store[i] = cluster.LogStoreAuto
		if i == 1 {
			store[i] = cluster.LogStoreWAL
		}
		dirs[i] = spare[i]
		c.Restart(i)
		if got := c.Node(i).LogStore(); got != cluster.LogStoreWAL {
			t.Fatalf("node%d replaced with an empty data dir and LogStore %q opened %q, want wal", i, store[i], got)
		}
		waitCount(t, c, want)
		li = c.WaitLeader(leaderTimeout)
		want = add(t, c.Node(li), 1)
		waitCount(t, c, want)
		checkDataDir(t, c.Config(i).DataDir, cluster.LogStoreWAL)
		checkDataDir(t, old, cluster.LogStoreBoltDB)
		// The leader demoted the emptied voter; it votes again only once it keeps up. The
		// next node may be replaced only then (README, step 4).
		id := c.Config(i).ID
		clustertest.Eventually(t, 15*time.Second, func() error {
			for _, m := range c.Node(c.WaitLeader(leaderTimeout)).Members() {
				if m.ID == id && m.Suffrage != cluster.SuffrageVoter {
					return fmt.Errorf("%s is %q, not a voter again yet", id, m.Suffrage)
				}
			}
			return nil
		})
	}
	for _, m := range c.Node(li).Members() {
		if m.Suffrage != cluster.SuffrageVoter {
			t.Errorf("after the replacement %s is %q, want voter", m.ID, m.Suffrage)
		}
	}
	// All WAL now: a leader crash and a total restart keep everything.
	c.Kill(li)
	ni := c.WaitLeader(leaderTimeout)
	want = add(t, c.Node(ni), 1)
	c.Restart(li)
	for i := range 3 {
		c.Kill(i)
	}
	for i := range 3 {
		c.Restart(i)
	}
	li = c.WaitLeader(leaderTimeout)
	waitCount(t, c, want)
	want = add(t, c.Node(li), 1)
	waitCount(t, c, want)
}

// TestLogStoreMismatchRefused: a data dir written by one backend is refused under the other,
// with an error naming both, the files, the flag and what to do, and nothing in it changes.
func TestLogStoreMismatchRefused(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ wrote, open string }{
		{cluster.LogStoreBoltDB, cluster.LogStoreWAL},
		{cluster.LogStoreWAL, cluster.LogStoreBoltDB},
	} {
		t.Run(tc.wrote+"-as-"+tc.open, func(t *testing.T) {
			t.Parallel()
			cfg := clustertest.TestConfig(t, "a")
			cfg.BootstrapExpect, cfg.MinVoters = 1, 1
			cfg.LogStore = tc.wrote
			n, err := cluster.NewNode(cfg, newCounterFSM())
			if err != nil {
				t.Fatal(err)
			}
			clustertest.Eventually(t, leaderTimeout, func() error {
				if !n.IsLeader() {
					return errors.New("single node not leader yet")
				}
				return nil
			})
			add(t, n, 7)
			if err := n.Shutdown(); err != nil {
				t.Fatal(err)
			}
			before := listDir(t, cfg.DataDir)

			cfg.LogStore = tc.open
			_, err = cluster.NewNode(cfg, newCounterFSM())
			if !errors.Is(err, cluster.ErrLogStoreMismatch) {
				t.Fatalf("NewNode: %v, want ErrLogStoreMismatch", err)
			}
			msg := err.Error()
			for _, want := range []string{
				fmt.Sprintf("holds a %s Raft log", tc.wrote), fmt.Sprintf("LogStore %q", tc.open),
				"--raft-log-store " + tc.wrote, "one node at a time", "empty --data-dir", cfg.DataDir,
			} {
				if !strings.Contains(msg, want) {
					t.Errorf("error does not say %q:\n%s", want, msg)
				}
			}
			if after := listDir(t, cfg.DataDir); after != before {
				t.Errorf("the refused start changed the data dir:\nbefore %s\nafter  %s", before, after)
			}

			// The right backend still opens it, with the state.
			cfg.LogStore = tc.wrote
			n, err = cluster.NewNode(cfg, newCounterFSM())
			if err != nil {
				t.Fatal(err)
			}
			defer n.Kill()
			clustertest.Eventually(t, leaderTimeout, func() error {
				if !n.IsLeader() {
					return errors.New("not leader yet")
				}
				return nil
			})
			if got := add(t, n, 1); got != 8 {
				t.Fatalf("count after reopening with %s: %d, want 8", tc.wrote, got)
			}
		})
	}

	t.Run("both", func(t *testing.T) {
		t.Parallel()
		cfg := clustertest.TestConfig(t, "a")
		for _, name := range []string{"raft.db", "stable.db"} {
			if err := os.WriteFile(filepath.Join(cfg.DataDir, name), nil, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		_, err := cluster.NewNode(cfg, newCounterFSM())
		if err == nil || !strings.Contains(err.Error(), "holds both") {
			t.Fatalf("NewNode on a data dir with both backends' files: %v", err)
		}
	})
}

// listDir lists dir's files with sizes (recursively) and modification times, to compare.
func listDir(t *testing.T, dir string) string {
	t.Helper()
	var sb strings.Builder
	err := filepath.Walk(dir, func(path string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		fmt.Fprintf(&sb, "%s:%d:%d ", rel, info.Size(), info.ModTime().UnixNano())
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return sb.String()
}

func TestConfigValidateLogStore(t *testing.T) {
	for _, v := range []string{"bolt", "WAL", "raft.db", "auto"} {
		c := clustertest.TestConfig(t, "a")
		c.LogStore = v
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("LogStore %q", v)) ||
			!strings.Contains(err.Error(), `"boltdb" or "wal", or leave it unset`) {
			t.Errorf("LogStore %q: Validate() = %v", v, err)
		}
	}
	for _, v := range []string{cluster.LogStoreBoltDB, cluster.LogStoreWAL, cluster.LogStoreAuto} {
		c := clustertest.TestConfig(t, "a")
		c.LogStore = v
		if err := c.Validate(); err != nil {
			t.Errorf("LogStore %q: %v", v, err)
		}
	}
	if d := cluster.DefaultConfig().LogStore; d != cluster.LogStoreAuto {
		t.Errorf("default LogStore %q, want LogStoreAuto (the data dir's own, wal for a new one)", d)
	}
}

// syncBuffer is a bytes.Buffer safe for a logger's concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestLogStoreChosenByDataDir: with no LogStore setting (the default), a data dir without a
// Raft log gets the WAL, and one written by either backend is opened with that backend, its
// state intact and no other backend's files created; the startup log says which and why.
func TestLogStoreChosenByDataDir(t *testing.T) {
	t.Parallel()
	for _, wrote := range []string{cluster.LogStoreBoltDB, cluster.LogStoreWAL, cluster.LogStoreAuto} {
		want := wrote
		if wrote == cluster.LogStoreAuto {
			want = cluster.LogStoreWAL
		}
		t.Run("wrote-"+want+"-setting-"+strconv.Quote(wrote), func(t *testing.T) {
			t.Parallel()
			cfg := clustertest.TestConfig(t, "a")
			cfg.BootstrapExpect, cfg.MinVoters = 1, 1
			start := func(setting string) (*cluster.Node, string) {
				t.Helper()
				var logs syncBuffer
				cfg.LogStore = setting
				cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(&logs, t.Output()), nil))
				n, err := cluster.NewNode(cfg, newCounterFSM())
				if err != nil {
					t.Fatal(err)
				}
				clustertest.Eventually(t, leaderTimeout, func() error {
					if !n.IsLeader() {
						return errors.New("single node not leader yet")
					}
					return nil
				})
				return n, logs.String()
			}

			n, logs := start(wrote)
			if got := n.LogStore(); got != want {
				t.Fatalf("new data dir with LogStore %q opened %q, want %q", wrote, got, want)
			}
			if wrote == cluster.LogStoreAuto &&
				(!strings.Contains(logs, "backend=wal") || !strings.Contains(logs, "default for new data dirs")) {
				t.Errorf("the startup log does not say the new data dir got wal by default:\n%s", logs)
			}
			add(t, n, 7)
			if err := n.Shutdown(); err != nil {
				t.Fatal(err)
			}

			n, logs = start(cluster.LogStoreAuto)
			defer n.Kill()
			if got := n.LogStore(); got != want {
				t.Fatalf("data dir written by %s reopened without a LogStore setting with %q", want, got)
			}
			why := fmt.Sprintf("the data dir's Raft log was written by %s", want)
			if !strings.Contains(logs, "backend="+want) || !strings.Contains(logs, why) {
				t.Errorf("the startup log does not say %q with backend=%s:\n%s", why, want, logs)
			}
			if got := add(t, n, 1); got != 8 {
				t.Fatalf("count after reopening the %s data dir without a setting: %d, want 8", want, got)
			}
			checkDataDir(t, cfg.DataDir, want)
		})
	}
}

// BenchmarkApplySerial is one Apply at a time on an in-process 3-node cluster (real raft, real
// files, loopback TCP): the commit latency a serial decision waits for — the leader's append,
// then a follower's — per log store backend.
//
//	go test ./cluster -run X -bench ApplySerial -benchtime 3s
func BenchmarkApplySerial(b *testing.B) {
	for _, backend := range []string{cluster.LogStoreBoltDB, cluster.LogStoreWAL} {
		b.Run(backend, func(b *testing.B) {
			c := clustertest.Start(b, 3, newCounterFSM, clustertest.WithConfig(func(i int, cfg *cluster.Config) {
				cfg.LogStore = backend
				cfg.LibraryLogLevel = 100 // quiet
			}))
			n := c.Node(c.WaitLeader(leaderTimeout))
			ctx := b.Context()
			for b.Loop() {
				ts, err := n.Now()
				if err != nil {
					b.Fatal(err)
				}
				if _, err := n.Apply(ctx, encodeAdd(ts, 1)); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
