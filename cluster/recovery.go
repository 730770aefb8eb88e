package cluster

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"
)

// recoveringFile marks a data dir whose node came up without Raft state and has not caught
// up with a leader yet. It survives restarts, so a node that crashes halfway through catching
// up is still recovering when it comes back with a partial log.
const recoveringFile = "recovering"

// recovery keeps a node that lost (or never had) its Raft log from voting until it has
// caught up.
//
// Why: Raft's safety rests on every voter keeping, on disk, each entry it acknowledged and
// the vote it cast. A voter whose data dir was wiped comes back empty but still counted as a
// voter by the others. If it votes, a candidate missing entries that were committed by a
// majority including the wiped node's lost copy can win: the wipe-plus-pause run lost
// 18,566 acknowledged admissions that way. So a node that starts without Raft state and does
// not bootstrap a new cluster is "recovering": the transport answers every RequestVote and
// RequestPreVote for it with Granted=false (peerTransport.intercept) until its last log index
// reaches the commit index of the first leader it heard from (the LeaderCommitIndex of its
// first AppendEntries, or the index of a snapshot it was sent). On the leader's side the
// wiped voter is demoted (membership.go) and re-promoted once it keeps up.
//
// A recovering node never heard of any leader votes for no one; if the cluster lost its other
// copies at the same time it stays without a leader rather than electing one that lacks
// acknowledged data. docs/architecture.md says what an operator does then.
type recovery struct {
	id  string
	dir string
	log *slog.Logger

	active    atomic.Bool
	target    atomic.Uint64                 // the first leader commit index seen (0: none yet)
	lastIndex atomic.Pointer[func() uint64] // raft.LastIndex once raft exists

	logMu      sync.Mutex
	lastLog    time.Time
	suppressed int
}

// startRecovery decides whether the node in dir is recovering: it is if it starts without
// Raft state, or if an earlier start without state did not catch up before it stopped.
func startRecovery(id, dir string, hasState bool, log *slog.Logger) (*recovery, error) {
	r := &recovery{id: id, dir: dir, log: log}
	path := filepath.Join(dir, recoveringFile)
	_, err := os.Stat(path)
	marked := err == nil
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("cluster: %w", err)
	}
	if !hasState && !marked {
		if err := os.WriteFile(path, []byte("this node started without Raft state; it does not vote until it has caught up\n"), 0o600); err != nil {
			return nil, fmt.Errorf("cluster: mark data dir as recovering: %w", err)
		}
		marked = true
	}
	r.active.Store(marked)
	if marked && hasState {
		log.Warn("recovering: this node started without Raft state earlier and has not caught up since; it does not vote until it has")
	}
	return r, nil
}

func (r *recovery) setLastIndex(f func() uint64) { r.lastIndex.Store(&f) }

// sawLeader records the commit index (or snapshot index) a leader sent while recovering.
func (r *recovery) sawLeader(index uint64, what string) {
	if !r.active.Load() || index == 0 || r.target.Load() != 0 {
		return
	}
	if r.target.CompareAndSwap(0, index) {
		r.log.Info("recovering: heard from a leader; not voting until the log reaches its commit index",
			"via", what, "commit_index", index)
	}
}

// refuseVotes reports whether vote requests must be refused now; it ends the recovery when
// the node has caught up.
func (r *recovery) refuseVotes() bool {
	if !r.active.Load() {
		return false
	}
	return !r.check()
}

// check ends the recovery if the node has caught up; true if it is over.
func (r *recovery) check() bool {
	if !r.active.Load() {
		return true
	}
	target := r.target.Load()
	f := r.lastIndex.Load()
	if target == 0 || f == nil {
		return false
	}
	if last := (*f)(); last >= target {
		r.finish("caught up with the leader", slog.Uint64("last_index", last), slog.Uint64("commit_index_seen", target))
		return true
	}
	return false
}

// finish ends the recovery (caught up, or bootstrapped a new cluster).
func (r *recovery) finish(why string, attrs ...any) {
	if !r.active.CompareAndSwap(true, false) {
		return
	}
	if err := os.Remove(filepath.Join(r.dir, recoveringFile)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		r.log.Warn("recovering: removing the marker file failed; the node will not vote after a restart until it catches up again", "err", err)
	}
	r.log.Info("recovery over: this node votes again", append([]any{"reason", why}, attrs...)...)
}

// refusedVote logs refused votes, at most once per refusalLogEvery.
func (r *recovery) refusedVote(candidate string, term uint64, pre bool) {
	r.logMu.Lock()
	now := time.Now()
	if now.Sub(r.lastLog) < refusalLogEvery {
		r.suppressed++
		r.logMu.Unlock()
		return
	}
	n := r.suppressed + 1
	r.suppressed, r.lastLog = 0, now
	r.logMu.Unlock()
	var last uint64
	if f := r.lastIndex.Load(); f != nil {
		last = (*f)()
	}
	r.log.Warn("recovering: refused to vote; this node's log is not caught up (its data dir was empty at start)",
		"candidate", candidate, "term", term, "pre_vote", pre, "refused", n,
		"last_index", last, "commit_index_seen", r.target.Load())
}

// Recovering reports whether the node does not vote because it started without Raft state
// and has not caught up with a leader yet.
func (n *Node) Recovering() bool { return n.rec.active.Load() }

// recoveryLoop ends the recovery once caught up, also when no vote request comes to check.
func (n *Node) recoveryLoop() {
	for n.rec.active.Load() && n.sleepCtx(100*time.Millisecond) {
		n.rec.check()
	}
}
