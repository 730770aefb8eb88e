package cluster

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/raft"
)

// RemoveServer removes server id from the Raft configuration (an operator's remove-peer: a
// node gone for good, removed before DeadNodeTimeout would). Only the leader can; it returns
// the IDs of the servers left. ErrUnknownServer if id is not in the configuration; removing
// the last voter is refused. A node that is still running and in gossip is added back by the
// leader (as a non-voter, promoted once caught up): stop it first.
func (n *Node) RemoveServer(ctx context.Context, id string) ([]string, error) {
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
	f := n.raft.RemoveServer(raft.ServerID(id), cf.Index(), 10*time.Second)
	if err := n.wait(ctx, f); err != nil {
		if errors.Is(err, raft.ErrNotLeader) || errors.Is(err, raft.ErrLeadershipLost) {
			return nil, fmt.Errorf("%w: %w", ErrNotLeader, err)
		}
		return nil, fmt.Errorf("cluster: remove server %q: %w", id, err)
	}
	n.log.Info("removed server on request", "server", id, "suffrage", target.Suffrage.String())
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
