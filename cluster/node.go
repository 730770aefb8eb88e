// Package cluster runs one quotad node: a hashicorp/raft replica (a BoltDB or write-ahead log and
// a BoltDB stable store, fsynced on every write; an in-memory log cache, file snapshots, TCP
// transport), memberlist gossip for discovery, joining, bootstrapping and dead-node cleanup,
// and the leader's monotonic clock and idle ticks.
//
// cluster owns every clock read that reaches the state machine: while this node is the
// established leader, Now() stamps commands with FSM time derived from the monotonic clock,
// and the FSM itself never reads a clock. cluster never interprets log entries; it must never
// serve reads from follower state (see VerifyRead) and never turns off fsync.
package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"go.etcd.io/bbolt"

	"github.com/quotad/quotad/cluster/wal"
)

// FSM is what a Node needs of its state machine (fsm.FSM implements it).
//
// Raft calls Apply/ApplyBatch, Snapshot and Restore from its FSM goroutine, one at a time.
// Clock and AppliedIndex are called from other goroutines concurrently with those, so they
// must be safe for concurrent use (an atomic load is enough). EncodeTick is pure.
type FSM interface {
	raft.BatchingFSM

	// Clock returns FSM time (ns) after the last applied entry: the maximum of the timestamps
	// carried by every entry applied so far (and the clock restored from a snapshot).
	Clock() int64

	// AppliedIndex returns the Raft index of the last entry the FSM applied (0 if none).
	AppliedIndex() uint64

	// EncodeTick returns a log entry that only advances FSM time to ts (expiring leases and
	// refilling buckets as any entry at ts would), written at command version (0: the FSM's
	// own; see Node.CommandVersion).
	EncodeTick(ts int64, version int) []byte
}

// Node is one member of a quotad cluster. Create it with NewNode; it is running when
// NewNode returns and stops with Shutdown. All methods are safe for concurrent use.
type Node struct {
	cfg   Config
	log   *slog.Logger
	clock Clock
	fsm   FSM

	raft       *raft.Raft
	trans      *raft.NetworkTransport
	peers      *peerTransport // wraps trans: replication observed as leader, votes while recovering
	stream     *tcpStream
	rec        *recovery
	bolt       *raftboltdb.BoltStore
	stable     *guardedStable // bolt as raft's stable store (undoFailedBootstrap)
	logs       *watchedLogStore
	ml         *memberlist.Memberlist
	raftAddr   string
	gossipAddr string

	ctx      context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	stopOnce sync.Once
	stopErr  error
	closed   atomic.Bool
	// leaving: a graceful stop has begun; raft's errors about peers going away are expected
	// from then on and logged at INFO (cluster/log.go, leavingNoise).
	leaving atomic.Bool

	clk leaderClock
	// stampMu is held shared by ApplyNow from taking a timestamp until raft has queued the
	// entry, and exclusively by a restore before its barrier: once the barrier is applied no
	// entry stamped before the restore is still on its way to the log.
	stampMu sync.RWMutex
	// cmdVersion is the FSM command version new entries are written at (cmdversion.go).
	cmdVersion   atomic.Int64
	cmdVersionMu sync.Mutex // one refreshCommandVersion at a time

	walLog   *wal.Log // the log store with LogStore "wal" (bolt is then only the stable store); else nil
	logStore string   // the backend in use: LogStoreBoltDB or LogStoreWAL (never LogStoreAuto)

	lcMu sync.Mutex
	lcCh chan struct{}

	gossip gossipState

	reconcileCh chan struct{}
	// removedAt: when this node, as leader, removed a server — by the reconcile loop (dead)
	// or on request (RemoveServer) — so reconcile does not add it back before RejoinDelay.
	removedMu   sync.Mutex
	removedAt   map[string]time.Time
	bootstrapCh chan struct{}

	cidMu       sync.Mutex
	cid         string // cluster ID (datadir.go)
	cidMismatch bool   // logged once; only metaLoop touches it
	nonce       string // advertised before bootstrap (bootstrapClusterID)
}

// leaderClock is the leader's FSM-time source for one term.
type leaderClock struct {
	mu    sync.Mutex
	ready bool      // leadership established in term
	term  uint64    // raft term the clock was established in
	base  int64     // FSM clock after the barrier
	start time.Time // Clock reading taken right after base
	last  int64     // largest value Now returned, across terms: Now never decreases
}

