package cluster_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/cluster/clustertest"
)

const leaderTimeout = 10 * time.Second

func grpcAddrs(i int, c *cluster.Config) { c.GRPCAddr = fmt.Sprintf("127.0.0.1:%d", 7000+i) }

func add(t *testing.T, n *cluster.Node, delta int64) int64 {
	t.Helper()
	ts, err := n.Now()
	if err != nil {
		t.Fatalf("%s: Now: %v", n.ID(), err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := n.Apply(ctx, encodeAdd(ts, delta))
	if err != nil {
		t.Fatalf("%s: Apply: %v", n.ID(), err)
	}
	return resp.(int64)
}

func counter(c *clustertest.Cluster, i int) *counterFSM { return c.FSM(i).(*counterFSM) }

// waitCount waits until every running node's FSM has count want.
func waitCount(t *testing.T, c *clustertest.Cluster, want int64) {
	t.Helper()
	clustertest.Eventually(t, 5*time.Second, func() error {
		for i := range c.Len() {
			if c.Node(i) == nil {
				continue
			}
			if got := counter(c, i).Count(); got != want {
				return fmt.Errorf("node%d count %d, want %d", i, got, want)
			}
		}
		return nil
	})
}

func suffrages(n *cluster.Node) map[string]string {
	out := map[string]string{}
	for _, m := range n.Members() {
		out[m.ID] = m.Suffrage
	}
	return out
}

func TestFormApplyFollowerRejects(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 3, newCounterFSM, clustertest.WithConfig(grpcAddrs))
	li := c.WaitLeader(leaderTimeout)
	leader := c.Node(li)

	if got := add(t, leader, 5); got != 5 {
		t.Fatalf("Apply response %d, want 5", got)
	}
	if err := leader.VerifyRead(context.Background()); err != nil {
		t.Fatalf("leader VerifyRead: %v", err)
	}
	waitCount(t, c, 5)

	ms := leader.Members()
	if len(ms) != 3 {
		t.Fatalf("Members: %+v, want 3", ms)
	}
	for _, m := range ms {
		if m.Suffrage != cluster.SuffrageVoter {
			t.Errorf("member %s suffrage %q, want voter", m.ID, m.Suffrage)
		}
		if (m.ID == leader.ID()) != (m.State == cluster.StateLeader) {
			t.Errorf("member %s state %q (leader is %s)", m.ID, m.State, leader.ID())
		}
	}

	for i := range 3 {
		if i == li {
			continue
		}
		f := c.Node(i)
		if f.IsLeader() {
			t.Errorf("node%d IsLeader on a follower", i)
		}
		if _, err := f.Now(); !errors.Is(err, cluster.ErrNotLeader) {
			t.Errorf("follower Now: %v, want ErrNotLeader", err)
		}
		_, err := f.Apply(context.Background(), encodeAdd(1, 1))
		if !errors.Is(err, cluster.ErrNotLeader) || !errors.Is(err, raft.ErrNotLeader) {
			t.Errorf("follower Apply: %v, want ErrNotLeader (and raft.ErrNotLeader)", err)
		}
		if err := f.VerifyRead(context.Background()); !errors.Is(err, cluster.ErrNotLeader) {
			t.Errorf("follower VerifyRead: %v, want ErrNotLeader", err)
		}
		if err := f.TransferLeadership(""); !errors.Is(err, cluster.ErrNotLeader) {
			t.Errorf("follower TransferLeadership: %v, want ErrNotLeader", err)
		}
		clustertest.Eventually(t, 5*time.Second, func() error {
			id, addr := f.Leader()
			if want := fmt.Sprintf("127.0.0.1:%d", 7000+li); id != leader.ID() || addr != want {
				return fmt.Errorf("node%d Leader() = %q %q, want %q %q", i, id, addr, leader.ID(), want)
			}
			return nil
		})
	}
	waitCount(t, c, 5)
}

func TestLeaderCrashFailover(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 3, newCounterFSM)
	li := c.WaitLeader(leaderTimeout)
	old := c.Node(li)
	add(t, old, 1)
	changed := make(map[int]<-chan struct{})
	for i := range 3 {
		changed[i] = c.Node(i).LeaderChanged()
	}

	ts1, err := old.Now()
	if err != nil {
		t.Fatal(err)
	}
	real1 := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := old.Apply(ctx, encodeAdd(ts1, 1)); err != nil {
		t.Fatal(err)
	}
	waitCount(t, c, 2)

	killedAt := time.Now()
	c.Kill(li)
	ni := c.WaitLeader(3 * time.Second)
	took := time.Since(killedAt)
	t.Logf("failover: node%d -> node%d established in %s", li, ni, took.Round(time.Millisecond))

	nl := c.Node(ni)
	ts2, err := nl.Now()
	if err != nil {
		t.Fatal(err)
	}
	elapsed := time.Since(real1)
	if ts2 < ts1 {
		t.Fatalf("new leader's Now %d is before the committed timestamp %d", ts2, ts1)
	}
	if d := time.Duration(ts2 - ts1); d > elapsed {
		t.Fatalf("new leader credited %s of FSM time, but only %s of real time passed", d, elapsed)
	}
	for i := range 3 {
		if i == li {
			continue
		}
		select {
		case <-changed[i]:
		default:
			t.Errorf("node%d: LeaderChanged not closed after failover", i)
		}
	}
	if got := add(t, nl, 1); got != 3 {
		t.Fatalf("count after failover %d, want 3", got)
	}

	// The crashed node comes back and catches up.
	c.Restart(li)
	waitCount(t, c, 3)
}

