package cluster

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
)

// nodeMeta is what a node advertises in its memberlist metadata (JSON, well under
// memberlist.MetaMaxSize; Config.Validate bounds the variable parts).
type nodeMeta struct {
	Version  int    `json:"v"`
	ID       string `json:"id"`
	Raft     string `json:"r"`
	GRPC     string `json:"g,omitempty"`
	HTTP     string `json:"h,omitempty"`
	Expect   int    `json:"e,omitempty"` // BootstrapExpect
	HasState bool   `json:"s,omitempty"` // has Raft state: part of (or was part of) a cluster
	Applied  uint64 `json:"a,omitempty"` // FSM applied index (informational: never decides membership)
	Cluster  string `json:"c,omitempty"` // cluster ID from the data dir ("" until known)
	Nonce    string `json:"n,omitempty"` // random per start without state; feeds the cluster ID at bootstrap
	// Cmd is the newest FSM command version this node applies (0: not advertised, a build
	// from before fsm command version 6). A leader asks it before replicating limits that
	// older nodes would decide differently.
	Cmd int `json:"cv,omitempty"`
	// Leaving: the node is stopping gracefully (Node.Shutdown): it says so before it leaves
	// gossip, because memberlist hands NotifyLeave the node with its State not yet set to
	// StateLeft, so peers could not tell a leave from a failure.
	Leaving bool `json:"l,omitempty"`
	// LeaveCommit binds the direct leaving message to this node: a hash of a secret token
	// drawn at start (leaveCommit), which only the leaving message reveals (leavingMsg).
	LeaveCommit string `json:"lc,omitempty"`
}

// commandVersioned is the optional ability of an FSM to say the newest command version it
// applies (fsm.FSM has it).
type commandVersioned interface{ CommandVersion() int }

// commandVersion is the FSM command version this node advertises (see nodeMeta.Cmd).
func (n *Node) commandVersion() int {
	if v := n.cfg.AdvertisedCommandVersion; v != 0 {
		return max(v, 0)
	}
	if v, ok := n.fsm.(commandVersioned); ok {
		return v.CommandVersion()
	}
	return 0
}

const metaVersion = 1

// peer is this node's view of one gossip member.
type peer struct {
	meta       nodeMeta
	gossipAddr string
	alive      bool
	left       bool      // left gracefully (vs. failed)
	since      time.Time // Clock reading at the last alive/dead transition
	leftAt     time.Time // Clock reading when it said it was leaving (zero: it did not, or came back)
}

type gossipState struct {
	mu    sync.Mutex
	peers map[string]*peer // by ID (memberlist node name)

	selfConflict atomic.Int64 // UnixNano of the last conflict about our own name

	metaMu sync.Mutex
	meta   nodeMeta
	raw    []byte

	// leaveToken is this start's secret for leavingMsg; its hash is nodeMeta.LeaveCommit.
	leaveToken []byte
	// forgedLeave rate-limits the warning about leaving messages that name another member.
	forgedLeave *logLimiter
}