// NewNode opens (or creates) the node's data directory, starts Raft, memberlist and the
// node's background loops, and returns. It does not wait for a leader.
func NewNode(cfg Config, f FSM) (*Node, error) {
	if f == nil {
		return nil, errors.New("cluster: NewNode needs an FSM, got nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Clock == nil {
		cfg.Clock = SystemClock{}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default().With("node", cfg.ID)
	}
	cfg.Join = append([]string(nil), cfg.Join...)
	n := &Node{
		cfg:         cfg,
		log:         cfg.Logger, // names the node already (cmd/quotad, the harnesses, or the default above)
		clock:       cfg.Clock,
		fsm:         f,
		lcCh:        make(chan struct{}),
		reconcileCh: make(chan struct{}, 1),
		removedAt:   make(map[string]time.Time),
		bootstrapCh: make(chan struct{}, 1),
	}
	n.gossip.peers = make(map[string]*peer)
	n.ctx, n.cancel = context.WithCancel(context.Background())

	if err := n.openRaft(); err != nil {
		n.closeStores()
		return nil, err
	}
	if err := n.startGossip(); err != nil {
		_ = n.raft.Shutdown().Error()
		n.closeStores()
		return nil, err
	}
	n.goLoop(n.leadershipLoop)
	n.goLoop(n.observeLoop)
	n.goLoop(n.metaLoop)
	n.goLoop(n.reconcileLoop)
	n.goLoop(n.recoveryLoop)
	if join := n.joinAddrs(); len(join) > 0 {
		n.goLoop(func() { n.joinLoop(join) })
	}
	if n.cfg.BootstrapExpect > 0 && n.raft.LastIndex() == 0 {
		n.goLoop(n.bootstrapLoop)
	}
	n.log.Info("node started", "raft_addr", n.raftAddr, "gossip_addr", n.gossipAddr,
		"existing_state", n.raft.LastIndex() > 0, "recovering", n.rec.active.Load(),
		"peer_tls", n.cfg.PeerTLS != nil, "gossip_encrypted", len(n.cfg.GossipSecretKey) > 0)
	if n.cfg.PeerTLS == nil || len(n.cfg.GossipSecretKey) == 0 {
		n.log.Warn("INSECURE: Raft and/or gossip are not authenticated; anyone who can reach their ports can write the replicated log or join the cluster (run with TLS and a gossip key in production)",
			"peer_tls", n.cfg.PeerTLS != nil, "gossip_encrypted", len(n.cfg.GossipSecretKey) > 0)
	}
	return n, nil
}

func (n *Node) goLoop(f func()) {
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		f()
	}()
}

