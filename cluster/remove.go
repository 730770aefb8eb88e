package cluster

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/hashicorp/raft"
)

// RemoveServer removes server id from the Raft configuration (an operator's remove-peer: a
// node gone for good, removed before DeadNodeTimeout would). Only the leader can; it returns
// the IDs of the servers left. ErrUnknownServer if id is not in the configuration; removing
// the last voter is refused.
//
// Unless force, the removal is also refused (ErrNoLiveMajority, naming the voters that did
// not answer) if the voters left would not have a majority that answered this leader within
// liveWindow: raft uses the new configuration as soon as it is appended, so removing a healthy
// voter while another is down leaves a configuration that cannot commit (not even the removal
// itself) and the leader steps down until the dead voter returns. Once the removal was handed
// to raft, an error wraps ErrOutcomeUnknown: it may have been applied.
//
// A node that is still running and in gossip is added back by the leader (as a non-voter,
// promoted once caught up): stop it first.
func (n *Node) RemoveServer(ctx context.Context, id string, force bool) ([]string, error) {
	if n.raft.State() != raft.Leader {
		return nil, ErrNotLeader
	}
	cf := n.raft.GetConfiguration()
	if err := n.wait(ctx, cf); err != nil {
		return nil, fmt.Errorf("cluster: remove server: %w", err)
	}
	found, voters := false, 0
	var target raft.Server
	for _, s := range cf.Configuration().Servers {
		if s.Suffrage == raft.Voter {
			voters++
		}
		if string(s.ID) == id {
			found, target = true, s
		}
	}
	if !found {
		return nil, fmt.Errorf("%w: %q is not in the Raft configuration", ErrUnknownServer, id)
	}
	if target.Suffrage == raft.Voter && voters <= 1 {
		return nil, fmt.Errorf("cluster: %q is the only voter; removing it would leave the cluster without one", id)
	}
	if err := n.liveMajorityWithout(cf.Configuration().Servers, id); err != nil {
		if !force {
			return nil, err
		}
		n.log.Warn("removing a server with --force although the voters left have no live majority: the cluster cannot commit until enough of them answer again",
			"server", id, "err", err)
	}
	// A server removed while it runs is still in gossip: reconcile adds it back as a non-voter
	// (documented), but not before RejoinDelay, as after removing a dead one — at once, its
	// old replication may still be winding down, and the caller would be answered a
	// configuration that still lists it. Noted before the change: reconcile runs on the
	// configuration change itself. (A removal that fails leaves it in the configuration, where
	// the note does not matter.)
	n.noteRemoved(id, n.clock.Now())
	f := n.raft.RemoveServer(raft.ServerID(id), cf.Index(), 10*time.Second)
	if err := n.wait(ctx, f); err != nil {
		switch {
		case errors.Is(err, raft.ErrNotLeader), errors.Is(err, raft.ErrLeadershipTransferInProgress):
			return nil, fmt.Errorf("%w: %w", ErrNotLeader, err) // not appended
		case errors.Is(err, raft.ErrEnqueueTimeout):
			return nil, fmt.Errorf("cluster: remove server %q: %w", id, err) // not appended
		case errors.Is(err, ErrOutcomeUnknown):
			return nil, fmt.Errorf("cluster: remove server %q: %w", id, err)
		default:
			// Leadership lost or shutdown after the entry was appended: it may commit.
			return nil, fmt.Errorf("cluster: remove server %q: %w: %w", id, ErrOutcomeUnknown, err)
		}
	}
	n.log.Info("removed server on request", "server", id, "suffrage", target.Suffrage.String(), "forced", force)
	left := n.raft.GetConfiguration()
	if err := n.wait(ctx, left); err != nil {
		return nil, nil
	}
	var ids []string
	for _, s := range left.Configuration().Servers {
		ids = append(ids, string(s.ID))
	}
	return ids, nil
}

// liveWindow is how recently a voter must have answered the leader (AppendEntries, heartbeats
// included, or InstallSnapshot; peerTransport records it) to count as live for a membership
// change: twice HeartbeatTimeout, while raft's heartbeats go every HeartbeatTimeout/10.
func (n *Node) liveWindow() time.Duration { return 2 * n.cfg.HeartbeatTimeout }

// Voters returns how many voters this node's Raft configuration has and, on the leader, how
// many of them are live: itself and each voter that answered it within liveWindow (the test
// `members remove` uses). A follower reports live 0: only the leader sees replication. live <
// voters means a voter is down or cut off and the cluster tolerates one failure less (a
// 3-voter cluster none) — the quotad_raft_voters_live alert.
func (n *Node) Voters() (voters, live int) {
	cf := n.raft.GetConfiguration()
	if n.wait(context.Background(), cf) != nil {
		return 0, 0
	}
	leader := n.raft.State() == raft.Leader
	term, now, window := n.raft.CurrentTerm(), n.clock.Now(), n.liveWindow()
	for _, s := range cf.Configuration().Servers {
		if s.Suffrage != raft.Voter {
			continue
		}
		voters++
		if !leader {
			continue
		}
		seen := n.peers.repl.observed(s.ID, term)
		if string(s.ID) == n.cfg.ID || (!seen.lastOK.IsZero() && now.Sub(seen.lastOK) <= window) {
			live++
		}
	}
	return voters, live
}

// liveMajorityWithout returns ErrNoLiveMajority (naming the voters that did not answer) unless
// the voters of servers other than id have a majority that is live by this leader's own
// recent contact (itself counts as live).
func (n *Node) liveMajorityWithout(servers []raft.Server, id string) error {
	term, now, window := n.raft.CurrentTerm(), n.clock.Now(), n.liveWindow()
	var live, down []string
	for _, s := range servers {
		if s.Suffrage != raft.Voter || string(s.ID) == id {
			continue
		}
		seen := n.peers.repl.observed(s.ID, term)
		if string(s.ID) == n.cfg.ID || (!seen.lastOK.IsZero() && now.Sub(seen.lastOK) <= window) {
			live = append(live, string(s.ID))
		} else {
			down = append(down, string(s.ID))
		}
	}
	left := len(live) + len(down)
	if need := left/2 + 1; len(live) >= need {
		return nil
	}
	return fmt.Errorf("%w: removing %q would leave voters %s; a majority (%d of %d) must be live, but %s did not answer this leader within %v, so the cluster could not commit anything (not even this removal) and would stop leading until they return. Bring %s back (or, if gone for good, remove it first: quotad members remove %s) and retry; --force removes %q anyway",
		ErrNoLiveMajority, id, strings.Join(append(append([]string(nil), live...), down...), ", "), left/2+1, left,
		strings.Join(down, ", "), window, strings.Join(down, ", "), down[0], id)
}