func TestRestartAllKeepsState(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 3, newCounterFSM)
	li := c.WaitLeader(leaderTimeout)
	for range 10 {
		add(t, c.Node(li), 1)
	}
	// One node snapshots, so restart also exercises Restore.
	if err := c.Node(li).Raft().Snapshot().Error(); err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	add(t, c.Node(li), 1)
	waitCount(t, c, 11)
	clock := c.FSM(li).Clock()

	for i := range 3 {
		c.Kill(i)
	}
	for i := range 3 {
		c.Restart(i)
	}
	li = c.WaitLeader(leaderTimeout)
	waitCount(t, c, 11)
	ts, err := c.Node(li).Now()
	if err != nil {
		t.Fatal(err)
	}
	if ts < clock {
		t.Fatalf("Now %d after restart is before the FSM clock %d before it", ts, clock)
	}
	if got := add(t, c.Node(li), 1); got != 12 {
		t.Fatalf("count %d, want 12", got)
	}
}

func TestJoinPromoteAndDeadNodeRemoval(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 3, newCounterFSM)
	li := c.WaitLeader(leaderTimeout)
	add(t, c.Node(li), 7)

	ni := c.AddNode()
	id := c.Node(ni).ID()
	sawNonvoter := false
	clustertest.Eventually(t, 10*time.Second, func() error {
		l := c.Node(c.WaitLeader(leaderTimeout))
		switch s := suffrages(l)[id]; s {
		case cluster.SuffrageNonvoter:
			sawNonvoter = true
			return fmt.Errorf("%s still a non-voter", id)
		case cluster.SuffrageVoter:
			return nil
		default:
			return fmt.Errorf("%s suffrage %q", id, s)
		}
	})
	if !sawNonvoter {
		t.Errorf("%s became a voter without being seen as a non-voter first", id)
	}
	waitCount(t, c, 7)

	// The 4th node dies: after DeadNodeTimeout it is removed (4 voters > MinVoters 3).
	c.Kill(ni)
	clustertest.Eventually(t, 15*time.Second, func() error {
		l := c.Node(c.WaitLeader(leaderTimeout))
		if s, ok := suffrages(l)[id]; ok && s != "" {
			return fmt.Errorf("%s still in the configuration as %s", id, s)
		}
		return nil
	})

	// With 3 voters, a dead follower is kept.
	li = c.WaitLeader(leaderTimeout)
	fi := (li + 1) % 3
	fid := c.Node(fi).ID()
	c.Kill(fi)
	var deadSeen time.Time
	clustertest.Eventually(t, 10*time.Second, func() error {
		for _, m := range c.Node(li).Members() {
			if m.ID == fid && m.State == cluster.StateUnreachable {
				deadSeen = time.Now()
				return nil
			}
		}
		return fmt.Errorf("%s not yet reported unreachable", fid)
	})
	dnt := c.Config(li).DeadNodeTimeout
	for time.Since(deadSeen) < dnt+3*c.Config(li).ReconcileInterval+500*time.Millisecond {
		if s := suffrages(c.Node(li))[fid]; s != cluster.SuffrageVoter {
			t.Fatalf("dead voter %s was removed (suffrage %q) leaving fewer than MinVoters", fid, s)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !c.Node(li).IsLeader() {
		t.Fatalf("leader changed during the test")
	}
	add(t, c.Node(li), 1) // 2 of 3 voters still commit
}

func TestIdleTicksAdvanceFSMClock(t *testing.T) {
	t.Parallel()
	const interval = 50 * time.Millisecond
	r0 := time.Now() // a new cluster's FSM clock starts at 0 when leadership is established
	c := clustertest.Start(t, 1, newCounterFSM, clustertest.WithConfig(func(i int, cfg *cluster.Config) {
		cfg.MinVoters = 1
		cfg.TickInterval = interval
	}))
	li := c.WaitLeader(leaderTimeout)
	f := counter(c, li)
	ticks0 := f.Ticks()
	clustertest.Eventually(t, 5*time.Second, func() error {
		if n := f.Ticks() - ticks0; n < 5 {
			return fmt.Errorf("%d ticks so far", n)
		}
		return nil
	})
	advanced := time.Duration(f.Clock())
	if real := time.Since(r0); advanced <= 0 || advanced > real {
		t.Fatalf("FSM clock advanced %s in %s of real time", advanced, real)
	}
	// Traffic suppresses ticks: while applies keep coming faster than TickInterval, the
	// tick count stays (almost) still. A gap between applies longer than TickInterval (a disk
	// stall on a shared machine: fsyncs of hundreds of ms were seen) rightly lets a tick in,
	// so each such gap allows one tick per TickInterval it lasted.
	before := f.Ticks()
	last := time.Now()
	allowed := 1
	deadline := last.Add(400 * time.Millisecond)
	for time.Now().Before(deadline) {
		add(t, c.Node(li), 1)
		now := time.Now()
		allowed += int(now.Sub(last) / interval)
		last = now
		time.Sleep(5 * time.Millisecond)
	}
	n := f.Ticks() - before
	allowed += int(time.Since(last) / interval)
	if n > int64(allowed) {
		t.Errorf("%d ticks while busy, want at most %d (1, plus one per %v without an apply)", n, allowed, interval)
	}
	if allowed > 1 {
		t.Logf("applies stalled: %d ticks allowed, %d seen", allowed, n)
	}
}

func TestGracefulShutdownTransfersLeadership(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 3, newCounterFSM)
	li := c.WaitLeader(leaderTimeout)
	add(t, c.Node(li), 1)
	c.Stop(li)
	// After a crash nobody campaigns before HeartbeatTimeout has passed; a transfer elects
	// the target right away, so a leader is there well before that.
	start := time.Now()
	ni := c.WaitLeader(c.Config(li).HeartbeatTimeout - 100*time.Millisecond)
	t.Logf("after graceful shutdown node%d leads in %s", ni, time.Since(start).Round(time.Millisecond))
	if got := add(t, c.Node(ni), 1); got != 2 {
		t.Fatalf("count %d, want 2", got)
	}
}