func (n *Node) openRaft() error {
	cfg := n.cfg
	if err := secureDataDir(cfg.DataDir, n.log); err != nil {
		return err
	}
	if err := claimDataDir(cfg.DataDir, cfg.ID); err != nil {
		return err
	}
	cid, err := readClusterID(cfg.DataDir)
	if err != nil {
		return err
	}
	n.cid = cid
	var nonce [8]byte
	_, _ = rand.Read(nonce[:])
	n.nonce = hex.EncodeToString(nonce[:])
	backend, bolt, logs, walLog, err := openLogStore(cfg.DataDir, cfg.LogStore, n.log)
	if err != nil {
		return err
	}
	n.logStore, n.bolt, n.walLog = backend, bolt, walLog
	if cfg.WrapLogStore != nil {
		logs = cfg.WrapLogStore(logs)
	}
	n.logs = &watchedLogStore{LogStore: logs}
	logs = n.logs
	cache, err := raft.NewLogCache(cfg.LogCacheSize, logs)
	if err != nil {
		return fmt.Errorf("cluster: log cache: %w", err)
	}
	hl := newHCLog(n.log, "raft", cfg.LibraryLogLevel)
	hl.(*hclogAdapter).leaving = &n.leaving
	hl.(*hclogAdapter).peerLeft = n.peerLeftRecently
	snaps, err := openSnapshotStore(cfg.DataDir, cfg.SnapshotRetain, hl.Named("snapshots"))
	if err != nil {
		return fmt.Errorf("cluster: snapshot store in %q: %w", cfg.DataDir, err)
	}
	hasState, err := raft.HasExistingState(cache, bolt, snaps)
	if err != nil {
		return fmt.Errorf("cluster: read Raft state in %q: %w", cfg.DataDir, err)
	}
	if n.rec, err = startRecovery(cfg.ID, cfg.DataDir, hasState, n.log); err != nil {
		return err
	}
	stream, err := newTCPStream(cfg.RaftAddr, cfg.PeerTLS, cfg.PeerHandshakeTimeout, n.log)
	if err != nil {
		return fmt.Errorf("cluster: raft transport on %q: %w", cfg.RaftAddr, err)
	}
	n.stream = stream
	var layer raft.StreamLayer = stream
	if cfg.WrapStreamLayer != nil {
		layer = cfg.WrapStreamLayer(layer)
	}
	// Outermost, so a connection it replaces is dialed through every layer (redial.go).
	layer = newRedialLayer(layer, n.log)
	trans := raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream:  layer,
		MaxPool: 3,
		Timeout: 10 * time.Second,
		// 1 disables pipelined replication. With pipelining, a follower answering
		// Success=false while a send is in flight can deadlock raft's replication
		// goroutine for that follower (it then gets heartbeats but never entries again, and
		// Raft.Shutdown hangs); we hit it in tests under -race. Batching (MaxAppendEntries,
		// BatchApplyCh, group commit above us) recovers the throughput; raft's own docs
		// report pipelining barely helps with batching on a LAN.
		MaxRPCsInFlight: 1,
		Logger:          hl.Named("transport"),
	})
	n.trans = trans
	n.peers = newPeerTransport(trans, n.clock, n.rec, n.triggerReconcile)
	n.raftAddr = string(trans.LocalAddr())

	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(cfg.ID)
	rc.Logger = hl
	rc.HeartbeatTimeout = cfg.HeartbeatTimeout
	rc.ElectionTimeout = cfg.ElectionTimeout
	rc.LeaderLeaseTimeout = cfg.LeaderLeaseTimeout
	rc.CommitTimeout = cfg.CommitTimeout
	rc.MaxAppendEntries = cfg.MaxAppendEntries
	rc.BatchApplyCh = true
	rc.SnapshotInterval = cfg.SnapshotInterval
	rc.SnapshotThreshold = cfg.SnapshotThreshold
	rc.TrailingLogs = cfg.TrailingLogs
	// A node removed while dead keeps running as a follower so the leader can add it back
	// when it returns; raft's default would shut it down for good.
	rc.ShutdownOnRemove = false
	if err := raft.ValidateConfig(rc); err != nil {
		return fmt.Errorf("cluster: raft config: %w", err)
	}
	n.stable = &guardedStable{StableStore: bolt}
	r, err := raft.NewRaft(rc, n.fsm, cache, n.stable, snaps, n.peers)
	if err != nil {
		return fmt.Errorf("cluster: start raft: %w", err)
	}
	n.raft = r
	n.rec.setLastIndex(r.LastIndex)
	return nil
}

// boltOptions opens the Raft log and stable store. NoSync stays false: an acknowledged
// decision must be on disk on a quorum (invariant 5).
//
// NoFreelistSync: bolt otherwise rewrites its whole freelist at every commit. Each snapshot
// compacts the log, freeing the pages of thousands of entries, so the freelist grows to
// hundreds of KB and every later StoreLogs writes (and fsyncs) it: 2.5–3x slower appends
// (p50 ~3 ms against ~1 ms; BenchmarkStoreLogsAfterCompaction). The price is rebuilding the
// freelist by scanning the file when the node opens it (~70 ms for a 400 MB log). The map
// freelist makes that rebuild and allocation cheap for large files.
func boltOptions(path string) raftboltdb.Options {
	return raftboltdb.Options{
		Path: path,
		BoltOptions: &bbolt.Options{
			Timeout:        2 * time.Second,
			NoFreelistSync: true,
			FreelistType:   bbolt.FreelistMapType,
		},
	}
}

