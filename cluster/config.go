package cluster

import (
	"crypto/tls"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/hashicorp/raft"
)

// Clock is the node's time source. It is one method so that tests and the chaos build can skew,
// jump or speed up a single node's clock. The node only ever subtracts two readings of it
// (Time.Sub), so a Clock that returns times carrying Go's monotonic reading (as time.Now does)
// makes the leader's timestamps immune to wall-clock steps. Implementations must be safe for
// concurrent use.
type Clock interface {
	Now() time.Time
}

// SystemClock is the Clock backed by time.Now (monotonic).
type SystemClock struct{}

// Now returns time.Now().
func (SystemClock) Now() time.Time { return time.Now() }

// Config configures one Node. Obtain one from DefaultConfig and set at least ID, DataDir,
// RaftAddr and GossipAddr. No field is reloadable: a Node copies its Config at NewNode.
type Config struct {
	// ID is this node's Raft server ID and memberlist node name. It must be unique in the
	// cluster and stable across restarts: the data directory belongs to it. A node may come
	// back with the same ID on new addresses; the leader then updates its Raft address.
	ID string

	// DataDir holds the Raft log and stable store (with the wal backend the wal/ directory
	// and stable.db; with boltdb raft.db, a BoltDB file fsynced on every write; see LogStore)
	// and the snapshots directory. Created if missing.
	DataDir string

	// RaftAddr is the host:port the Raft TCP transport listens on and advertises to peers.
	// It must be an address peers can dial (not 0.0.0.0). Port 0 picks a free port; read
	// the actual one from Node.RaftAddr.
	RaftAddr string

	// GossipAddr is the host:port memberlist binds (TCP and UDP) and advertises. Port 0
	// picks a free port; read the actual one from Node.GossipAddr.
	GossipAddr string

	// AdvertisedCommandVersion, if above 0, is the FSM command version this node advertises
	// in gossip instead of its FSM's own (Member.CommandVersion); below 0, it advertises none,
	// as builds before command version 6 do. Only for tests that stand in for an older build
	// in a mixed-version cluster; never set it in production.
	AdvertisedCommandVersion int

	// GRPCAddr and HTTPAddr are only advertised to other nodes through gossip, so that any
	// node can tell clients where the leader's API is. Either may be empty.
	GRPCAddr string
	HTTPAddr string

	// BootstrapExpect is the number of nodes that form a brand-new cluster. A node without
	// Raft state that sees exactly this many gossip members, none of which has Raft state,
	// bootstraps Raft with all of them as voters (sorted by ID, so every one of them
	// computes the same configuration). Start exactly that many nodes with the same value.
	// 0 means never bootstrap: the node waits to be added by an existing cluster's leader.
	// Ignored when the node already has Raft state.
	BootstrapExpect int

	// Join lists gossip addresses (host:port) of other nodes. The node joins them at start
	// and retries with backoff (JoinRetryMin doubling to JoinRetryMax) until one answers or
	// the node shuts down. Empty for the first node of a cluster.
	Join []string

	// JoinRetryMin and JoinRetryMax bound the backoff between join attempts.
	JoinRetryMin time.Duration
	JoinRetryMax time.Duration

	// MinVoters is the number of voters the leader never goes below when it removes dead
	// nodes. With MinVoters 3, a 3-voter cluster keeps a dead voter in its configuration
	// (and needs the other two for quorum) until it comes back or an operator removes it.
	MinVoters int

	// DeadNodeTimeout is how long gossip must report a node dead or left before the leader
	// removes it from the Raft configuration (subject to MinVoters). A removed node that
	// comes back is re-added as a non-voter and promoted again.
	DeadNodeTimeout time.Duration

	// RejoinDelay is how long the leader waits before adding back a server it removed. Raft
	// stops a removed server's replication asynchronously; re-adding the same ID at once can
	// leave an old stream (e.g. a stale snapshot install) racing the new one, which made a
	// rejoining follower panic ("log not found") in the chaos suite. It must exceed the
	// transport's RPC timeout (10 s).
	RejoinDelay time.Duration

	// ReconcileInterval is how often the leader compares gossip membership with the Raft
	// configuration (add, promote, re-address, remove). Gossip events also trigger it.
	ReconcileInterval time.Duration

	// PromoteMaxLag and PromoteStableFor decide when a non-voter is caught up, from the
	// leader's own observation of replication (never from what the node advertises): the
	// highest index the leader has itself replicated to it (an acknowledged AppendEntries or
	// InstallSnapshot over the authenticated transport) must be within PromoteMaxLag entries
	// of the leader's last index, with the node answering, continuously for PromoteStableFor.
	PromoteMaxLag    uint64
	PromoteStableFor time.Duration

	// MetaInterval is how often a node re-advertises its applied index through gossip when
	// it changed. Members().AppliedIndex of other nodes is at most about this stale.
	MetaInterval time.Duration

	// TickInterval: while leader, if no entry was applied for this long, the node applies a
	// tick entry (FSM.EncodeTick at Now and Node.CommandVersion) so FSM time advances, leases
	// expire and buckets refill without client traffic.
	TickInterval time.Duration

	// HeartbeatTimeout, ElectionTimeout, LeaderLeaseTimeout and CommitTimeout are passed to
	// hashicorp/raft (see raft.Config). A follower that hears nothing from the leader for a
	// random time in [HeartbeatTimeout, 2*HeartbeatTimeout] starts an election, so failover
	// after a crash takes about that long. LeaderLeaseTimeout must be <= HeartbeatTimeout and
	// ElectionTimeout >= HeartbeatTimeout. DefaultConfig explains the chosen values.
	HeartbeatTimeout   time.Duration
	ElectionTimeout    time.Duration
	LeaderLeaseTimeout time.Duration
	CommitTimeout      time.Duration

	// MaxAppendEntries caps entries per AppendEntries RPC and per FSM.ApplyBatch call
	// (raft allows at most 1024). quotad's entries are large (group commit puts up to 1024
	// admissions, ~90 KB, in one), so a caught-up follower gets 1–3 entries per RPC and the
	// cap only matters for catching up, where it bounds one RPC to ~MaxAppendEntries × 90 KB.
	MaxAppendEntries int

	// LogCacheSize is the number of recent log entries kept in memory in front of BoltDB.
	// A caught-up follower needs the last few; entries of up to ~90 KB make each cached
	// entry cost memory, so it is sized to hold a couple of seconds of entries at full load
	// rather than a fixed multiple of MaxAppendEntries.
	LogCacheSize int

	// SnapshotInterval, SnapshotThreshold and TrailingLogs are passed to raft: every
	// SnapshotInterval (randomized) raft snapshots if at least SnapshotThreshold entries were
	// written since the last snapshot, and keeps TrailingLogs entries after it so that a
	// slightly lagging follower can catch up from the log instead of a snapshot.
	SnapshotInterval  time.Duration
	SnapshotThreshold uint64
	TrailingLogs      uint64

	// SnapshotRetain is the number of snapshots kept on disk.
	SnapshotRetain int

	// GossipSecretKey encrypts and authenticates gossip (AES-GCM, 16, 24 or 32 bytes; `quotad
	// keygen`). All nodes must use the same key. Required unless Insecure: without it anyone who
	// can reach the gossip port can join as a member, and gossip decides who is added to (and,
	// at bootstrap, who forms) the cluster.
	GossipSecretKey []byte

	// PeerTLS secures the Raft transport in both directions (auth.PeerTLSConfig: mutual TLS
	// against the cluster CA, the peer's certificate must carry the server SAN). Connections
	// finish the handshake (within PeerHandshakeTimeout) before Raft reads a byte of them, so
	// a peer without a server certificate never reaches Raft. Required unless Insecure.
	PeerTLS *tls.Config

	// PeerHandshakeTimeout bounds an incoming Raft connection's TLS handshake.
	PeerHandshakeTimeout time.Duration

	// Insecure allows running without PeerTLS (plaintext Raft that accepts anyone who can
	// reach the port) and without GossipSecretKey. For tests and throwaway local clusters
	// only: it gives up the peer trust boundary.
	Insecure bool

	// WrapStreamLayer, if set, wraps the Raft transport's stream layer (the chaos build uses
	// it to partition peers). Nil in production.
	WrapStreamLayer func(raft.StreamLayer) raft.StreamLayer

	// WrapLogStore, if set, wraps the durable Raft log store under the log cache (the chaos
	// build uses it to slow the disk). Nil in production.
	WrapLogStore func(raft.LogStore) raft.LogStore

	// LogStore is the Raft log's storage: LogStoreBoltDB ("boltdb": raft.db, a BoltDB B-tree,
	// two fdatasyncs per append) or LogStoreWAL ("wal": package wal's segment files in wal/,
	// one write and one fdatasync per append, term and vote in stable.db). Both fsync every
	// append. A data dir keeps the backend it was created with: LogStoreAuto (the default)
	// opens it with that one and gives a data dir without a Raft log LogStoreWAL; an explicit
	// backend that is not the data dir's is refused by NewNode (ErrLogStoreMismatch), which
	// says how to replace the node instead. Node.LogStore reports the one in use. See
	// logstore.go.
	LogStore string

	// Clock is the node's time source; nil means SystemClock.
	Clock Clock

	// Logger receives the node's logs; nil means slog.Default(). Raft's and memberlist's own
	// logs are routed to it at LibraryLogLevel and above.
	Logger *slog.Logger

	// LibraryLogLevel filters hashicorp/raft and memberlist logs (they are chatty at INFO).
	LibraryLogLevel slog.Level
}

