package cluster_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/cluster/clustertest"
)

func removeServer(n *cluster.Node, id string, force bool) ([]string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	return n.RemoveServer(ctx, id, force)
}

// With all three voters up, removing one leaves two live voters: allowed.
func TestRemoveServerAllVotersUp(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 3, newCounterFSM)
	li := c.WaitLeader(leaderTimeout)
	target := c.Node((li + 1) % 3).ID()
	left, err := removeServer(c.Node(li), target, false)
	if err != nil {
		t.Fatalf("remove %s with every voter up: %v", target, err)
	}
	if len(left) != 2 || strings.Contains(strings.Join(left, ","), target) {
		t.Fatalf("members after removing %s: %v", target, left)
	}
}

// The trial's outage: one voter of three is down and the operator removes a healthy one. raft
// would use the new configuration {leader, dead voter} at once, could not commit it and the
// leader would step down until the dead voter returned. The leader refuses, naming the dead
// voter, and changes nothing; --force removes anyway and says the outcome is unknown.
func TestRemoveServerRefusedWithoutLiveMajority(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 3, newCounterFSM)
	li := c.WaitLeader(leaderTimeout)
	leader := c.Node(li)
	add(t, leader, 1)
	di, hi := (li+1)%3, (li+2)%3
	dead, healthy := c.Node(di).ID(), c.Node(hi).ID()
	// Every node has caught up once (left recovery): a node killed while it still recovers
	// refuses to vote after its restart until a leader catches it up, and the configuration
	// {leader, it} left by --force below could then never elect one (CI under -race: "no
	// leader yet" for 20 s, node1 "recovering: refused to vote").
	clustertest.Eventually(t, 10*time.Second, func() error {
		for i := range 3 {
			if c.Node(i).Recovering() {
				return fmt.Errorf("%s still recovering", c.Node(i).ID())
			}
		}
		return nil
	})
	c.Kill(di)
	// Gossip notices a crash well after raft's heartbeats stop being answered.
	clustertest.Eventually(t, 10*time.Second, func() error {
		for _, m := range leader.Members() {
			if m.ID == dead && m.State == cluster.StateUnreachable {
				return nil
			}
		}
		return fmt.Errorf("%s not yet reported unreachable", dead)
	})

	_, err := removeServer(leader, healthy, false)
	if !errors.Is(err, cluster.ErrNoLiveMajority) {
		t.Fatalf("removing healthy voter %s while %s is down: err %v, want ErrNoLiveMajority", healthy, dead, err)
	}
	for _, want := range []string{dead, "--force", "quotad members remove " + dead} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q does not mention %q", err, want)
		}
	}
	if s := suffrages(leader); s[healthy] != cluster.SuffrageVoter || s[dead] != cluster.SuffrageVoter {
		t.Fatalf("a refused removal changed the configuration: %v", s)
	}
	if !leader.IsLeader() {
		t.Fatalf("leader stepped down after a refused removal")
	}
	add(t, leader, 1) // the two live voters still commit

	// --force: appended although it cannot commit while the dead voter is down.
	_, err = removeServer(leader, healthy, true)
	if errors.Is(err, cluster.ErrNoLiveMajority) || !errors.Is(err, cluster.ErrOutcomeUnknown) {
		t.Fatalf("forced removal: err %v, want ErrOutcomeUnknown (appended, not committed)", err)
	}
	if s, ok := suffrages(leader)[healthy]; ok && s != "" {
		t.Fatalf("forced removal: %s still in the leader's configuration as %q", healthy, s)
	}
	// The dead voter returns: the configuration {leader, it} commits again.
	c.Restart(di)
	clustertest.Eventually(t, 20*time.Second, func() error {
		l := c.Leader()
		if l < 0 {
			return errors.New("no leader yet")
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		ts, err := c.Node(l).Now()
		if err != nil {
			return err
		}
		_, err = c.Node(l).Apply(ctx, encodeAdd(ts, 1))
		return err
	})
}