func (n *Node) startGossip() error {
	ip, port, err := resolveIPPort(n.cfg.GossipAddr)
	if err != nil {
		return fmt.Errorf("cluster: GossipAddr %q: %w", n.cfg.GossipAddr, err)
	}
	n.gossip.leaveToken = make([]byte, leaveTokenSize)
	_, _ = rand.Read(n.gossip.leaveToken)
	n.gossip.forgedLeave = newLogLimiter(DefaultPeerLogInterval)
	n.setMeta(func(m *nodeMeta) {
		*m = nodeMeta{
			Version:  metaVersion,
			ID:       n.cfg.ID,
			Raft:     n.raftAddr,
			GRPC:     n.cfg.GRPCAddr,
			HTTP:     n.cfg.HTTPAddr,
			Expect:   n.cfg.BootstrapExpect,
			HasState: n.raft.LastIndex() > 0,
			Applied:  n.fsm.AppliedIndex(),
			Cluster:  n.clusterID(),
			Nonce:    n.nonce,
			Cmd:      n.commandVersion(),

			LeaveCommit: leaveCommit(n.gossip.leaveToken),
		}
	})

	mc := memberlist.DefaultLocalConfig()
	mc.Name = n.cfg.ID
	mc.BindAddr = ip.String()
	mc.BindPort = port
	// Fast failure detection for a LAN of a few nodes: a failed node is suspected within
	// ~0.5 s and declared dead ~1–3 s later. A false suspicion only matters after
	// DeadNodeTimeout, and the suspect refutes it long before.
	mc.ProbeInterval = 500 * time.Millisecond
	mc.ProbeTimeout = 250 * time.Millisecond
	mc.SuspicionMult = 2
	mc.SuspicionMaxTimeoutMult = 3
	mc.PushPullInterval = 5 * time.Second
	// A node restarting on a new address (same ID) may reclaim its name this soon after it
	// was declared dead (immediately if it left gracefully).
	mc.DeadNodeReclaimTime = time.Second
	// With a key every gossip message is encrypted and authenticated (AES-GCM) and messages
	// without it are dropped both ways: only key holders are members.
	mc.SecretKey = n.cfg.GossipSecretKey
	mc.GossipVerifyIncoming = len(n.cfg.GossipSecretKey) > 0
	mc.GossipVerifyOutgoing = len(n.cfg.GossipSecretKey) > 0
	mc.Logger = newStdLogger(n.log, "memberlist", n.cfg.LibraryLogLevel, &n.leaving)
	mc.Delegate = gossipDelegate{n}
	mc.Events = gossipEvents{n}
	mc.Conflict = gossipEvents{n}
	ml, err := memberlist.Create(mc)
	if err != nil {
		return fmt.Errorf("cluster: start gossip on %q: %w", n.cfg.GossipAddr, err)
	}
	n.ml = ml
	local := ml.LocalNode()
	n.gossipAddr = net.JoinHostPort(local.Addr.String(), strconv.Itoa(int(local.Port)))
	return nil
}

func (n *Node) setMeta(update func(*nodeMeta)) (changed bool) {
	g := &n.gossip
	g.metaMu.Lock()
	defer g.metaMu.Unlock()
	m := g.meta
	update(&m)
	if m == g.meta && g.raw != nil {
		return false
	}
	raw, err := json.Marshal(m)
	if err != nil {
		panic(err) // plain struct; cannot fail
	}
	g.meta, g.raw = m, raw
	return true
}

// metaLoop re-advertises the applied index and whether this node has Raft state, and
// saves the other members' gossip addresses for the next start.
func (n *Node) metaLoop() {
	var (
		saved      []string
		lastRejoin time.Time
	)
	for n.sleepCtx(n.cfg.MetaInterval) {
		// Restarted on a new address: peers ignore our alive messages until they declared
		// the old address dead (DeadNodeReclaimTime later); re-join so they hear us then
		// rather than at the next push-pull.
		if c := n.gossip.selfConflict.Load(); c != 0 && time.Since(time.Unix(0, c)) < 5*time.Second &&
			time.Since(lastRejoin) >= time.Second {
			lastRejoin = time.Now()
			if addrs := n.alivePeerAddrs(); len(addrs) > 0 {
				_, _ = n.ml.Join(addrs)
			}
		}
		if addrs := n.alivePeerAddrs(); len(addrs) > 0 && !slices.Equal(addrs, saved) {
			if err := saveGossipPeers(n.cfg.DataDir, addrs); err != nil {
				n.log.Warn("saving gossip peers", "err", err)
			}
			saved = addrs
		}
		n.learnClusterID()
		changed := n.setMeta(func(m *nodeMeta) {
			m.Applied = n.fsm.AppliedIndex()
			m.HasState = m.HasState || n.raft.LastIndex() > 0
			m.Cluster = n.clusterID()
		})
		if changed {
			if err := n.ml.UpdateNode(n.cfg.MetaInterval); err != nil && n.ctx.Err() == nil {
				n.log.Debug("gossip meta update", "err", err)
			}
		}
	}
}