func (n *Node) closeStores() {
	if n.peers != nil {
		_ = n.peers.Close()
	} else if n.trans != nil {
		_ = n.trans.Close()
	}
	if n.bolt != nil {
		_ = n.bolt.Close()
	}
	if n.walLog != nil {
		_ = n.walLog.Close()
	}
}

// ID returns the node's ID.
func (n *Node) ID() string { return n.cfg.ID }

// LogStore returns the Raft log store backend the node opened its data dir with:
// LogStoreBoltDB or LogStoreWAL (with Config.LogStore LogStoreAuto, the one chosen).
func (n *Node) LogStore() string { return n.logStore }

// RaftAddr returns the address the Raft transport listens on (the actual port if
// Config.RaftAddr had port 0).
func (n *Node) RaftAddr() string { return n.raftAddr }

// GossipAddr returns the address memberlist listens on (the actual port if
// Config.GossipAddr had port 0).
func (n *Node) GossipAddr() string { return n.gossipAddr }

// RefusedPeerConns returns how many incoming Raft connections this node refused because they
// did not complete a TLS handshake with a server certificate of the cluster.
func (n *Node) RefusedPeerConns() uint64 { return n.stream.refusals.Refused() }

// Raft returns the underlying raft instance, for metrics and tests. Entries applied through
// it directly bypass the leader clock; use Node.Apply.
func (n *Node) Raft() *raft.Raft { return n.raft }

// Now returns the leader's timestamp for a new command, in FSM time (ns): the FSM clock
// when this node's leadership was established plus the time elapsed since on the node's
// monotonic Clock. The election gap is not credited. Successive calls never decrease, also
// across this node's terms. It returns ErrNotLeader unless this node is the leader and has
// finished establishing leadership (barrier applied, base clock read).
func (n *Node) Now() (int64, error) {
	n.clk.mu.Lock()
	defer n.clk.mu.Unlock()
	if !n.clk.ready || n.raft.State() != raft.Leader || n.raft.CurrentTerm() != n.clk.term {
		return 0, ErrNotLeader
	}
	ts := n.clk.base + int64(n.clock.Now().Sub(n.clk.start))
	if plantedWallClock {
		ts = n.clock.Now().UnixNano()
	}
	if ts < n.clk.last {
		ts = n.clk.last
	}
	n.clk.last = ts
	return ts, nil
}

// IsLeader reports whether this node is the leader and has established its clock, i.e.
// whether Now would succeed. Leader() may name this node slightly earlier.
func (n *Node) IsLeader() bool {
	_, ok := n.readyTerm()
	return ok
}

func (n *Node) readyTerm() (uint64, bool) {
	n.clk.mu.Lock()
	defer n.clk.mu.Unlock()
	ok := n.clk.ready && n.raft.State() == raft.Leader && n.raft.CurrentTerm() == n.clk.term
	return n.clk.term, ok
}

// Leader returns the current leader's ID and advertised gRPC address as this node knows
// them; either is "" if unknown (no leader, or its gossip metadata not seen yet).
func (n *Node) Leader() (id, grpcAddr string) {
	_, lid := n.raft.LeaderWithID()
	id = string(lid)
	if id == "" {
		return "", ""
	}
	if id == n.cfg.ID {
		return id, n.cfg.GRPCAddr
	}
	if p, ok := n.peer(id); ok {
		return id, p.meta.GRPC
	}
	return id, ""
}

// LeaderChanged returns a channel that is closed at the next change of this node's view of
// leadership: another leader elected or lost, or this node becoming able (IsLeader) or no
// longer able to serve as leader. Call it before reading Leader()/IsLeader() to not miss a
// change:
//
//	for {
//		ch := n.LeaderChanged()
//		id, addr := n.Leader()
//		...
//		<-ch
//	}
func (n *Node) LeaderChanged() <-chan struct{} {
	n.lcMu.Lock()
	defer n.lcMu.Unlock()
	return n.lcCh
}

func (n *Node) notifyLeaderChange() {
	n.lcMu.Lock()
	close(n.lcCh)
	n.lcCh = make(chan struct{})
	n.lcMu.Unlock()
}

