package cluster

import (
	"context"
	"errors"
	"time"

	"github.com/hashicorp/raft"
)

// leadershipLoop runs one leaderTerm per leadership this node gains, and tears it down when
// leadership is lost. raft's LeaderCh keeps only the latest value, so a "true" while a term
// runs means leadership was lost and regained: the term is restarted (new barrier, new base).
func (n *Node) leadershipLoop() {
	var (
		cancel context.CancelFunc
		done   chan struct{}
	)
	stopTerm := func() {
		if cancel != nil {
			cancel()
			<-done
			cancel = nil
		}
		if n.clearReady() {
			n.notifyLeaderChange()
		}
	}
	defer stopTerm()
	for {
		select {
		case <-n.ctx.Done():
			return
		case isLeader := <-n.raft.LeaderCh():
			stopTerm()
			if !isLeader {
				n.log.Info("lost leadership")
				continue
			}
			n.log.Info("gained leadership; establishing", "term", n.raft.CurrentTerm())
			cancel, done = n.startTerm()
		}
	}
}

func (n *Node) startTerm() (context.CancelFunc, chan struct{}) {
	ctx, cancel := context.WithCancel(n.ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		n.leaderTerm(ctx)
	}()
	return cancel, done
}

func (n *Node) clearReady() bool {
	n.clk.mu.Lock()
	defer n.clk.mu.Unlock()
	was := n.clk.ready
	n.clk.ready = false
	return was
}

// leaderTerm establishes the leader clock for the current term and then keeps FSM time
// moving with tick entries while the log is idle. It returns when ctx ends or leadership
// is lost.
func (n *Node) leaderTerm(ctx context.Context) {
	term := n.raft.CurrentTerm()
	// The barrier makes the FSM apply everything committed before this term, so base is
	// at least every timestamp any earlier leader got committed.
	for {
		err := n.wait(ctx, n.raft.Barrier(n.cfg.ElectionTimeout))
		if err == nil {
			break
		}
		if ctx.Err() != nil || errors.Is(err, raft.ErrNotLeader) ||
			errors.Is(err, raft.ErrLeadershipLost) || errors.Is(err, raft.ErrRaftShutdown) {
			n.log.Info("leadership setup abandoned", "term", term, "err", err)
			return
		}
		n.log.Warn("leadership barrier failed; retrying", "term", term, "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
	// The first entry of the term must already be written at a version every server applies.
	n.refreshCommandVersion(ctx)
	n.clk.mu.Lock()
	if ctx.Err() != nil || n.raft.State() != raft.Leader || n.raft.CurrentTerm() != term {
		n.clk.mu.Unlock()
		return
	}
	n.clk.base = n.fsm.Clock()
	n.clk.start = n.clock.Now()
	n.clk.term = term
	n.clk.ready = true
	base := n.clk.base
	n.clk.mu.Unlock()
	n.log.Info("leadership established", "term", term, "fsm_clock", base,
		"applied_index", n.fsm.AppliedIndex())
	n.notifyLeaderChange()
	n.triggerReconcile()
	n.tickLoop(ctx)
}

// tickLoop applies a tick entry whenever no entry was applied for TickInterval.
func (n *Node) tickLoop(ctx context.Context) {
	interval := n.cfg.TickInterval
	poll := max(interval/5, time.Millisecond)
	t := time.NewTicker(poll)
	defer t.Stop()
	lastIdx := n.fsm.AppliedIndex()
	lastChange := n.clock.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := n.clock.Now()
		if idx := n.fsm.AppliedIndex(); idx != lastIdx {
			lastIdx, lastChange = idx, now
			continue
		}
		if now.Sub(lastChange) < interval {
			continue
		}
		ts, err := n.Now()
		if err != nil {
			return // leadership lost; leadershipLoop will cancel us
		}
		actx, cancel := context.WithTimeout(ctx, max(4*interval, n.cfg.ElectionTimeout))
		_, err = n.Apply(actx, n.fsm.EncodeTick(ts, n.CommandVersion()))
		cancel()
		if err != nil {
			if errors.Is(err, ErrNotLeader) || ctx.Err() != nil {
				return
			}
			n.log.Warn("idle tick failed", "err", err)
		}
		lastIdx, lastChange = n.fsm.AppliedIndex(), n.clock.Now()
	}
}

// observeLoop turns raft leader observations (any node's leadership, as seen here) into
// LeaderChanged notifications, and leader and peer (configuration) changes into a reconcile
// (which also recomputes CommandVersion). Peer observations come only on the leader:
// hashicorp/raft emits them when it starts or stops replicating to a server.
func (n *Node) observeLoop() {
	ch := make(chan raft.Observation, 16)
	obs := raft.NewObserver(ch, false, func(o *raft.Observation) bool {
		switch o.Data.(type) {
		case raft.LeaderObservation, raft.PeerObservation:
			return true
		}
		return false
	})
	n.raft.RegisterObserver(obs)
	defer n.raft.DeregisterObserver(obs)
	for {
		select {
		case <-n.ctx.Done():
			return
		case o := <-ch:
			if _, ok := o.Data.(raft.LeaderObservation); ok {
				n.notifyLeaderChange()
			}
			n.triggerReconcile()
		}
	}
}