// DefaultConfig returns a Config that works on a LAN or loopback, without ID, DataDir and
// addresses.
//
// Raft timeouts: HeartbeatTimeout 400ms, ElectionTimeout 400ms, LeaderLeaseTimeout 300ms.
// A follower checks for leader contact on a timer drawn from [T, 2T), so after a leader
// crash it notices between T and 3T later (the first of two followers usually sooner); the
// pre-vote and vote rounds then take milliseconds. Measured with TestFailoverTimes (kill of
// the leader until a new one has established its clock, 3 nodes on loopback, 2 cores):
// T = 1s: median 1.7 s, p90 2.6 s; T = 600ms: median 1.5 s, max 1.95 s; T = 500ms:
// median 1.0–1.1 s, p90 1.5–1.8 s, max 1.7–2.06 s over 20–25 trials; T = 400ms: median
// 0.75 s, p90 0.98 s, max 1.02 s over 15 trials. The leader heartbeats every T/10 on a path
// that does not wait for fsync, so a spurious election needs T of silence: `make bench-soak`
// (10 minutes alternating load and idle, 3.9M decisions) saw none at 400ms, while 300ms saw
// one on a machine oversubscribed by other work. Run TestFailoverTimes and bench-soak before
// changing these. LeaderLeaseTimeout makes a leader cut off from its quorum step down (and stop
// stamping time) before a new leader can be elected.
func DefaultConfig() Config {
	return Config{
		BootstrapExpect:    0,
		JoinRetryMin:       100 * time.Millisecond,
		JoinRetryMax:       5 * time.Second,
		MinVoters:          3,
		DeadNodeTimeout:    60 * time.Second,
		RejoinDelay:        15 * time.Second,
		ReconcileInterval:  time.Second,
		PromoteMaxLag:      512,
		PromoteStableFor:   2 * time.Second,
		MetaInterval:       500 * time.Millisecond,
		TickInterval:       500 * time.Millisecond,
		HeartbeatTimeout:   400 * time.Millisecond,
		ElectionTimeout:    400 * time.Millisecond,
		LeaderLeaseTimeout: 300 * time.Millisecond,
		CommitTimeout:      50 * time.Millisecond,
		MaxAppendEntries:   128,
		LogCacheSize:       256,
		SnapshotInterval:   30 * time.Second,
		SnapshotThreshold:  16384,
		TrailingLogs:       2048,
		SnapshotRetain:     2,
		LibraryLogLevel:    slog.LevelWarn,

		PeerHandshakeTimeout: 5 * time.Second,
		LogStore:             LogStoreAuto,
	}
}

