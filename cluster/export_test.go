package cluster

import (
	"fmt"
	"time"

	"github.com/hashicorp/raft"
)

// SetBootstrapHold delays each node's first bootstrap check by hold(its ID) (nil: none). Set it
// before the nodes start and clear it after.
func SetBootstrapHold(hold func(id string) time.Duration) {
	if hold == nil {
		bootstrapHold.Store(nil)
		return
	}
	bootstrapHold.Store(&hold)
}

// SendLeaving sends node to, over gossip, the leaving message (leavingMsg) naming claimed,
// with this node's own leave token: the best proof another member has.
func (n *Node) SendLeaving(to, claimed string) error {
	return n.sendGossip(to, leavingPayload(claimed, n.gossip.leaveToken))
}

// SendLeavingV1 sends node to the leaving message of builds before the token, naming claimed.
func (n *Node) SendLeavingV1(to, claimed string) error {
	return n.sendGossip(to, []byte(leavingMsgV1+claimed))
}

// TellLeaving sends every peer this node's genuine leaving message, and nothing else of a
// graceful stop.
func (n *Node) TellLeaving() { n.tellLeaving(2 * time.Second) }

func (n *Node) sendGossip(to string, msg []byte) error {
	for _, m := range n.ml.Members() {
		if m.Name == to {
			return n.ml.SendReliable(m, msg)
		}
	}
	return fmt.Errorf("%s: no gossip member %q", n.cfg.ID, to)
}

// PeerLeftRecently reports whether this node takes peer id for one that left gracefully
// less than leftQuietFor ago (its raft failures to reach it are then logged at INFO).
func (n *Node) PeerLeftRecently(id string) bool {
	return n.peerLeftRecently([]any{"server-id", raft.ServerID(id)})
}

// SetUndoBootstrapCheck runs f in undoFailedBootstrap, between reading a failed bootstrap's
// term 1 and clearing it, with the node's data dir and its raft's current term (nil: none).
func SetUndoBootstrapCheck(f func(dataDir string, raftTerm func() uint64)) {
	if f == nil {
		undoBootstrapCheck.Store(nil)
		return
	}
	h := func(n *Node) { f(n.cfg.DataDir, n.raft.CurrentTerm) }
	undoBootstrapCheck.Store(&h)
}

// PersistedTerm is the current term in the node's stable store.
func (n *Node) PersistedTerm() (uint64, error) { return n.bolt.GetUint64(keyCurrentTerm) }

// RaftTerm is the node's raft's current term (in memory).
func (n *Node) RaftTerm() uint64 { return n.raft.CurrentTerm() }