// joinAddrs is Config.Join plus the gossip addresses saved at the last run, minus our own.
func (n *Node) joinAddrs() []string {
	var addrs []string
	for _, a := range append(slices.Clone(n.cfg.Join), loadGossipPeers(n.cfg.DataDir)...) {
		if a != n.gossipAddr && a != n.cfg.GossipAddr && !slices.Contains(addrs, a) {
			addrs = append(addrs, a)
		}
	}
	return addrs
}

// joinLoop joins the given gossip addresses, retrying with backoff until one answers.
func (n *Node) joinLoop(addrs []string) {
	backoff := n.cfg.JoinRetryMin
	for attempt := 1; ; attempt++ {
		k, err := n.ml.Join(addrs)
		if k > 0 {
			n.log.Info("joined gossip", "contacted", k, "attempt", attempt)
			return
		}
		lvl := n.log.Debug
		if attempt%10 == 0 {
			lvl = n.log.Warn
		}
		lvl("gossip join failed; retrying", "addrs", addrs, "attempt", attempt, "err", err, "backoff", backoff)
		if !n.sleepCtx(backoff) {
			return
		}
		backoff = min(2*backoff, n.cfg.JoinRetryMax)
	}
}

// bootstrapHold, if set (tests only), delays a node's first bootstrap check by what it returns
// for the node's ID.
var bootstrapHold atomic.Pointer[func(id string) time.Duration]

