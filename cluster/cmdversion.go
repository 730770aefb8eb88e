package cluster

import (
	"context"

	"github.com/hashicorp/raft"
)

// The command version entries are written at.
//
// Every Command entry carries an FSM command version, and a node stops (fail-stop) at an
// entry newer than it applies, while it applies an older one with that version's semantics.
// So the leader writes at the cluster's effective command version: the lowest version any
// server of the Raft configuration advertises through gossip (Member.CommandVersion), capped
// at the version this node's FSM applies. During a rolling upgrade an upgraded node that
// becomes leader then keeps writing what the old nodes apply, instead of stopping them all at
// its first entry.
//
// A server seen in gossip advertising none (builds before fsm command version 6) does not
// lower it: such a node stops at the first entry newer than it applies, as it always did. A
// server of the configuration gossip has not reported (yet) — just after this node restarted,
// before its gossip join got through — counts as the oldest build that advertises
// (firstAdvertisingVersion): it may be one, and a leader elected in that moment must not stop
// it. Non-voters count as voters do: they apply the same log.
//
// The version is cached (an atomic load per entry) and recomputed whenever gossip or the
// configuration may have changed: the reconcile loop runs on every node on each gossip event
// and leader change and every ReconcileInterval, and on the leader also on each raft peer
// change (hashicorp/raft reports those only to the leader, which starts and stops replication
// for them: a follower sees a configuration change at the next gossip event or interval); and
// when this node establishes leadership, before its first entry. Only the leader's value
// decides what is written; a follower's is what it would write if elected, and what it shows
// in Members (quotad status).

// CommandVersion returns the FSM command version this node writes entries at as leader (see
// above); 0 if its FSM does not say which versions it applies (then the FSM's own encoding
// decides). Safe for concurrent use: one atomic load.
func (n *Node) CommandVersion() int { return int(n.cmdVersion.Load()) }

// refreshCommandVersion recomputes CommandVersion from the Raft configuration and gossip.
// It keeps the previous value if the configuration cannot be read (the node is stopping).
func (n *Node) refreshCommandVersion(ctx context.Context) {
	// One refresh at a time (leaderTerm and the reconcile loop both call it): a computation
	// from an older snapshot of gossip must not overwrite a newer one.
	n.cmdVersionMu.Lock()
	defer n.cmdVersionMu.Unlock()
	cf := n.raft.GetConfiguration()
	if err := n.wait(ctx, cf); err != nil {
		return
	}
	own := 0
	if v, ok := n.fsm.(commandVersioned); ok {
		own = v.CommandVersion()
	}
	v := effectiveCommandVersion(own, cf.Configuration().Servers, n.cfg.ID, n.commandVersion(), n.peersSnapshot())
	if old := n.cmdVersion.Swap(int64(v)); old != int64(v) {
		n.log.Info("command version for new entries", "version", v, "was", old, "applies_up_to", own)
	}
}

// firstAdvertisingVersion is the first fsm command version whose builds advertise it in
// gossip (fsm.MaxKeysPerParentVersion).
const firstAdvertisingVersion = 6

// effectiveCommandVersion is the lowest command version advertised by a server of servers
// (self advertises selfVersion; the others as last seen in peers, alive or not: a failed node
// comes back with the build it had; one not in peers as firstAdvertisingVersion), capped at
// own, the newest this node's FSM applies. Advertising none (0) does not count. 0 if own is 0.
func effectiveCommandVersion(own int, servers []raft.Server, self string, selfVersion int, peers map[string]peer) int {
	v := own
	for _, s := range servers {
		sv := selfVersion
		if string(s.ID) != self {
			p, seen := peers[string(s.ID)]
			sv = p.meta.Cmd
			if !seen {
				sv = firstAdvertisingVersion
			}
		}
		if sv > 0 && sv < v {
			v = sv
		}
	}
	return v
}
