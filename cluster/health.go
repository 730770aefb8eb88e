package cluster

import (
	"strconv"
	"sync"

	"github.com/hashicorp/raft"
)

// Health is what a node knows about its own ability to serve, for readiness checks
// (/healthz). Read it with Node.Health.
type Health struct {
	// Leader is the leader's ID as this node knows it ("" if none).
	Leader string
	// CommitIndex is the highest log index this node knows to be committed (a follower
	// learns it from the leader's AppendEntries); AppliedIndex is the last one its FSM
	// applied. A node far behind has not caught up.
	CommitIndex, AppliedIndex uint64
	// LogWriteErr is the error of the last write to the Raft log if it failed (nil once a
	// write succeeds): a node that cannot write its log can neither lead nor acknowledge
	// entries.
	LogWriteErr error
}

// Health returns the node's view of its own health.
func (n *Node) Health() Health {
	_, lid := n.raft.LeaderWithID()
	return Health{Leader: string(lid), CommitIndex: n.raft.CommitIndex(), AppliedIndex: n.fsm.AppliedIndex(),
		LogWriteErr: n.logs.lastErr()}
}

// LastSnapshotIndex returns the log index of this node's newest snapshot (taken or installed),
// 0 if it has none. Applied index minus it is how much log the node holds uncompacted: it
// grows without bound when snapshots fail (a full disk logs "failed to take snapshot" and
// nothing else: the log keeps being written until its own segment runs out of space).
func (n *Node) LastSnapshotIndex() uint64 {
	i, _ := strconv.ParseUint(n.raft.Stats()["last_snapshot_index"], 10, 64)
	return i
}

// watchedLogStore remembers whether the last write to the Raft log failed.
type watchedLogStore struct {
	raft.LogStore
	mu  sync.Mutex
	err error
}

func (w *watchedLogStore) record(err error) error {
	w.mu.Lock()
	w.err = err
	w.mu.Unlock()
	return err
}

func (w *watchedLogStore) lastErr() error {
	if w == nil {
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

func (w *watchedLogStore) StoreLog(l *raft.Log) error { return w.record(w.LogStore.StoreLog(l)) }

func (w *watchedLogStore) StoreLogs(ls []*raft.Log) error {
	return w.record(w.LogStore.StoreLogs(ls))
}

// IsMonotonic passes the wrapped store's answer through: raft must know that a WAL log store
// cannot keep a partial log after a snapshot install (it then deletes the whole log).
func (w *watchedLogStore) IsMonotonic() bool {
	m, ok := w.LogStore.(raft.MonotonicLogStore)
	return ok && m.IsMonotonic()
}
