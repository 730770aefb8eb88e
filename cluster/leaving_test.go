package cluster_test

import (
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/cluster/clustertest"
)

// TestForgedLeavingMessageIgnored: the leaving message a node sends its peers directly when it
// stops gracefully is taken only from the node it names. Node C (a member: it holds the gossip
// key) tells A that B is leaving, in the current form with the only token it has (its own)
// and in the old form (ID alone): A ignores both, warns naming B, keeps logging B's raft
// failures as errors (PeerLeftRecently false), and when B then crashes lists it unreachable,
// not left. C's own leaving message is still taken.
func TestForgedLeavingMessageIgnored(t *testing.T) {
	t.Parallel()
	var logs syncBuffer
	c := clustertest.Start(t, 3, newCounterFSM, clustertest.WithConfig(func(i int, cfg *cluster.Config) {
		if i == 0 {
			cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil)).With("node", cfg.ID) // not t.Output(): memberlist logs after the test ends
		}
	}))
	c.WaitLeader(leaderTimeout)
	a, b, f := c.Node(0), c.Node(1), c.Node(2)
	clustertest.Eventually(t, 10*time.Second, func() error {
		for _, m := range a.Members() {
			if m.State == cluster.StateUnreachable || m.State == cluster.StateJoining {
				return fmt.Errorf("%s sees %s %s", a.ID(), m.ID, m.State)
			}
		}
		return nil
	})

	if err := f.SendLeaving(a.ID(), b.ID()); err != nil {
		t.Fatal(err)
	}
	if err := f.SendLeavingV1(a.ID(), b.ID()); err != nil {
		t.Fatal(err)
	}
	clustertest.Eventually(t, 5*time.Second, func() error {
		warns := 0
		for _, ln := range strings.Split(logs.String(), "\n") {
			if strings.Contains(ln, "level=WARN") && strings.Contains(ln, "ignoring a gossip leaving message") &&
				strings.Contains(ln, "claimed_member="+b.ID()) {
				warns++
			}
		}
		if warns != 2 {
			return fmt.Errorf("%d warnings naming %s about forged leaving messages, want 2 (token, old form)\n%s", warns, b.ID(), logs.String())
		}
		return nil
	})
	if a.PeerLeftRecently(b.ID()) {
		t.Fatalf("%s takes %s for a peer that left, on %s's word", a.ID(), b.ID(), f.ID())
	}

	// B crashes: A must see a failure, not a graceful leave.
	c.Kill(1)
	clustertest.Eventually(t, 10*time.Second, func() error {
		for _, m := range a.Members() {
			if m.ID != b.ID() {
				continue
			}
			if m.State == cluster.StateLeft {
				t.Fatalf("%s lists crashed %s as %s after %s's forged leaving message", a.ID(), b.ID(), m.State, f.ID())
			}
			if m.State != cluster.StateUnreachable {
				return fmt.Errorf("%s lists %s as %s, want %s", a.ID(), b.ID(), m.State, cluster.StateUnreachable)
			}
			return nil
		}
		return fmt.Errorf("%s does not list %s", a.ID(), b.ID())
	})

	// A genuine leaving message (alone: no metadata, no gossip leave) is taken.
	f.TellLeaving()
	clustertest.Eventually(t, 5*time.Second, func() error {
		if !a.PeerLeftRecently(f.ID()) {
			return fmt.Errorf("%s did not take %s's own leaving message", a.ID(), f.ID())
		}
		return nil
	})
}