// bootstrapLoop bootstraps a new cluster once exactly BootstrapExpect gossip members
// without Raft state are visible. It gives up as soon as any member has state (an existing
// cluster: its leader will add this node) or this node got state.
//
// Bootstrap trusts gossip: the members it counts (and their advertised Raft addresses) are
// whoever holds the gossip key. That is the only moment gossip decides voters, and only for a
// brand-new cluster; afterwards a member becomes a voter only once the leader has replicated
// to it over mutual TLS (membership.go). The cluster ID is derived from the same view by
// every bootstrapping node: a hash of the sorted member IDs, Raft addresses and the random
// nonces they advertised.
func (n *Node) bootstrapLoop() {
	warned := false
	// A bootstrap that cannot write its log (a full disk) fails every 200 ms until the disk
	// has room: its warning is repeated at most every bootstrapRetryLogInterval, with a count.
	retryLog := newLogLimiter(bootstrapRetryLogInterval)
	if h := bootstrapHold.Load(); h != nil {
		if !n.sleepCtx((*h)(n.cfg.ID)) {
			return
		}
	}
	for {
		select {
		case <-n.ctx.Done():
			return
		case <-n.bootstrapCh:
		case <-time.After(200 * time.Millisecond):
		}
		if n.raft.LastIndex() > 0 {
			return
		}
		// Read members from our own peer map: memberlist.Members returns nodes it keeps
		// mutating, so reading their Meta races.
		peers := n.peersSnapshot()
		ids := make([]string, 0, len(peers))
		for id, p := range peers {
			if p.alive {
				ids = append(ids, id)
			}
		}
		slices.Sort(ids)
		var servers []raft.Server
		existing, existingCluster := "", ""
		for _, id := range ids {
			meta := peers[id].meta
			if meta.Raft == "" {
				continue
			}
			if meta.HasState && id != n.cfg.ID && existing == "" {
				existing, existingCluster = id, meta.Cluster
			}
			if meta.Expect != n.cfg.BootstrapExpect {
				if !warned {
					n.log.Warn("gossip member has a different bootstrap-expect; not bootstrapping",
						"member", id, "theirs", meta.Expect, "ours", n.cfg.BootstrapExpect)
					warned = true
				}
				servers = nil
				break
			}
			servers = append(servers, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(id), Address: raft.ServerAddress(meta.Raft)})
		}
		if existing != "" {
			// A member has Raft state. If it is the cluster this very member set bootstraps
			// (its cluster ID is the one this node derives from the same members and their
			// nonces: a member of the set saw all of them first and bootstrapped), this node
			// is one of its voters and bootstraps the same configuration: it must vote, or
			// a fresh cluster whose first node bootstrapped a moment early could never elect
			// a leader (the others, with no state, refuse votes while recovering). Otherwise
			// it is an existing cluster, whose leader will add this node.
			if len(servers) != n.cfg.BootstrapExpect || existingCluster == "" || bootstrapClusterID(servers, peers) != existingCluster {
				n.log.Info("existing cluster seen in gossip; not bootstrapping", "member", existing)
				return
			}
			n.log.Info("a member bootstrapped this member set first; bootstrapping the same configuration", "member", existing, "cluster_id", existingCluster)
		}
		if len(servers) != n.cfg.BootstrapExpect {
			if len(servers) > n.cfg.BootstrapExpect && !warned {
				n.log.Warn("more gossip members than bootstrap-expect; not bootstrapping",
					"members", len(servers), "expect", n.cfg.BootstrapExpect)
				warned = true
			}
			continue
		}
		err := n.wait(n.ctx, n.raft.BootstrapCluster(raft.Configuration{Servers: servers}))
		if err != nil {
			failed := !errors.Is(err, raft.ErrCantBootstrap)
			if failed {
				if ok, suppressed, over := retryLog.allow("bootstrap failed"); ok {
					args := []any{"err", err}
					if suppressed > 0 {
						args = append(args, "repeated", suppressed, "over", over.Round(time.Second))
					}
					n.log.Warn("bootstrap failed; retrying", args...)
				}
			}
			// A failed attempt (the log could not be written: a full disk), now or in an
			// earlier run, left the term it recorded: undoFailedBootstrap clears it and the
			// next attempt starts clean. Otherwise ErrCantBootstrap means this node has state.
			if n.undoFailedBootstrap(retryLog) || failed {
				continue
			}
		}
		cid := bootstrapClusterID(servers, peers)
		if err := n.setClusterID(cid); err != nil {
			n.log.Warn("recording the cluster ID failed", "err", err)
		}
		n.rec.finish("bootstrapped a new cluster")
		n.log.Info("bootstrapped cluster", "servers", fmt.Sprint(servers), "cluster_id", cid)
		n.setMeta(func(m *nodeMeta) { m.HasState, m.Cluster = true, n.clusterID() })
		_ = n.ml.UpdateNode(n.cfg.MetaInterval)
		return
	}
}

func (n *Node) triggerReconcile() {
	select {
	case n.reconcileCh <- struct{}{}:
	default:
	}
}

func (n *Node) peer(id string) (peer, bool) {
	n.gossip.mu.Lock()
	defer n.gossip.mu.Unlock()
	p, ok := n.gossip.peers[id]
	if !ok {
		return peer{}, false
	}
	return *p, true
}

func (n *Node) peersSnapshot() map[string]peer {
	n.gossip.mu.Lock()
	defer n.gossip.mu.Unlock()
	out := make(map[string]peer, len(n.gossip.peers))
	for id, p := range n.gossip.peers {
		out[id] = *p
	}
	return out
}

// gossipEvents records membership changes. memberlist calls it with its own locks held,
// so it only updates the peer map and signals.
type gossipEvents struct{ n *Node }

func (e gossipEvents) NotifyJoin(m *memberlist.Node)   { e.n.onGossip(m, true) }
func (e gossipEvents) NotifyLeave(m *memberlist.Node)  { e.n.onGossip(m, false) }
func (e gossipEvents) NotifyUpdate(m *memberlist.Node) { e.n.onGossip(m, true) }

// NotifyConflict: another address claims a member's name. About ourselves it means we
// restarted on a new address and peers still hold the old one.
func (e gossipEvents) NotifyConflict(existing, other *memberlist.Node) {
	if existing.Name == e.n.cfg.ID {
		e.n.gossip.selfConflict.Store(time.Now().UnixNano())
	}
}

