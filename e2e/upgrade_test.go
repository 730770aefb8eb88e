package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/proccluster"
)

// The rolling-upgrade tests (make test-upgrade; docs/operations.md "Rolling upgrade") start a
// cluster on a previous commit's binary, built from git, and move it to this tree's binary.
//
// $QUOTAD_UPGRADE_FROM names the previous commit. The default, b79e26e, is main just before
// fair-rates (issue 16) raised the FSM command version to 2: the same agent flags as now (the
// security work had landed; only --config is newer, and the harness does not use it), so it
// joins the same secure cluster, and its nodes stop on the first version-2 entry. Commits
// before the security work cannot join a secure cluster at all (their nodes have no TLS
// flags): that upgrade is a full-cluster restart (docs/operations.md).
const defaultUpgradeFrom = "b79e26e"

const upgradeLimits = `
domain: up
rate_limit: {unit: second, requests_per_unit: 200, burst: 100}
`

// buildPrevious builds the quotad binary of the commit $QUOTAD_UPGRADE_FROM (a git worktree
// of it, removed afterwards).
func buildPrevious(t *testing.T) (rev, bin string) {
	t.Helper()
	if os.Getenv("QUOTAD_UPGRADE") == "" {
		t.Skip("set QUOTAD_UPGRADE=1 (make test-upgrade) to run the rolling upgrade tests")
	}
	rev = os.Getenv("QUOTAD_UPGRADE_FROM")
	if rev == "" {
		rev = defaultUpgradeFrom
	}
	if out, err := exec.Command("git", "cat-file", "-e", rev+"^{commit}").CombinedOutput(); err != nil {
		t.Fatalf("commit %s is not in this clone (a shallow clone? fetch the history): %v %s", rev, err, out)
	}
	dir := t.TempDir()
	wt := filepath.Join(dir, "src")
	if out, err := exec.Command("git", "worktree", "add", "--detach", wt, rev).CombinedOutput(); err != nil {
		t.Fatalf("git worktree add %s: %v\n%s", rev, err, out)
	}
	defer func() {
		if out, err := exec.Command("git", "worktree", "remove", "--force", wt).CombinedOutput(); err != nil {
			t.Logf("git worktree remove: %v %s", err, out)
		}
	}()
	bin, err := proccluster.Build(wt, dir)
	if err != nil {
		t.Fatal(err)
	}
	return rev, bin
}

// upgradeCluster is a cluster whose nodes run the binary in bins[node ID].
type upgradeCluster struct {
	*proccluster.Cluster
	mu   sync.Mutex
	bins map[string]string
}

func (u *upgradeCluster) setBinary(i int, bin string) {
	u.mu.Lock()
	u.bins[u.Nodes[i].ID] = bin
	u.mu.Unlock()
}

func startUpgradeCluster(t *testing.T, old string) *upgradeCluster {
	t.Helper()
	dir := t.TempDir()
	lf := filepath.Join(dir, "limits.yaml")
	if err := os.WriteFile(lf, []byte(upgradeLimits), 0o644); err != nil {
		t.Fatal(err)
	}
	u := &upgradeCluster{bins: map[string]string{}}
	c, err := proccluster.Start(proccluster.Config{Binary: old, Dir: dir, Nodes: 3, LimitsFile: lf,
		NodeBinary: func(n *proccluster.Node) string {
			u.mu.Lock()
			defer u.mu.Unlock()
			return u.bins[n.ID]
		}})
	if err != nil {
		t.Fatal(err)
	}
	u.Cluster = c
	t.Cleanup(func() {
		c.KillAll()
		if t.Failed() {
			for _, n := range c.Nodes {
				if b, err := os.ReadFile(n.LogPath); err == nil {
					t.Logf("%s log:\n%s", n.ID, tail(string(b), 25))
				}
			}
		}
	})
	if _, err := c.WaitLeader(20 * time.Second); err != nil {
		t.Fatal(err)
	}
	return u
}

