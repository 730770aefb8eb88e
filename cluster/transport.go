package cluster

import (
	"io"
	"sync"
	"time"

	"github.com/hashicorp/raft"
)

// peerTransport wraps the Raft network transport on every node. It adds two things raft
// does not have:
//
//   - On the leader it records, per server, the highest log index the leader itself
//     replicated to it (an AppendEntries the server acknowledged with Success: the request's
//     last entry; an InstallSnapshot it accepted: the snapshot's index) and when it last
//     answered. Promotion of non-voters uses this (membership.go), never what a node
//     advertises in gossip. It also notices a voter whose log went backwards below what it had
//     acknowledged in this term (its data dir was wiped): the reconciler demotes it.
//   - On a node that is recovering (it came up without Raft state and did not bootstrap, see
//     recovery.go), it answers RequestVote and RequestPreVote itself with Granted=false, so
//     an empty log cannot help elect a leader that lacks entries it had acknowledged before
//     it lost them. Everything else reaches raft unchanged.
//
// Pipelined replication is off (Config comment in openRaft), so AppendEntriesPipeline always
// declines and every AppendEntries passes through AppendEntries here.
type peerTransport struct {
	inner *raft.NetworkTransport
	clock Clock
	rec   *recovery
	repl  replication

	consumer chan raft.RPC
	done     chan struct{}
	stopOnce sync.Once
	wg       sync.WaitGroup
}

func newPeerTransport(inner *raft.NetworkTransport, clock Clock, rec *recovery, onRegressed func()) *peerTransport {
	t := &peerTransport{
		inner: inner, clock: clock, rec: rec,
		repl:     replication{peers: map[raft.ServerID]*replica{}, onRegressed: onRegressed},
		consumer: make(chan raft.RPC),
		done:     make(chan struct{}),
	}
	t.wg.Add(1)
	go t.forward()
	return t
}

// forward passes RPCs from the network to raft, answering vote requests itself while the
// node recovers.
func (t *peerTransport) forward() {
	defer t.wg.Done()
	in := t.inner.Consumer()
	for {
		var rpc raft.RPC
		select {
		case rpc = <-in:
		case <-t.done:
			return
		}
		if t.intercept(rpc) {
			continue
		}
		select {
		case t.consumer <- rpc:
		case <-t.done:
			return
		}
	}
}

// intercept answers rpc itself (true) or lets it through (false).
func (t *peerTransport) intercept(rpc raft.RPC) bool {
	switch req := rpc.Command.(type) {
	case *raft.AppendEntriesRequest:
		t.rec.sawLeader(req.LeaderCommitIndex, "append entries")
	case *raft.InstallSnapshotRequest:
		t.rec.sawLeader(req.LastLogIndex, "snapshot")
	case *raft.RequestVoteRequest:
		if t.rec.refuseVotes() {
			rpc.Respond(&raft.RequestVoteResponse{RPCHeader: t.header(), Term: req.Term, Granted: false}, nil)
			t.rec.refusedVote(string(req.ID), req.Term, false)
			return true
		}
	case *raft.RequestPreVoteRequest:
		if t.rec.refuseVotes() {
			rpc.Respond(&raft.RequestPreVoteResponse{RPCHeader: t.header(), Term: req.Term, Granted: false}, nil)
			t.rec.refusedVote(string(req.ID), req.Term, true)
			return true
		}
	}
	return false
}

func (t *peerTransport) header() raft.RPCHeader {
	return raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte(t.rec.id), Addr: []byte(t.inner.LocalAddr())}
}

// Consumer implements raft.Transport.
func (t *peerTransport) Consumer() <-chan raft.RPC { return t.consumer }

// LocalAddr implements raft.Transport.
func (t *peerTransport) LocalAddr() raft.ServerAddress { return t.inner.LocalAddr() }

// AppendEntriesPipeline implements raft.Transport: pipelining is off.
func (t *peerTransport) AppendEntriesPipeline(raft.ServerID, raft.ServerAddress) (raft.AppendPipeline, error) {
	return nil, raft.ErrPipelineReplicationNotSupported
}

// AppendEntries implements raft.Transport and records what the target acknowledged.
func (t *peerTransport) AppendEntries(id raft.ServerID, target raft.ServerAddress, args *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) error {
	err := t.inner.AppendEntries(id, target, args, resp)
	if err == nil {
		t.repl.append(id, args, resp, t.clock.Now())
	}
	return err
}

// RequestVote implements raft.Transport.
func (t *peerTransport) RequestVote(id raft.ServerID, target raft.ServerAddress, args *raft.RequestVoteRequest, resp *raft.RequestVoteResponse) error {
	return t.inner.RequestVote(id, target, args, resp)
}