func TestTransferLeadershipTo(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 3, newCounterFSM)
	li := c.WaitLeader(leaderTimeout)
	to := (li + 1) % 3
	if err := c.Node(li).TransferLeadership("nope"); !errors.Is(err, cluster.ErrUnknownServer) {
		t.Fatalf("transfer to unknown: %v", err)
	}
	// To itself: a no-op (it already leads).
	if err := c.Node(li).TransferLeadership(c.Node(li).ID()); err != nil || !c.Node(li).IsLeader() {
		t.Fatalf("transfer to the leader itself: %v (leads: %v), want a no-op", err, c.Node(li).IsLeader())
	}
	if err := c.Node(li).TransferLeadership(c.Node(to).ID()); err != nil {
		t.Fatalf("transfer: %v", err)
	}
	if got := c.WaitLeader(3 * time.Second); got != to {
		t.Fatalf("leader node%d, want node%d", got, to)
	}
}

func TestRestartOnNewAddress(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 3, newCounterFSM)
	li := c.WaitLeader(leaderTimeout)
	fi := (li + 1) % 3
	oldAddr := c.Node(fi).RaftAddr()
	c.Kill(fi)
	add(t, c.Node(li), 3)
	c.RestartNewAddr(fi)
	newAddr := c.Node(fi).RaftAddr()
	if newAddr == oldAddr {
		t.Skipf("OS reused port %s", oldAddr)
	}
	clustertest.Eventually(t, 20*time.Second, func() error {
		l := c.Node(c.WaitLeader(leaderTimeout))
		for _, m := range l.Members() {
			if m.ID == c.Node(fi).ID() {
				if m.RaftAddr != newAddr || m.Suffrage != cluster.SuffrageVoter {
					return fmt.Errorf("%s: %s %s, want voter at %s", m.ID, m.Suffrage, m.RaftAddr, newAddr)
				}
				return nil
			}
		}
		return fmt.Errorf("node%d missing", fi)
	})
	waitCount(t, c, 3)
}

