package cluster_test

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/cluster/clustertest"
)

func wipe(t *testing.T, c *clustertest.Cluster, i int) {
	t.Helper()
	dir := c.Config(i).DataDir
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
}

// TestWipedVoterDoesNotElectAStaleLeader is the wipe-plus-pause sequence of issue 11: entries
// acknowledged by the leader and follower A while follower B was down live only on those two;
// A loses its data dir and the leader dies. B (missing the entries) and the empty A are a
// majority of the voters. If the empty A voted, B would lead and the acknowledged entries
// would be gone. A must refuse to vote until it has caught up, so the cluster waits (no
// leader) until the old leader returns, and then loses nothing.
func TestWipedVoterDoesNotElectAStaleLeader(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 3, newCounterFSM)
	l := c.WaitLeader(leaderTimeout)
	a, b := (l+1)%3, (l+2)%3
	const n, m = 20, 30
	for range n {
		add(t, c.Node(l), 1)
	}
	waitCount(t, c, n)

	c.Kill(b) // B stops replicating
	for range m {
		add(t, c.Node(l), 1) // acknowledged: on the leader and A only
	}
	c.Kill(a)
	wipe(t, c, a)
	c.Kill(l)

	c.Restart(a) // empty
	c.Restart(b) // without the last m entries
	if !c.Node(a).Recovering() {
		t.Fatalf("node%d restarted with an empty data dir but is not recovering", a)
	}
	// Many election timeouts: B campaigns again and again; nobody may win with B's log.
	deadline := time.Now().Add(4 * time.Second)
	for time.Now().Before(deadline) {
		for _, i := range []int{a, b} {
			if nd := c.Node(i); nd.IsLeader() {
				t.Fatalf("node%d became leader with count %d; %d acknowledged entries lost (the empty node voted)",
					i, counter(c, i).Count(), n+m-int(counter(c, i).Count()))
			}
		}
		time.Sleep(20 * time.Millisecond)
	}

	c.Restart(l) // the old leader returns with every acknowledged entry
	li := c.WaitLeader(leaderTimeout)
	if got := counter(c, li).Count(); got != n+m {
		t.Fatalf("leader node%d has count %d, want %d", li, got, n+m)
	}
	add(t, c.Node(li), 1)
	waitCount(t, c, n+m+1)
	clustertest.Eventually(t, 10*time.Second, func() error {
		if c.Node(a).Recovering() {
			return fmt.Errorf("node%d still recovering", a)
		}
		return nil
	})
	if _, err := os.Stat(c.Config(a).DataDir + "/recovering"); !os.IsNotExist(err) {
		t.Fatalf("the recovering marker is still in node%d's data dir: %v", a, err)
	}
}

// TestWipedVoterIsDemotedAndPromotedAgain: a voter that comes back empty in the same term
// answers the leader with a log shorter than what it acknowledged; the leader demotes it and
// promotes it again once it has caught up.
func TestWipedVoterIsDemotedAndPromotedAgain(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 3, newCounterFSM)
	l := c.WaitLeader(leaderTimeout)
	a := (l + 1) % 3
	id := c.Node(a).ID()
	for range 10 {
		add(t, c.Node(l), 1)
	}
	waitCount(t, c, 10)
	c.Kill(a)
	wipe(t, c, a)
	c.Restart(a)

	demoted := false
	clustertest.Eventually(t, 15*time.Second, func() error {
		s := suffrages(c.Node(l))[id]
		if s == cluster.SuffrageNonvoter {
			demoted = true
		}
		if !demoted {
			return fmt.Errorf("%s is still a %s", id, s)
		}
		if s != cluster.SuffrageVoter {
			return fmt.Errorf("%s demoted, not promoted yet", id)
		}
		return nil
	})
	add(t, c.Node(l), 1)
	waitCount(t, c, 11)
	if c.Node(a).Recovering() {
		t.Fatalf("%s was promoted but still recovering", id)
	}
}
