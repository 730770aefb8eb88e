package cluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/hashicorp/raft"
)

// Backup and restore of the replicated state (quotad snapshot save/restore), both on the
// leader.

// ClusterID returns the ID of the cluster this node belongs to ("" while not known yet).
func (n *Node) ClusterID() string { return n.clusterID() }

// SaveSnapshot takes a snapshot through Raft and opens it. It first commits a tick entry, so
// the snapshot holds every entry acknowledged anywhere before the call (and raft has something
// new to snapshot). Only the leader saves: ErrNotLeader elsewhere. The caller closes the
// reader; meta.Size is its length.
func (n *Node) SaveSnapshot(ctx context.Context) (*raft.SnapshotMeta, io.ReadCloser, error) {
	var last error
	for range 3 {
		if _, _, err := n.ApplyNow(ctx, n.fsm.EncodeTick); err != nil {
			return nil, nil, err
		}
		f := n.raft.Snapshot()
		if err := n.wait(ctx, f); err != nil {
			// Another snapshot may have taken our entry (nothing new): tick and try again.
			if errors.Is(err, raft.ErrNothingNewToSnapshot) {
				last = err
				continue
			}
			return nil, nil, fmt.Errorf("cluster: snapshot: %w", err)
		}
		meta, rc, err := f.Open()
		if err != nil {
			return nil, nil, fmt.Errorf("cluster: open snapshot: %w", err)
		}
		return meta, rc, nil
	}
	return nil, nil, fmt.Errorf("cluster: snapshot: %w", last)
}

// RestoreSnapshot makes r (meta.Size bytes of an FSM snapshot, already checked to decode: raft
// stops the node if the FSM cannot restore it) the cluster's state through raft.Restore: the
// leader installs it at an index above both its log and meta.Index, and followers get it by
// snapshot installation. The leader clock is re-based on the restored FSM clock, so the restored
// leases, pauses and dedup records keep the time they had left and buckets refill from where
// they were (nothing for the time between save and restore).
//
// While it runs, commands wait for the leader clock (Now blocks). Entries already queued with
// earlier timestamps are applied at the restored clock or later. timeout bounds the whole
// restore (0: none).
func (n *Node) RestoreSnapshot(meta *raft.SnapshotMeta, r io.Reader, timeout time.Duration) error {
	return n.RestoreSnapshotPrepared(context.Background(), func(context.Context) (*raft.SnapshotMeta, io.Reader, error) { return meta, r, nil }, timeout)
}

// RestoreSnapshotPrepared is RestoreSnapshot of a state prepare builds at the moment of the
// restore. It first waits until no command is between taking its timestamp and being queued
// in raft (ApplyNow), then holds new ones off (Now blocks) and applies a barrier, so every
// command stamped before the restore has been applied to the FSM and none is in flight: what
// prepare reads from the FSM is the state the restore replaces, and nothing commits between
// that read and the restore. The snapshot service uses it to keep the cluster's current token
// table in the restored state. ctx and timeout (0: none) bound the whole restore, prepare
// included (it gets the bounded ctx and must stop when it ends: commands wait meanwhile). An
// error from prepare is returned as is; nothing was restored.
func (n *Node) RestoreSnapshotPrepared(ctx context.Context, prepare func(ctx context.Context) (*raft.SnapshotMeta, io.Reader, error), timeout time.Duration) error {
	if n.closed.Load() {
		return ErrShutdown
	}
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	// Proposals hold stampMu shared only from Now until raft.Apply has queued their entry
	// (bounded by their own enqueue timeout), so this wait is short.
	n.stampMu.Lock()
	defer n.stampMu.Unlock()
	n.clk.mu.Lock()
	defer n.clk.mu.Unlock()
	if !n.clk.ready || n.raft.State() != raft.Leader || n.raft.CurrentTerm() != n.clk.term {
		return ErrNotLeader
	}
	left := func() time.Duration {
		if dl, ok := ctx.Deadline(); ok {
			return max(time.Until(dl), time.Millisecond)
		}
		return 0
	}
	if err := n.wait(ctx, n.raft.Barrier(left())); err != nil {
		if errors.Is(err, raft.ErrNotLeader) || errors.Is(err, raft.ErrLeadershipLost) {
			return fmt.Errorf("%w: %w", ErrNotLeader, err)
		}
		return fmt.Errorf("cluster: restore: barrier: %w", err)
	}
	meta, r, err := prepare(ctx)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("cluster: restore: %w", err)
	}
	if err := n.raft.Restore(meta, r, left()); err != nil {
		if errors.Is(err, raft.ErrNotLeader) || errors.Is(err, raft.ErrLeadershipLost) {
			return fmt.Errorf("%w: %w", ErrNotLeader, err)
		}
		return fmt.Errorf("cluster: restore: %w", err)
	}
	n.clk.base = n.fsm.Clock()
	n.clk.start = n.clock.Now()
	n.clk.last = n.clk.base
	n.log.Info("restored a snapshot", "from_index", meta.Index, "index", n.raft.LastIndex(), "fsm_clock", n.clk.base)
	return nil
}