// load admits from one refilling bucket with a client that follows the leader and retries
// with the same request ID, and keeps every acknowledged admission.
type load struct {
	cl    *client.Client
	stop  chan struct{}
	wg    sync.WaitGroup
	start time.Time

	mu      sync.Mutex
	acked   []client.Decision // admitted and acknowledged
	denied  int
	unknown int
	lastAck time.Time
}

func startLoad(t *testing.T, c *proccluster.Cluster, workers int) *load {
	t.Helper()
	cfg := c.ClientConfig()
	cfg.ClientID = "upgrade-load"
	cl, err := client.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	l := &load{cl: cl, stop: make(chan struct{}), start: time.Now()}
	for range workers {
		l.wg.Go(func() {
			for {
				select {
				case <-l.stop:
					return
				case <-time.After(8 * time.Millisecond):
				}
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				d, err := cl.Allow(ctx, client.Request{Domain: "up", Cost: 1})
				cancel()
				var denied *client.DeniedError
				l.mu.Lock()
				switch {
				case err == nil:
					l.acked = append(l.acked, d)
					l.lastAck = time.Now()
				case errors.As(err, &denied):
					l.denied++
				default:
					l.unknown++
				}
				l.mu.Unlock()
			}
		})
	}
	return l
}

func (l *load) finish() {
	close(l.stop)
	l.wg.Wait()
}