// Validate reports the first problem with c, quoting the offending value.
func (c *Config) Validate() error {
	if c.ID == "" {
		return fmt.Errorf("cluster: ID is empty: every node needs a unique, stable ID")
	}
	if len(c.ID) > 128 {
		return fmt.Errorf("cluster: ID %q is %d bytes; at most 128 allowed", c.ID, len(c.ID))
	}
	if c.DataDir == "" {
		return fmt.Errorf("cluster: DataDir is empty")
	}
	for _, a := range []struct{ name, addr string }{{"RaftAddr", c.RaftAddr}, {"GossipAddr", c.GossipAddr}} {
		if err := validateHostPort(a.name, a.addr, false); err != nil {
			return err
		}
	}
	for _, a := range []struct{ name, addr string }{{"GRPCAddr", c.GRPCAddr}, {"HTTPAddr", c.HTTPAddr}} {
		if err := validateHostPort(a.name, a.addr, true); err != nil {
			return err
		}
	}
	for i, j := range c.Join {
		if err := validateHostPort(fmt.Sprintf("Join[%d]", i), j, false); err != nil {
			return err
		}
	}
	if c.BootstrapExpect < 0 {
		return fmt.Errorf("cluster: BootstrapExpect %d is negative", c.BootstrapExpect)
	}
	if c.MinVoters < 1 {
		return fmt.Errorf("cluster: MinVoters %d must be at least 1", c.MinVoters)
	}
	positive := []struct {
		name string
		d    time.Duration
	}{
		{"JoinRetryMin", c.JoinRetryMin}, {"JoinRetryMax", c.JoinRetryMax},
		{"DeadNodeTimeout", c.DeadNodeTimeout}, {"ReconcileInterval", c.ReconcileInterval},
		{"PromoteStableFor", c.PromoteStableFor}, {"MetaInterval", c.MetaInterval},
		{"TickInterval", c.TickInterval}, {"HeartbeatTimeout", c.HeartbeatTimeout},
		{"ElectionTimeout", c.ElectionTimeout}, {"LeaderLeaseTimeout", c.LeaderLeaseTimeout},
		{"CommitTimeout", c.CommitTimeout}, {"SnapshotInterval", c.SnapshotInterval},
		{"PeerHandshakeTimeout", c.PeerHandshakeTimeout},
	}
	for _, p := range positive {
		if p.d <= 0 {
			return fmt.Errorf("cluster: %s %s must be positive", p.name, p.d)
		}
	}
	if c.JoinRetryMax < c.JoinRetryMin {
		return fmt.Errorf("cluster: JoinRetryMax %s is below JoinRetryMin %s", c.JoinRetryMax, c.JoinRetryMin)
	}
	if c.HeartbeatTimeout < 5*time.Millisecond {
		return fmt.Errorf("cluster: HeartbeatTimeout %s is below 5ms", c.HeartbeatTimeout)
	}
	if c.ElectionTimeout < c.HeartbeatTimeout {
		return fmt.Errorf("cluster: ElectionTimeout %s must be >= HeartbeatTimeout %s", c.ElectionTimeout, c.HeartbeatTimeout)
	}
	if c.LeaderLeaseTimeout > c.HeartbeatTimeout {
		return fmt.Errorf("cluster: LeaderLeaseTimeout %s must be <= HeartbeatTimeout %s", c.LeaderLeaseTimeout, c.HeartbeatTimeout)
	}
	if c.MaxAppendEntries < 1 || c.MaxAppendEntries > 1024 {
		return fmt.Errorf("cluster: MaxAppendEntries %d must be in [1, 1024]", c.MaxAppendEntries)
	}
	if c.LogCacheSize < 1 {
		return fmt.Errorf("cluster: LogCacheSize %d must be positive", c.LogCacheSize)
	}
	if c.SnapshotRetain < 1 {
		return fmt.Errorf("cluster: SnapshotRetain %d must be at least 1", c.SnapshotRetain)
	}
	if err := validateLogStore(c.LogStore); err != nil {
		return err
	}
	if k := len(c.GossipSecretKey); k != 0 && k != 16 && k != 24 && k != 32 {
		return fmt.Errorf("cluster: GossipSecretKey is %d bytes; it must be 16, 24 or 32", k)
	}
	if !c.Insecure {
		if c.PeerTLS == nil {
			return fmt.Errorf("cluster: Raft peers need TLS: make a CA once with `quotad tls ca create`, a server certificate per node with `quotad tls cert create --server`, and pass --tls-cert, --tls-key and --tls-ca; or run with --insecure (plaintext, anyone who reaches the Raft port can write the log)")
		}
		if len(c.GossipSecretKey) == 0 {
			return fmt.Errorf("cluster: gossip needs a key: make one with `quotad keygen` and pass it with --gossip-key-file (or $QUOTAD_GOSSIP_KEY); or run with --insecure (anyone who reaches the gossip port can join)")
		}
	}
	if c.PeerTLS != nil && (len(c.PeerTLS.Certificates) == 0 && c.PeerTLS.GetCertificate == nil) {
		return fmt.Errorf("cluster: PeerTLS presents no certificate; build it with auth.PeerTLSConfig")
	}
	if n := maxMetaSize(c); n > memberlist.MetaMaxSize {
		return fmt.Errorf("cluster: ID %q and addresses make the gossip metadata up to %d bytes; memberlist allows %d: shorten the ID or the advertised addresses", c.ID, n, memberlist.MetaMaxSize)
	}
	return nil
}