func (n *Node) onGossip(m *memberlist.Node, alive bool) {
	var meta nodeMeta
	if err := json.Unmarshal(m.Meta, &meta); err != nil {
		n.log.Warn("ignoring gossip member with unreadable metadata", "member", m.Name, "err", err)
		return
	}
	now := n.clock.Now()
	n.gossip.mu.Lock()
	p, ok := n.gossip.peers[m.Name]
	if !ok {
		p = &peer{}
		n.gossip.peers[m.Name] = p
	}
	if !ok || p.alive != alive {
		p.since = now
	}
	p.meta = meta
	p.gossipAddr = net.JoinHostPort(m.Addr.String(), strconv.Itoa(int(m.Port)))
	p.alive = alive
	if alive && !meta.Leaving && (!ok || p.since == now) {
		p.leftAt = time.Time{} // (back) in gossip: a start, not a stale update after leavingMsg
	}
	// Left: it said so directly (leavingMsg, leftAt), in its metadata, or memberlist knows
	// (it does not tell NotifyLeave today, and the metadata update may arrive after the leave).
	p.left = !alive && (m.State == memberlist.StateLeft || meta.Leaving || !p.leftAt.IsZero())
	if (meta.Leaving || p.left) && p.leftAt.IsZero() {
		p.leftAt = now
	}
	n.gossip.mu.Unlock()
	if !ok || !alive {
		n.log.Info("gossip member", "member", m.Name, "alive", alive, "left", p.left, "addr", p.gossipAddr)
	}
	n.triggerReconcile()
	select {
	case n.bootstrapCh <- struct{}{}:
	default:
	}
}

// gossipDelegate supplies this node's metadata; no user messages or state are exchanged.
type gossipDelegate struct{ n *Node }

func (d gossipDelegate) NodeMeta(limit int) []byte {
	d.n.gossip.metaMu.Lock()
	defer d.n.gossip.metaMu.Unlock()
	if len(d.n.gossip.raw) > limit {
		d.n.log.Error("gossip metadata too large; advertising nothing", "size", len(d.n.gossip.raw), "limit", limit)
		return nil
	}
	return d.n.gossip.raw
}

// NotifyMsg takes leavingMsg: the sender stops gracefully (Node.tellLeaving).
//
// memberlist does not say who sent a user message, and every member holds the gossip key,
// so the node ID in the message proves nothing: any member (anyone, without a key) could
// name another node, whose raft failures peers would then log at INFO for leftQuietFor and
// which `quotad members` would show left, not unreachable, after a crash. The message is
// accepted only with the token whose hash the named node advertises in its own metadata
// (nodeMeta.LeaveCommit): only that node, in this start, knows it before it leaves. A
// message naming a member that it cannot come from is ignored with a warning naming that
// member.
func (d gossipDelegate) NotifyMsg(b []byte) {
	n := d.n
	if id, ok := bytes.CutPrefix(b, []byte(leavingMsgV1)); ok {
		// A build from before the token. Its node still advertises Leaving in its metadata,
		// which marks it left a moment later.
		n.ignoreLeaving(string(id), true)
		return
	}
	rest, ok := bytes.CutPrefix(b, []byte(leavingMsg))
	if !ok {
		return
	}
	idb, token, ok := bytes.Cut(rest, []byte{0})
	id := string(idb)
	if !ok || len(id) == 0 {
		n.ignoreLeaving(id, false)
		return
	}
	now := n.clock.Now()
	n.gossip.mu.Lock()
	p := n.gossip.peers[id]
	genuine := p != nil && p.meta.LeaveCommit != "" &&
		subtle.ConstantTimeCompare([]byte(leaveCommit(token)), []byte(p.meta.LeaveCommit)) == 1
	if genuine && p.leftAt.IsZero() {
		p.leftAt = now
	}
	n.gossip.mu.Unlock()
	if !genuine {
		n.ignoreLeaving(id, false)
		return
	}
	n.log.Info("gossip member leaving", "member", id)
}