// Apply appends data to the Raft log and waits until it is committed and applied, returning
// the FSM's response for it. ctx's deadline bounds the wait to enqueue the entry; ctx's end
// also stops the wait for the commit.
//
// Errors: ErrNotLeader (nothing appended; retry on the leader); ErrOutcomeUnknown when the
// entry may have been appended but its fate is unknown: leadership lost
// (raft.ErrLeadershipLost, also wrapped), shutdown, or ctx ended while waiting. An unknown
// outcome may still commit later, so retries must carry the same request ID.
func (n *Node) Apply(ctx context.Context, data []byte) (any, error) {
	timeout, err := n.applyTimeout(ctx)
	if err != nil {
		return nil, err
	}
	f := n.raft.Apply(data, timeout)
	if err := n.wait(ctx, f); err != nil {
		return nil, applyError(err)
	}
	return f.Response(), nil
}

// ApplyNow is Apply of the entry encode builds from a fresh Now timestamp, which it also
// returns, and the command version to write it at (CommandVersion). Taking the timestamp and
// queueing the entry in raft is one step that a restore excludes (RestoreSnapshotPrepared): an entry stamped before a restore is in the log before
// the restore's barrier, never committed while the restore is being prepared. encode runs
// while restores are held off: it must not block.
func (n *Node) ApplyNow(ctx context.Context, encode func(ts int64, version int) []byte) (any, int64, error) {
	wait, err := n.EnqueueNow(ctx, encode)
	if err != nil {
		return nil, 0, err
	}
	return wait()
}

// EnqueueNow is ApplyNow's first half: it stamps the entry encode builds and queues it in
// raft, and returns a function that waits for its commit (bounded by ctx, as ApplyNow) and
// returns the FSM's response and the timestamp. Entries queued by successive calls from one
// goroutine reach the log in that order — what ApplyNow from concurrent goroutines cannot
// promise (each races the others to raft's queue). Errors as ApplyNow: before anything was
// queued from EnqueueNow, after from the wait.
func (n *Node) EnqueueNow(ctx context.Context, encode func(ts int64, version int) []byte) (func() (any, int64, error), error) {
	timeout, err := n.applyTimeout(ctx)
	if err != nil {
		return nil, err
	}
	n.stampMu.RLock()
	ts, err := n.Now()
	if err != nil {
		n.stampMu.RUnlock()
		return nil, err
	}
	f := n.raft.Apply(encode(ts, n.CommandVersion()), timeout)
	n.stampMu.RUnlock()
	return func() (any, int64, error) {
		if err := n.wait(ctx, f); err != nil {
			return nil, 0, applyError(err)
		}
		return f.Response(), ts, nil
	}, nil
}