// skewClock is a Clock whose wall reading can jump; it keeps the monotonic reading of
// time.Now unless stripMono is set, in which case jumps are visible to Sub.
type skewClock struct {
	mu     sync.Mutex
	offset time.Duration
}

func (s *skewClock) Now() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return time.Now().Round(0).Add(s.offset) // Round(0) strips the monotonic reading
}

func (s *skewClock) jump(d time.Duration) {
	s.mu.Lock()
	s.offset += d
	s.mu.Unlock()
}

func TestNowNeverDecreasesOnClockJumpBack(t *testing.T) {
	t.Parallel()
	clk := &skewClock{}
	c := clustertest.Start(t, 1, newCounterFSM, clustertest.WithConfig(func(i int, cfg *cluster.Config) {
		cfg.MinVoters = 1
		cfg.Clock = clk
	}))
	n := c.Node(c.WaitLeader(leaderTimeout))
	t1, err := n.Now()
	if err != nil {
		t.Fatal(err)
	}
	clk.jump(-time.Hour)
	t2, err := n.Now()
	if err != nil {
		t.Fatal(err)
	}
	if t2 < t1 {
		t.Fatalf("Now went back from %d to %d after a clock jump", t1, t2)
	}
	add(t, n, 1)
}

func TestConfigValidate(t *testing.T) {
	valid := func() cluster.Config {
		c := cluster.DefaultConfig()
		c.ID, c.DataDir, c.RaftAddr, c.GossipAddr = "n1", "/tmp/x", "127.0.0.1:0", "127.0.0.1:0"
		c.PeerTLS, c.GossipSecretKey = clustertest.PKI(t).PeerTLS, clustertest.PKI(t).GossipKey
		return c
	}
	base := valid()
	if err := base.Validate(); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	long := valid()
	long.ID = strings.Repeat("n", 128)
	long.RaftAddr, long.GossipAddr = strings.Repeat("r", 45)+".example.com:7201", strings.Repeat("s", 45)+".example.com:7301"
	long.GRPCAddr, long.HTTPAddr = strings.Repeat("g", 45)+".example.com:7101", strings.Repeat("h", 45)+".example.com:7401"
	if err := long.Validate(); err != nil {
		t.Fatalf("a 128-byte ID and 62-byte addresses: %v", err)
	}
	insecure := valid()
	insecure.PeerTLS, insecure.GossipSecretKey, insecure.Insecure = nil, nil, true
	if err := insecure.Validate(); err != nil {
		t.Fatalf("insecure config without TLS and gossip key: %v", err)
	}
	for _, tc := range []struct {
		name   string
		mutate func(*cluster.Config)
		want   string
	}{
		{"no id", func(c *cluster.Config) { c.ID = "" }, "ID is empty"},
		{"no dir", func(c *cluster.Config) { c.DataDir = "" }, "DataDir"},
		{"bad raft addr", func(c *cluster.Config) { c.RaftAddr = "nohost" }, `RaftAddr "nohost"`},
		{"no raft host", func(c *cluster.Config) { c.RaftAddr = ":8300" }, `RaftAddr ":8300" has no host`},
		{"bad join", func(c *cluster.Config) { c.Join = []string{"a:1", "b"} }, `Join[1] "b"`},
		{"lease", func(c *cluster.Config) { c.LeaderLeaseTimeout = 2 * time.Second }, "LeaderLeaseTimeout 2s must be <= HeartbeatTimeout 400ms"},
		{"election", func(c *cluster.Config) { c.ElectionTimeout = 300 * time.Millisecond }, "ElectionTimeout 300ms must be >= HeartbeatTimeout 400ms"},
		{"append", func(c *cluster.Config) { c.MaxAppendEntries = 2048 }, "MaxAppendEntries 2048"},
		{"tick", func(c *cluster.Config) { c.TickInterval = 0 }, "TickInterval 0s must be positive"},
		{"voters", func(c *cluster.Config) { c.MinVoters = 0 }, "MinVoters 0"},
		{"key", func(c *cluster.Config) { c.GossipSecretKey = []byte("short") }, "GossipSecretKey is 5 bytes"},
		{"no peer tls", func(c *cluster.Config) { c.PeerTLS = nil }, "`quotad tls ca create`, a server certificate per node with `quotad tls cert create --server`"},
		{"no peer tls insecure hint", func(c *cluster.Config) { c.PeerTLS = nil }, "or run with --insecure"},
		{"no gossip key", func(c *cluster.Config) { c.GossipSecretKey = nil }, "`quotad keygen`"},
		{"tls without cert", func(c *cluster.Config) { c.PeerTLS = &tls.Config{} }, "PeerTLS presents no certificate"},
		{"expect", func(c *cluster.Config) { c.BootstrapExpect = -1 }, "BootstrapExpect -1"},
		{"meta", func(c *cluster.Config) { c.GRPCAddr = "h" + strings.Repeat("x", 500) + ":1" }, "gossip metadata"},
		// 411 bytes of ID and addresses: the metadata with every other field at its longest
		// (applied index, leave commitment...) exceeds memberlist's 512.
		{"meta at worst", func(c *cluster.Config) {
			c.ID = strings.Repeat("n", 128)
			c.GRPCAddr, c.HTTPAddr = "g"+strings.Repeat("x", 200)+":7101", "h"+strings.Repeat("x", 60)+":7401"
		}, "make the gossip metadata up to"},
	} {
		c := valid()
		tc.mutate(&c)
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Validate() = %v, want it to mention %q", tc.name, err, tc.want)
		}
	}
}