// ignoreLeaving logs a leaving message that is not taken: at WARN (rate-limited per named
// member and reason) when the member it names cannot have sent it — its token is wrong, or it
// is in the old form and the member advertises a token (a build that never sends that form);
// at INFO when it is the old form from a member of an older build (unverifiable, so not taken
// either); at DEBUG when it names no known member.
func (n *Node) ignoreLeaving(id string, oldForm bool) {
	p, ok := n.peer(id)
	if !ok || id == n.cfg.ID {
		n.log.Debug("ignoring a gossip leaving message naming no known member", "claimed_member", id)
		return
	}
	why := "its token is not the one the member advertises"
	if oldForm {
		if p.meta.LeaveCommit == "" {
			n.log.Info("ignoring an unverifiable gossip leaving message from an older build; its metadata will say it leaves", "member", id)
			return
		}
		why = "it is in the old form, which the member's build never sends"
	}
	allow, suppressed, over := n.gossip.forgedLeave.allow("forged leaving\x00" + why + "\x00" + id)
	if !allow {
		return
	}
	args := []any{"claimed_member", id, "why", why}
	if suppressed > 0 {
		args = append(args, "repeated", suppressed, "over", over.Round(time.Second))
	}
	n.log.Warn("ignoring a gossip leaving message that does not come from the member it names (another member or a holder of the gossip key sent it)", args...)
}

// leavingMsg, then the node's ID, a NUL byte and its leave token (gossipState.leaveToken),
// is the gossip user message a node stopping gracefully sends each peer directly (TCP)
// before its Raft stops: a metadata update and the leave itself reach peers only as fast as
// gossip spreads them, often after their raft met the closed port. leavingMsgV1, then the
// ID alone, is what builds before the token sent: never taken, anyone could send it.
const (
	leavingMsg   = "quotad-leaving/2:"
	leavingMsgV1 = "quotad-leaving:"
)

// leaveTokenSize is the length of a node's leave token in bytes.
const leaveTokenSize = 32

// leaveCommit is what a node advertises for its leave token (nodeMeta.LeaveCommit): the hex of
// the first 16 bytes of its SHA-256.
func leaveCommit(token []byte) string {
	h := sha256.Sum256(token)
	return hex.EncodeToString(h[:16])
}

// leavingPayload is leavingMsg for node id with token.
func leavingPayload(id string, token []byte) []byte {
	return append([]byte(leavingMsg+id+"\x00"), token...)
}