func validateHostPort(name, addr string, optional bool) error {
	if addr == "" {
		if optional {
			return nil
		}
		return fmt.Errorf("cluster: %s is empty; want host:port", name)
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("cluster: %s %q is not host:port: %v", name, addr, err)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 0 || p > 65535 {
		return fmt.Errorf("cluster: %s %q has an invalid port %q", name, addr, port)
	}
	if host == "" && !optional {
		return fmt.Errorf("cluster: %s %q has no host; peers must be able to dial it", name, addr)
	}
	return nil
}

// maxMetaSize is the largest gossip metadata (nodeMeta) a node with c's ID and addresses can
// advertise: every other field at its longest, and room for the Raft port the OS assigns to
// port 0.
func maxMetaSize(c *Config) int {
	raft := c.RaftAddr
	if r, ok := strings.CutSuffix(raft, ":0"); ok {
		raft = r + ":65535"
	}
	raw, err := json.Marshal(nodeMeta{
		Version: metaVersion, ID: c.ID, Raft: raft, GRPC: c.GRPCAddr, HTTP: c.HTTPAddr,
		Expect: math.MaxInt32, HasState: true, Applied: math.MaxUint64,
		Cluster: strings.Repeat("0", 16), Nonce: strings.Repeat("0", 16), Cmd: math.MaxInt32,
		Leaving: true, LeaveCommit: strings.Repeat("0", 32),
	})
	if err != nil {
		panic(err) // plain struct; cannot fail
	}
	return len(raw)
}