// checkInvariants: no double spend (admitted ≤ burst + rate × elapsed), nothing acknowledged
// lost (every acknowledged request ID, asked again, gets its original decision from the dedup
// table and debits nothing), replicas equal (same state hash at the same applied index).
func checkInvariants(t *testing.T, c *proccluster.Cluster, l *load, minAcked int) {
	t.Helper()
	l.mu.Lock()
	acked := append([]client.Decision(nil), l.acked...)
	elapsed := l.lastAck.Sub(l.start)
	t.Logf("load: %d admitted, %d denied, %d unknown over %v", len(acked), l.denied, l.unknown, elapsed.Round(time.Millisecond))
	l.mu.Unlock()
	if len(acked) < minAcked {
		t.Fatalf("only %d admissions (want >= %d): the load did not run", len(acked), minAcked)
	}
	if bound := 100 + 200*elapsed.Seconds(); float64(len(acked)) > bound*1.01+1 {
		t.Errorf("double spend: %d admitted in %v, the bucket allows %.0f", len(acked), elapsed, bound)
	}
	seen := map[uint64]bool{}
	for _, d := range acked {
		if seen[d.RequestID] {
			t.Errorf("request ID %d acknowledged twice", d.RequestID)
		}
		seen[d.RequestID] = true
	}
	opts, err := c.DialOptions()
	if err != nil {
		t.Fatal(err)
	}
	leader := c.Leader(context.Background())
	conn, err := grpc.NewClient(c.Nodes[leader].GRPCAddr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	lost := 0
	for start := 0; start < len(acked); start += 1000 {
		batch := acked[start:min(start+1000, len(acked))]
		req := &quotadv1.AcquireRequest{ClientId: "upgrade-load"}
		for _, d := range batch {
			req.Admissions = append(req.Admissions, &quotadv1.Admission{RequestId: d.RequestID, Domain: "up", Cost: 1})
		}
		resp, err := quotadv1.NewQuotaClient(conn).Acquire(ctx, req)
		if err != nil {
			t.Fatalf("asking acknowledged requests again: %v", err)
		}
		for i, got := range resp.Decisions {
			if want := batch[i]; !got.Admitted || got.Remaining != want.Remaining {
				lost++
				if lost <= 5 {
					t.Errorf("acknowledged request %d (admitted, remaining %d) is now %v: the decision was lost", want.RequestID, want.Remaining, got)
				}
			}
		}
	}
	if lost > 0 {
		t.Errorf("%d of %d acknowledged admissions lost", lost, len(acked))
	}
	// Replicas: the same hash whenever they stand at the same index.
	deadline := time.Now().Add(20 * time.Second)
	for {
		var states []proccluster.State
		for i := range c.Nodes {
			resp, err := c.HTTPClient().Get(c.URL(i, "/debug/state?hash=1"))
			if err != nil {
				break
			}
			var s proccluster.State
			err = jsonDecode(resp.Body, &s)
			resp.Body.Close()
			if err == nil {
				states = append(states, s)
			}
		}
		if len(states) == len(c.Nodes) && states[0].AppliedIndex == states[1].AppliedIndex && states[1].AppliedIndex == states[2].AppliedIndex {
			if states[0].Hash != states[1].Hash || states[1].Hash != states[2].Hash {
				t.Fatalf("replicas diverged at index %d: hashes %d %d %d", states[0].AppliedIndex, states[0].Hash, states[1].Hash, states[2].Hash)
			}
			t.Logf("replicas equal at index %d (hash %d)", states[0].AppliedIndex, states[0].Hash)
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("replicas never at the same index: %+v", states)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// checkKeptBoltDB fails unless every node, now on this tree's binary (whose default log store
// for new data dirs is wal) and started without --raft-log-store, still runs the BoltDB log the
// previous binary wrote — raft.db in its data dir, no wal/ or stable.db — and said so at startup.
func checkKeptBoltDB(t *testing.T, c *proccluster.Cluster) {
	t.Helper()
	said, err := c.ScanLogs(`"msg":"raft log store"`)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range c.Nodes {
		has := func(name string) bool { _, err := os.Stat(filepath.Join(n.DataDir, name)); return err == nil }
		if !has("raft.db") || has("wal") || has("stable.db") {
			t.Errorf("%s after the upgrade: raft.db %v, wal/ %v, stable.db %v; want the BoltDB log only",
				n.ID, has("raft.db"), has("wal"), has("stable.db"))
		}
		found := false
		for _, h := range said {
			if strings.HasPrefix(h, n.ID+": ") {
				found = true
				if !strings.Contains(h, `"backend":"boltdb"`) || !strings.Contains(h, "is not set") {
					t.Errorf("%s chose its log store as: %s", n.ID, h)
				}
			}
		}
		if !found {
			t.Errorf("%s never logged which Raft log store it chose", n.ID)
		}
	}
}

// waitCaughtUp waits until node i answers /healthz ok (it knows a leader and is within 512
// entries of the commit index).
func waitCaughtUp(t *testing.T, c *proccluster.Cluster, i int, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		resp, err := c.HTTPClient().Get(c.URL(i, "/healthz"))
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not healthy within %v: %v", c.Nodes[i].ID, timeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestRollingUpgradeUnderLoad: a cluster on the previous commit's binary, under load, is
// upgraded node by node as docs/operations.md says — followers first (SIGTERM, start on the
// new binary, wait for /healthz), the leader last (SIGTERM hands leadership to an upgraded
// node). No node stops, nothing acknowledged is lost, nothing is spent twice, replicas end
// equal.
func TestRollingUpgradeUnderLoad(t *testing.T) {
	rev, old := buildPrevious(t)
	u := startUpgradeCluster(t, old)
	t.Logf("cluster on %s (%s)", rev, old)
	l := startLoad(t, u.Cluster, 4)
	defer l.cl.Close()
	time.Sleep(2 * time.Second)

	leader := u.Leader(context.Background())
	order := []int{}
	for i := range u.Nodes {
		if i != leader {
			order = append(order, i)
		}
	}
	order = append(order, leader)
	for _, i := range order {
		start := time.Now()
		u.Stop(i)
		u.setBinary(i, binary)
		if err := u.Start(i); err != nil {
			t.Fatal(err)
		}
		waitCaughtUp(t, u.Cluster, i, 30*time.Second)
		t.Logf("%s upgraded in %v", u.Nodes[i].ID, time.Since(start).Round(time.Millisecond))
		time.Sleep(time.Second)
	}
	time.Sleep(2 * time.Second)
	l.finish()
	// The old leader hands over on SIGTERM and is then a follower of an upgraded leader until
	// Raft has shut down: it may take a version-2 entry in that moment and stop on it (exit 2,
	// "upgrade this node") instead of exiting 0 — harmless, the entry is in its log and the new
	// binary applies it. Another old node stops the same way only if an upgraded node was
	// elected while it still ran (an election under load): as designed, and the remedy is the
	// documented one — start it on the new binary. Any other stop is a failure.
	hits, _ := u.ScanLogs("upgrade this node", "panic")
	for _, h := range hits {
		if !strings.Contains(h, "upgrade this node") {
			t.Fatalf("a node failed during the rolling upgrade:\n%s", strings.Join(hits, "\n"))
		}
		t.Logf("an old node stopped on a version-2 entry (expected of the old leader after its handover): %s", firstLineOf(h))
	}
	for i := range u.Nodes {
		if !u.Running(i) {
			stopped := false
			for _, h := range hits {
				stopped = stopped || strings.HasPrefix(h, u.Nodes[i].ID+": ")
			}
			if !stopped {
				t.Fatalf("%s exited during the rolling upgrade without saying why", u.Nodes[i].ID)
			}
			u.setBinary(i, binary)
			if err := u.Start(i); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i := range u.Nodes {
		waitCaughtUp(t, u.Cluster, i, 30*time.Second)
	}
	checkInvariants(t, u.Cluster, l, 500)
	checkKeptBoltDB(t, u.Cluster)
}

// TestOldNodesStopOnNewerEntries: if a node on the new binary leads while nodes on the
// previous one still run, its entries carry command version 2 and the old nodes stop ("upgrade
// this node") instead of applying what they cannot; started on the new binary they catch up,
// with nothing acknowledged lost.
func TestOldNodesStopOnNewerEntries(t *testing.T) {
	rev, old := buildPrevious(t)
	u := startUpgradeCluster(t, old)
	l := startLoad(t, u.Cluster, 2)
	defer l.cl.Close()
	time.Sleep(time.Second)

	leader := u.Leader(context.Background())
	up := (leader + 1) % 3
	u.Stop(up)
	u.setBinary(up, binary)
	if err := u.Start(up); err != nil {
		t.Fatal(err)
	}
	waitCaughtUp(t, u.Cluster, up, 30*time.Second)
	// Hand leadership to the upgraded node.
	opts, _ := u.DialOptions()
	conn, err := grpc.NewClient(u.Nodes[leader].GRPCAddr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := quotadv1.NewAdminClient(conn).TransferLeadership(ctx, &quotadv1.TransferLeadershipRequest{To: u.Nodes[up].ID}); err != nil {
		t.Fatalf("transfer leadership to %s: %v", u.Nodes[up].ID, err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for u.Running((up+1)%3) || u.Running((up+2)%3) {
		if time.Now().After(deadline) {
			t.Fatalf("old nodes still running %v after a version-2 leader took over", time.Since(deadline.Add(-15*time.Second)))
		}
		time.Sleep(100 * time.Millisecond)
	}
	hits, _ := u.ScanLogs("upgrade this node")
	if len(hits) < 2 {
		t.Fatalf("the old nodes (%s) exited without saying why:\n%s", rev, strings.Join(hits, "\n"))
	}
	t.Logf("old nodes stopped: %s", firstLineOf(hits[0]))
	l.finish()
	for _, i := range []int{(up + 1) % 3, (up + 2) % 3} {
		u.setBinary(i, binary)
		if err := u.Start(i); err != nil {
			t.Fatal(err)
		}
	}
	for i := range u.Nodes {
		waitCaughtUp(t, u.Cluster, i, 30*time.Second)
	}
	checkInvariants(t, u.Cluster, l, 20)
}

func firstLineOf(s string) string {
	if len(s) > 300 {
		s = s[:300]
	}
	return strings.SplitN(s, "\n", 2)[0]
}

func jsonDecode(r io.Reader, v any) error { return json.NewDecoder(r).Decode(v) }