func TestRestartWithoutJoinUsesSavedPeers(t *testing.T) {
	t.Parallel()
	var noJoin sync.Map // node index -> true: start without a Join list
	c := clustertest.Start(t, 3, newCounterFSM, clustertest.WithConfig(func(i int, cfg *cluster.Config) {
		if _, ok := noJoin.Load(i); ok {
			cfg.Join = nil
		}
	}))
	li := c.WaitLeader(leaderTimeout)
	fi := (li + 1) % 3
	// Wait until fi has seen (and saved) both peers.
	clustertest.Eventually(t, 5*time.Second, func() error {
		alive := 0
		for _, m := range c.Node(fi).Members() {
			if m.State == cluster.StateFollower || m.State == cluster.StateLeader {
				alive++
			}
		}
		if alive != 3 {
			return fmt.Errorf("node%d sees %d alive members", fi, alive)
		}
		return nil
	})
	clustertest.Eventually(t, 5*time.Second, func() error {
		b, err := os.ReadFile(filepath.Join(c.Config(fi).DataDir, "gossip-peers.json"))
		if err != nil || strings.Count(string(b), ":") != 2 {
			return fmt.Errorf("saved peers %q, %v", b, err)
		}
		return nil
	})
	c.Kill(fi)
	noJoin.Store(fi, true)
	c.Restart(fi)
	clustertest.Eventually(t, 10*time.Second, func() error {
		for _, m := range c.Node(fi).Members() {
			if m.State != cluster.StateFollower && m.State != cluster.StateLeader {
				return fmt.Errorf("restarted node%d sees %s as %s", fi, m.ID, m.State)
			}
		}
		return nil
	})
}

func TestDataDirBelongsToOneID(t *testing.T) {
	cfg := clustertest.TestConfig(t, "a")
	cfg.BootstrapExpect = 1
	cfg.MinVoters = 1
	n, err := cluster.NewNode(cfg, newCounterFSM())
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Shutdown(); err != nil {
		t.Fatal(err)
	}
	cfg.ID = "b"
	_, err = cluster.NewNode(cfg, newCounterFSM())
	if err == nil || !strings.Contains(err.Error(), `belongs to node "a", not "b"`) {
		t.Fatalf("NewNode with another node's data dir: %v", err)
	}
}

// TestGracefulStopShowsLeft: a node stopped gracefully says so in gossip before it leaves, so
// the others list it as left, not unreachable (memberlist hands NotifyLeave the node without
// its left state, so before nodeMeta.Leaving every graceful stop read as a failure), and
// their raft logs treat it as gone on purpose (e2e TestGracefulStopLogsNoError). A crashed node
// stays unreachable.
func TestGracefulStopShowsLeft(t *testing.T) {
	c := clustertest.Start(t, 3, newCounterFSM)
	li := c.WaitLeader(leaderTimeout)
	stopped, killed := (li+1)%3, (li+2)%3
	sid, kid := c.Node(stopped).ID(), c.Node(killed).ID()
	c.Stop(stopped)
	c.Kill(killed)
	clustertest.Eventually(t, 10*time.Second, func() error {
		states := map[string]string{}
		for _, m := range c.Node(li).Members() {
			states[m.ID] = m.State
		}
		if states[sid] != cluster.StateLeft || states[kid] != cluster.StateUnreachable {
			return fmt.Errorf("members: %v; want %s %s (stopped gracefully) and %s %s (killed)", states, sid, cluster.StateLeft, kid, cluster.StateUnreachable)
		}
		return nil
	})
}
