package cluster_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/quotad/quotad/cluster/clustertest"
)

// TestVotersLive: Voters (quotad_raft_voters, quotad_raft_voters_live) counts the voters and,
// on the leader, those that answered it lately: 3 of 3, then 2 of 3 once a follower is
// killed (the cluster now tolerates no further failure), 3 of 3 again after it restarts. A
// follower reports 3 voters and 0 live.
func TestVotersLive(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 3, newCounterFSM)
	li := c.WaitLeader(leaderTimeout)
	want := func(i, voters, live int) {
		t.Helper()
		clustertest.Eventually(t, 10*time.Second, func() error {
			if v, l := c.Node(i).Voters(); v != voters || l != live {
				return fmt.Errorf("node%d Voters() = %d, %d live; want %d, %d live", i, v, l, voters, live)
			}
			return nil
		})
	}
	want(li, 3, 3)
	f := (li + 1) % 3
	want(f, 3, 0)
	c.Kill(f)
	want(li, 3, 2)
	c.Restart(f)
	want(li, 3, 3)
}