// tellLeaving sends leavingMsg to every live peer, in parallel, waiting at most d.
func (n *Node) tellLeaving(d time.Duration) {
	msg := leavingPayload(n.cfg.ID, n.gossip.leaveToken)
	var wg sync.WaitGroup
	for _, m := range n.ml.Members() {
		if m.Name == n.cfg.ID {
			continue
		}
		wg.Go(func() {
			if err := n.ml.SendReliable(m, msg); err != nil {
				n.log.Info("gossip: telling a peer this node leaves", "member", m.Name, "err", err)
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
	}
}
func (gossipDelegate) GetBroadcasts(overhead, limit int) [][]byte { return nil }
func (gossipDelegate) LocalState(join bool) []byte                { return nil }
func (gossipDelegate) MergeRemoteState(buf []byte, join bool)     {}

// leftQuietFor is how long after a peer left gossip gracefully raft's failures to reach it
// are logged at INFO (peerLeftNoise): long enough for a restart or an upgrade; a node that
// left and stays away longer, still in the configuration, is worth errors again.
const leftQuietFor = 5 * time.Minute

// peerLeftRecently reports whether the peer a raft log record names (args: "peer" as a
// raft.Server or raft.ServerAddress, or "server-id") said it was leaving (nodeMeta.Leaving)
// less than leftQuietFor ago and has not come back.
func (n *Node) peerLeftRecently(args []any) bool {
	var addr, id string
	for i := 0; i+1 < len(args); i += 2 {
		k, _ := args[i].(string)
		if !peerLogKeys[k] {
			continue
		}
		switch v := args[i+1].(type) {
		case raft.Server:
			addr, id = string(v.Address), string(v.ID)
		case raft.ServerAddress:
			addr = string(v)
		case raft.ServerID:
			id = string(v)
		case string:
			addr, id = v, v
		}
		break
	}
	if addr == "" && id == "" {
		return false
	}
	now := n.clock.Now()
	n.gossip.mu.Lock()
	defer n.gossip.mu.Unlock()
	for name, p := range n.gossip.peers {
		if p.leftAt.IsZero() || now.Sub(p.leftAt) > leftQuietFor {
			continue
		}
		if (id != "" && (name == id || p.meta.ID == id)) || (addr != "" && p.meta.Raft == addr) {
			return true
		}
	}
	return false
}

// keyCurrentTerm is where raft keeps the current term in the stable store (raft's own
// unexported key).
var keyCurrentTerm = []byte("CurrentTerm")

// bootstrapRetryLogInterval is the least time between two warnings of a bootstrap that keeps
// failing.
const bootstrapRetryLogInterval = time.Minute

// keyLastVoteTerm is where raft keeps the term of its last vote (raft's own unexported key).
var keyLastVoteTerm = []byte("LastVoteTerm")

// undoBootstrapCheck, if set (tests only), runs in undoFailedBootstrap between reading term 1
// and clearing it.
var undoBootstrapCheck atomic.Pointer[func(n *Node)]

// undoFailedBootstrap clears what a failed BootstrapCluster left behind and reports whether
// it did. raft's BootstrapCluster records term 1 in the stable store before it writes the
// configuration entry; when that write fails (no space for the WAL's preallocated segment)
// term 1 stays, and every later attempt is refused as "has existing state" although the node
// has no log and no configuration: it would never bootstrap, not even after a restart with the
// disk fixed. Term 1 with an empty log is only ever that: a node that bootstrapped
// has entry 1, and elections start at term 2. A higher term is left alone (votes, a leader).
//
// raft runs meanwhile: a leader's message can make it record a higher term at any moment.
// The check and the clear hold the stable store's write lock (guardedStable), so that term
// is never overwritten: read before it, it is written after the clear; read after, it is kept.
func (n *Node) undoFailedBootstrap(logs *logLimiter) bool {
	if n.bolt == nil || n.stable == nil || n.raft.LastIndex() > 0 {
		return false
	}
	n.stable.mu.Lock()
	defer n.stable.mu.Unlock()
	term, err := n.bolt.GetUint64(keyCurrentTerm)
	if err != nil || term != 1 {
		return false
	}
	if vote, err := n.bolt.GetUint64(keyLastVoteTerm); (err != nil && !errors.Is(err, raftboltdb.ErrKeyNotFound)) || vote != 0 {
		return false // it voted (in term 2 or later: no election has term 1)
	}
	if last, err := n.logs.LastIndex(); err != nil || last > 0 || n.raft.LastIndex() > 0 {
		return false
	}
	if h := undoBootstrapCheck.Load(); h != nil {
		(*h)(n)
	}
	if err := n.bolt.SetUint64(keyCurrentTerm, 0); err != nil {
		n.log.Warn("clearing a failed bootstrap's term failed; retrying", "err", err)
		return true
	}
	if ok, _, _ := logs.allow("bootstrap undone"); ok {
		n.log.Info("a failed bootstrap left term 1 without a log entry (the log could not be written: disk full?); cleared it, bootstrapping again")
	}
	return true
}

// guardedStable is raft's stable store with a lock around its writes, which
// undoFailedBootstrap holds to check and clear a term without racing raft's own writes.
type guardedStable struct {
	raft.StableStore
	mu sync.Mutex
}

func (g *guardedStable) Set(k, v []byte) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.StableStore.Set(k, v)
}

func (g *guardedStable) SetUint64(k []byte, v uint64) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.StableStore.SetUint64(k, v)
}