// RequestPreVote implements raft.WithPreVote.
func (t *peerTransport) RequestPreVote(id raft.ServerID, target raft.ServerAddress, args *raft.RequestPreVoteRequest, resp *raft.RequestPreVoteResponse) error {
	return t.inner.RequestPreVote(id, target, args, resp)
}

// InstallSnapshot implements raft.Transport and records an accepted snapshot.
func (t *peerTransport) InstallSnapshot(id raft.ServerID, target raft.ServerAddress, args *raft.InstallSnapshotRequest, resp *raft.InstallSnapshotResponse, data io.Reader) error {
	err := t.inner.InstallSnapshot(id, target, args, resp, data)
	if err == nil && resp.Success {
		t.repl.acked(id, args.Term, args.LastLogIndex, t.clock.Now())
	}
	return err
}

// EncodePeer implements raft.Transport.
func (t *peerTransport) EncodePeer(id raft.ServerID, addr raft.ServerAddress) []byte {
	return t.inner.EncodePeer(id, addr)
}

// DecodePeer implements raft.Transport.
func (t *peerTransport) DecodePeer(b []byte) raft.ServerAddress { return t.inner.DecodePeer(b) }

// SetHeartbeatHandler implements raft.Transport. Heartbeats carry neither votes nor a commit
// index, so they take raft's fast path unfiltered.
func (t *peerTransport) SetHeartbeatHandler(cb func(rpc raft.RPC)) { t.inner.SetHeartbeatHandler(cb) }

// TimeoutNow implements raft.Transport.
func (t *peerTransport) TimeoutNow(id raft.ServerID, target raft.ServerAddress, args *raft.TimeoutNowRequest, resp *raft.TimeoutNowResponse) error {
	return t.inner.TimeoutNow(id, target, args, resp)
}

// Close implements raft.WithClose.
func (t *peerTransport) Close() error {
	err := t.inner.Close()
	t.stopOnce.Do(func() { close(t.done) })
	t.wg.Wait()
	return err
}

// replication is the leader's own record of what each server acknowledged, for the current
// term. All methods are safe for concurrent use (raft replicates to each server on its own
// goroutine).
type replication struct {
	mu          sync.Mutex
	peers       map[raft.ServerID]*replica
	onRegressed func() // called (without mu) when a server's log went backwards
}

// replica is what the leader observed of one server in term.
type replica struct {
	term      uint64
	matched   uint64    // highest index it acknowledged in term
	lastOK    time.Time // last successful AppendEntries (heartbeats too) or snapshot
	regressed bool      // it reported a log shorter than matched: it lost acknowledged entries
	lostFrom  uint64    // matched when it regressed
	lostTo    uint64    // the last index it reported then
}

func (r *replication) get(id raft.ServerID, term uint64) *replica {
	p := r.peers[id]
	if p == nil || p.term != term {
		// A new term: what the server acknowledged to an earlier leader proves nothing now.
		p = &replica{term: term}
		r.peers[id] = p
	}
	return p
}

func (r *replication) append(id raft.ServerID, req *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse, now time.Time) {
	if resp.Term > req.Term {
		return // it knows a newer term; this node is no longer leader
	}
	last := req.PrevLogEntry
	if n := len(req.Entries); n > 0 {
		last = req.Entries[n-1].Index
	}
	r.mu.Lock()
	p := r.get(id, req.Term)
	regressed := false
	if resp.Success {
		p.matched = max(p.matched, last)
		p.lastOK = now
	} else if resp.LastLog < p.matched {
		// Within one term a server's log holds every entry it acknowledged to this leader
		// (they are a prefix of the leader's log and it fsyncs before answering): only losing
		// its data dir makes it forget them.
		p.regressed, p.lostFrom, p.lostTo = true, p.matched, resp.LastLog
		p.matched = resp.LastLog
		regressed = true
	}
	r.mu.Unlock()
	if regressed && r.onRegressed != nil {
		r.onRegressed()
	}
}

func (r *replication) acked(id raft.ServerID, term, index uint64, now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	p := r.get(id, term)
	p.matched = max(p.matched, index)
	p.lastOK = now
}

// observed returns a copy of what the leader saw of id in term (zero if nothing).
func (r *replication) observed(id raft.ServerID, term uint64) replica {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p := r.peers[id]; p != nil && p.term == term {
		return *p
	}
	return replica{}
}

// clearRegressed forgets a regression once the server was demoted.
func (r *replication) clearRegressed(id raft.ServerID, term uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p := r.peers[id]; p != nil && p.term == term {
		p.regressed = false
	}
}

// forget drops a server removed from the configuration.
func (r *replication) forget(id raft.ServerID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.peers, id)
}