// applyTimeout checks the node and ctx before an apply and returns the enqueue timeout
// ctx's deadline allows (0: none).
func (n *Node) applyTimeout(ctx context.Context) (time.Duration, error) {
	if n.closed.Load() {
		return 0, ErrShutdown
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	var timeout time.Duration
	if dl, ok := ctx.Deadline(); ok {
		if timeout = time.Until(dl); timeout <= 0 {
			return 0, context.DeadlineExceeded
		}
	}
	return timeout, nil
}

// wait waits for f, for ctx to end, or for the node to stop, whichever is first. raft
// leaves some futures unresolved forever when it shuts down (an entry still queued, a
// barrier the FSM never reached), so nothing here waits on a future without this.
func (n *Node) wait(ctx context.Context, f raft.Future) error {
	done := make(chan error, 1)
	go func() { done <- f.Error() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("%w: %w", ErrOutcomeUnknown, ctx.Err())
	case <-n.ctx.Done():
		return fmt.Errorf("%w: %w", ErrOutcomeUnknown, ErrShutdown)
	}
}

func applyError(err error) error {
	switch {
	case errors.Is(err, ErrOutcomeUnknown):
		return err
	case errors.Is(err, raft.ErrNotLeader), errors.Is(err, raft.ErrLeadershipTransferInProgress):
		return fmt.Errorf("%w: %w", ErrNotLeader, err)
	case errors.Is(err, raft.ErrLeadershipLost):
		return fmt.Errorf("%w: %w", ErrOutcomeUnknown, err)
	case errors.Is(err, raft.ErrRaftShutdown):
		return fmt.Errorf("%w: %w: %w", ErrOutcomeUnknown, ErrShutdown, err)
	case errors.Is(err, raft.ErrEnqueueTimeout):
		// Not appended: the apply queue stayed full until the deadline.
		return fmt.Errorf("%w: %w", context.DeadlineExceeded, err)
	}
	return fmt.Errorf("cluster: apply: %w", err)
}

// VerifyRead establishes a linearizable read point: when it returns nil, this node's FSM
// reflects every write acknowledged anywhere before VerifyRead was called, so the caller may
// read FSM state (it should read right away; the guarantee is for "now").
//
// Why no applied-index wait is needed: leadership setup applied a barrier, so the FSM holds
// everything committed before this term; every write acknowledged in this term went through
// this node's Apply, which returns only after the local FSM applied it; and VerifyLeader
// proves no newer leader could have acknowledged anything. The term is re-checked after
// VerifyLeader so a lost-and-regained leadership (new barrier pending) is not mistaken for
// the old one. Errors: ErrNotLeader, ErrShutdown, or ctx's error.
func (n *Node) VerifyRead(ctx context.Context) error {
	if n.closed.Load() {
		return ErrShutdown
	}
	term, ok := n.readyTerm()
	if !ok {
		return ErrNotLeader
	}
	if err := n.wait(ctx, n.raft.VerifyLeader()); err != nil {
		switch {
		case errors.Is(err, ErrShutdown), errors.Is(err, raft.ErrRaftShutdown):
			return fmt.Errorf("%w: %w", ErrShutdown, err)
		case errors.Is(err, ErrOutcomeUnknown):
			return ctx.Err()
		}
		return fmt.Errorf("%w: %w", ErrNotLeader, err)
	}
	if t, ok := n.readyTerm(); !ok || t != term {
		return ErrNotLeader
	}
	return nil
}

// TransferLeadership hands leadership to the voter with ID to, or to the most up-to-date
// voter if to is "". It returns once the transfer succeeded or failed. Raft gives one attempt
// ElectionTimeout to bring the target up to date and another for it to win: a follower that
// lags (a burst of writes, a loaded machine) misses that, so an attempt that timed out while
// this node still leads is made again, for up to transferPatience ElectionTimeouts; one after which this node no
// longer leads succeeded late (the target won after raft stopped waiting). ErrNotLeader if
// this node is not the leader; ErrUnknownServer if to is not a voter in the configuration. to
// naming this node, the leader, is a no-op: it already leads (raft would refuse it as a
// transfer to itself).
func (n *Node) TransferLeadership(to string) error {
	if n.raft.State() != raft.Leader {
		return ErrNotLeader
	}
	if to == n.cfg.ID {
		return nil
	}
	start := func() raft.Future { return n.raft.LeadershipTransfer() }
	if to != "" {
		cf := n.raft.GetConfiguration()
		if err := n.wait(context.Background(), cf); err != nil {
			return fmt.Errorf("cluster: transfer leadership: %w", err)
		}
		var addr raft.ServerAddress
		for _, s := range cf.Configuration().Servers {
			if string(s.ID) == to && s.Suffrage == raft.Voter {
				addr = s.Address
			}
		}
		if addr == "" {
			return fmt.Errorf("%w: %q is not a voter", ErrUnknownServer, to)
		}
		start = func() raft.Future { return n.raft.LeadershipTransferToServer(raft.ServerID(to), addr) }
	}
	var err error
	deadline := time.Now().Add(transferPatience * n.cfg.ElectionTimeout)
	for attempt := 1; ; attempt++ {
		if err = n.wait(context.Background(), start()); err == nil {
			return nil
		}
		if errors.Is(err, raft.ErrNotLeader) {
			return fmt.Errorf("%w: %w", ErrNotLeader, err)
		}
		if !errors.Is(err, raft.ErrLeadershipTransferInProgress) && !strings.Contains(err.Error(), "timeout") {
			break // e.g. no other voter: trying again changes nothing
		}
		if time.Now().After(deadline) {
			break
		}
		// Raft clears its transfer-in-progress flag only once the timed-out attempt's
		// replication to the target returns, and a target that won after the timeout takes
		// over within an election: look again shortly.
		time.Sleep(n.cfg.HeartbeatTimeout / 8)
		if n.raft.State() != raft.Leader {
			if _, id := n.raft.LeaderWithID(); to == "" || string(id) == to || id == "" {
				return nil // it moved; to "" asks for any other voter
			}
			return fmt.Errorf("cluster: transfer leadership to %q: %w (another node took over)", to, err)
		}
		if !errors.Is(err, raft.ErrLeadershipTransferInProgress) {
			n.log.Info("leadership transfer attempt failed; trying again", "attempt", attempt, "to", to, "err", err)
		}
	}
	return fmt.Errorf("cluster: transfer leadership to %q: %w", to, err)
}

// transferPatience is how many ElectionTimeouts TransferLeadership keeps trying while this
// node stays leader (3.2 s at the default 400 ms).
const transferPatience = 8

// Shutdown stops the node gracefully: a leader first hands leadership to another voter (so
// the cluster does not wait out an election timeout), then the node leaves gossip, Raft
// shuts down and the log store is closed. Safe to call more than once.
func (n *Node) Shutdown() error { return n.stop(true) }

// Kill stops the node as a crash would, for tests and the chaos suite: no leadership
// transfer, no gossip leave (peers notice through failed probes). Everything already
// acknowledged is on disk (fsync), so the data dir restarts like after kill -9.
func (n *Node) Kill() error { return n.stop(false) }

func (n *Node) stop(graceful bool) error {
	n.stopOnce.Do(func() {
		n.closed.Store(true)
		n.leaving.Store(graceful)
		if graceful && n.raft.State() == raft.Leader && n.otherVoters() > 0 {
			ctx, cancel := context.WithTimeout(context.Background(), 2*n.cfg.ElectionTimeout)
			err := n.wait(ctx, n.raft.LeadershipTransfer())
			cancel()
			if err != nil {
				n.log.Warn("leadership transfer before shutdown failed", "err", err)
			}
		}
		n.cancel()
		if graceful {
			// Peers learn it leaves on purpose before its Raft goes (their logs then say
			// so at INFO instead of erroring about it: peerLeftNoise).
			n.tellLeaving(500 * time.Millisecond)
			n.setMeta(func(m *nodeMeta) { m.Leaving = true })
			if err := n.ml.UpdateNode(500 * time.Millisecond); err != nil {
				n.log.Info("gossip: telling peers this node leaves", "err", err)
			}
			if err := n.ml.Leave(time.Second); err != nil {
				n.log.Warn("gossip leave failed", "err", err)
			}
		}
		var errs []error
		if err := n.ml.Shutdown(); err != nil {
			errs = append(errs, fmt.Errorf("memberlist: %w", err))
		}
		if err := n.raft.Shutdown().Error(); err != nil {
			errs = append(errs, fmt.Errorf("raft: %w", err))
		}
		if err := n.peers.Close(); err != nil {
			errs = append(errs, fmt.Errorf("raft transport: %w", err))
		}
		n.wg.Wait()
		if err := n.bolt.Close(); err != nil {
			errs = append(errs, fmt.Errorf("bolt: %w", err))
		}
		if n.walLog != nil {
			if err := n.walLog.Close(); err != nil {
				errs = append(errs, fmt.Errorf("raft wal: %w", err))
			}
		}
		n.notifyLeaderChange()
		if len(errs) > 0 {
			n.stopErr = fmt.Errorf("cluster: shutdown %s: %w", n.cfg.ID, errors.Join(errs...))
		}
		n.log.Info("node stopped", "graceful", graceful)
	})
	return n.stopErr
}

func (n *Node) otherVoters() int {
	cf := n.raft.GetConfiguration()
	if n.wait(context.Background(), cf) != nil {
		return 0
	}
	c := 0
	for _, s := range cf.Configuration().Servers {
		if s.Suffrage == raft.Voter && string(s.ID) != n.cfg.ID {
			c++
		}
	}
	return c
}

// sleepCtx waits d or until the node stops; false if it stopped.
func (n *Node) sleepCtx(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-n.ctx.Done():
		return false
	}
}

func resolveIPPort(addr string) (net.IP, int, error) {
	ta, err := net.ResolveTCPAddr("tcp", addr)
	if err != nil {
		return nil, 0, err
	}
	return ta.IP, ta.Port, nil
}
