package faults

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
)

// ErrBlocked is returned by a wrapped stream layer's Dial, and by reads and writes on a
// connection, while the peer's address is blocked.
var ErrBlocked = errors.New("chaos: peer address blocked by a partition")

// Network holds the set of Raft peer addresses this node must not talk to, and cuts the
// connections it dialed to them when they become blocked. The zero value is not usable; use
// NewNetwork. Safe for concurrent use.
//
// hashicorp/raft sends every RPC (and gets its answer) on a connection the sender dialed, so
// blocking B's address on A stops every RPC A initiates towards B. A symmetric partition
// between A and B is A blocking B and B blocking A; blocking one side only is a one-way
// partition (A can no longer send to B, B still sends to A). Inbound connections cannot be
// attributed to a peer (their source port is ephemeral) and are left to the dialing side.
type Network struct {
	blocked atomic.Pointer[map[string]bool]

	mu    sync.Mutex
	conns map[*trackedConn]struct{}

	dialsRefused atomic.Uint64
	connsCut     atomic.Uint64
}

// NewNetwork returns a Network that blocks nothing.
func NewNetwork() *Network {
	n := &Network{conns: make(map[*trackedConn]struct{})}
	n.blocked.Store(&map[string]bool{})
	return n
}

// Block replaces the blocked set with addrs (Raft host:port addresses) and closes every
// connection this node dialed to one of them.
func (n *Network) Block(addrs []string) {
	set := make(map[string]bool, len(addrs))
	for _, a := range addrs {
		if a != "" {
			set[a] = true
		}
	}
	n.blocked.Store(&set)
	n.mu.Lock()
	var cut []*trackedConn
	for c := range n.conns {
		if set[c.peer] {
			cut = append(cut, c)
		}
	}
	n.mu.Unlock()
	for _, c := range cut {
		n.connsCut.Add(1)
		_ = c.Conn.Close()
	}
}

// Heal unblocks every address.
func (n *Network) Heal() { n.Block(nil) }

// IsBlocked reports whether addr is blocked.
func (n *Network) IsBlocked(addr string) bool { return (*n.blocked.Load())[addr] }

// NetworkState is a Network's settings and counters, as the HTTP handler reports them.
type NetworkState struct {
	Blocked      []string `json:"blocked"`
	DialsRefused uint64   `json:"dials_refused"`
	ConnsCut     uint64   `json:"conns_cut"`
}

// State returns the blocked set (sorted) and counters.
func (n *Network) State() NetworkState {
	var b []string
	for a := range *n.blocked.Load() {
		b = append(b, a)
	}
	slices.Sort(b)
	return NetworkState{Blocked: b, DialsRefused: n.dialsRefused.Load(), ConnsCut: n.connsCut.Load()}
}

// WrapStreamLayer returns s with partitions applied to its outbound side. Pass it as
// cluster.Config.WrapStreamLayer.
func (n *Network) WrapStreamLayer(s raft.StreamLayer) raft.StreamLayer {
	return &streamLayer{StreamLayer: s, net: n}
}

type streamLayer struct {
	raft.StreamLayer
	net *Network
}

// refusedDialDelay slows the retry loop of a blocked dial a little, like a real unreachable
// peer would, without making raft wait its whole dial timeout.
const refusedDialDelay = 50 * time.Millisecond

func (s *streamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	peer := string(address)
	if s.net.IsBlocked(peer) {
		s.net.dialsRefused.Add(1)
		time.Sleep(min(timeout, refusedDialDelay))
		return nil, fmt.Errorf("dial %s: %w", peer, ErrBlocked)
	}
	c, err := s.StreamLayer.Dial(address, timeout)
	if err != nil {
		return nil, err
	}
	tc := &trackedConn{Conn: c, peer: peer, net: s.net}
	s.net.mu.Lock()
	s.net.conns[tc] = struct{}{}
	s.net.mu.Unlock()
	// A Block that ran between the check above and the registration must still cut it.
	if s.net.IsBlocked(peer) {
		_ = tc.Close()
		return nil, fmt.Errorf("dial %s: %w", peer, ErrBlocked)
	}
	return tc, nil
}

// trackedConn is a connection this node dialed to peer; reads and writes fail while peer is
// blocked, which closes the gap between a Block and the Close it triggers.
type trackedConn struct {
	net.Conn
	peer string
	net  *Network
	once sync.Once
}

func (c *trackedConn) Read(p []byte) (int, error) {
	if c.net.IsBlocked(c.peer) {
		_ = c.Close()
		return 0, ErrBlocked
	}
	return c.Conn.Read(p)
}

func (c *trackedConn) Write(p []byte) (int, error) {
	if c.net.IsBlocked(c.peer) {
		_ = c.Close()
		return 0, ErrBlocked
	}
	return c.Conn.Write(p)
}

// NetConn is the connection under c (the Raft transport's idle-connection probe looks
// through it).
func (c *trackedConn) NetConn() net.Conn { return c.Conn }

func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.net.mu.Lock()
		delete(c.net.conns, c)
		c.net.mu.Unlock()
	})
	return c.Conn.Close()
}
