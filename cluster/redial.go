package cluster

import (
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
)

// redialLayer keeps raft's pooled connections usable across a peer's restart.
//
// raft's NetworkTransport keeps up to MaxPool idle connections per peer and reuses them
// without looking: a connection to a peer that restarted since its last use was closed by the
// peer's old process, and the next RPC on it fails ("EOF", "connection reset"). Between
// followers that is the RequestVote of the next election — after a rolling restart, the first
// election (a graceful leader's handover too) lost that peer's vote and logged an ERROR about a
// healthy peer (e2e TestGracefulStopLogsNoError, once in CI) — and from a leader it is a
// failed heartbeat or AppendEntries.
//
// So before the first write of a request on a connection that has been idle for probeIdle
// (never a later write of the same request: redialConn), redialConn
// asks the kernel, without waiting or consuming anything, whether the peer closed it
// (peerClosed: a non-blocking MSG_PEEK). An idle raft connection has nothing to read — raft
// speaks strictly request then response, and a response is read whole before the connection
// goes back to the pool — so a pending end of stream, reset, or any pending bytes (a TLS
// close_notify) mean the peer is gone from it. The connection is then replaced by a fresh dial
// of the same address through the same layers (partitions a chaos hook applies still hold:
// the redial goes through its Dial) before raft writes a byte of the request; the request
// itself is never sent twice. If the dial fails, the write fails with that error, as it would
// have on a fresh connection. Where the probe is not available (the connection is not a TCP
// socket underneath, or the platform has no MSG_PEEK) nothing changes.
type redialLayer struct {
	raft.StreamLayer
	log *slog.Logger
	// idle is how long a connection must have been unused before a write probes it
	// (probeIdle; tests shorten it).
	idle time.Duration

	redials atomic.Uint64
}

// probeIdle: connections in steady use (a leader's heartbeats every HeartbeatTimeout/10,
// replication) are not probed; one left in the pool across a peer's restart (seconds) is.
const probeIdle = 200 * time.Millisecond

func newRedialLayer(s raft.StreamLayer, log *slog.Logger) *redialLayer {
	return &redialLayer{StreamLayer: s, log: log, idle: probeIdle}
}

// Dial implements raft.StreamLayer.
func (l *redialLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	c, err := l.StreamLayer.Dial(address, timeout)
	if err != nil {
		return nil, err
	}
	return &redialConn{layer: l, addr: address, timeout: timeout, conn: c, last: time.Now()}, nil
}

// redialConn is a connection of redialLayer. Safe for the use raft makes of it: one writer,
// reads not concurrent with a probe (a probe happens only with no read in progress).
//
// Only the first write of a request may probe (and redial): the first write after a read, on a
// connection raft took from its pool after reading the previous response whole. A later
// write of the same request (bufio flushes a request larger than its buffer in several
// writes; InstallSnapshot streams the snapshot from its reader and may pause longer than the
// idle time between two writes) must go where the request's beginning went: on a new
// connection it would reach the peer's new process as the start of a request — the rest of
// a snapshot parsed as an RPC. Pipelined replication (off: MaxRPCsInFlight 1) would break
// this rule; redialConn must not be used with it.
type redialConn struct {
	layer   *redialLayer
	addr    raft.ServerAddress
	timeout time.Duration

	mu   sync.Mutex
	conn net.Conn
	last time.Time // end of the last read or write
	// atRequest: a read happened since the last write, so the next write begins a request
	// (false on a new connection: raft writes to it at once; and a TLS session ticket
	// pending there is not a sign of a closed peer).
	atRequest     bool
	reading       int // reads in progress
	readDeadline  time.Time
	writeDeadline time.Time
	closed        bool
}

func (c *redialConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return 0, net.ErrClosed
	}
	if c.atRequest && c.reading == 0 && time.Since(c.last) >= c.layer.idle {
		if err := c.reviveLocked(); err != nil {
			c.mu.Unlock()
			return 0, err
		}
	}
	c.atRequest = false
	conn := c.conn
	c.mu.Unlock()
	n, err := conn.Write(p)
	c.touch()
	return n, err
}

// reviveLocked replaces the connection with a new dial if the peer closed it.
func (c *redialConn) reviveLocked() error {
	closed, why := peerClosed(c.conn)
	if !closed {
		return nil
	}
	_ = c.conn.Close()
	nc, err := c.layer.StreamLayer.Dial(c.addr, c.timeout)
	if err != nil {
		return err
	}
	if !c.readDeadline.IsZero() {
		_ = nc.SetReadDeadline(c.readDeadline)
	}
	if !c.writeDeadline.IsZero() {
		_ = nc.SetWriteDeadline(c.writeDeadline)
	}
	c.conn = nc
	c.layer.redials.Add(1)
	c.layer.log.Debug("raft transport: an idle connection was closed by the peer (restarted?); dialed a new one before reusing it",
		"peer", string(c.addr), "seen", why)
	return nil
}

func (c *redialConn) Read(p []byte) (int, error) {
	c.mu.Lock()
	conn := c.conn
	c.reading++
	c.mu.Unlock()
	n, err := conn.Read(p)
	c.mu.Lock()
	c.reading--
	c.last = time.Now()
	c.atRequest = true
	c.mu.Unlock()
	return n, err
}

func (c *redialConn) touch() {
	c.mu.Lock()
	c.last = time.Now()
	c.mu.Unlock()
}

func (c *redialConn) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	return c.conn.Close()
}

func (c *redialConn) current() net.Conn {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.conn
}

func (c *redialConn) LocalAddr() net.Addr  { return c.current().LocalAddr() }
func (c *redialConn) RemoteAddr() net.Addr { return c.current().RemoteAddr() }

func (c *redialConn) SetDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.readDeadline, c.writeDeadline = t, t
	return c.conn.SetDeadline(t)
}

func (c *redialConn) SetReadDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.readDeadline = t
	return c.conn.SetReadDeadline(t)
}

func (c *redialConn) SetWriteDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.writeDeadline = t
	return c.conn.SetWriteDeadline(t)
}

// rawConn finds the TCP connection under c: through TLS (tls.Conn.NetConn) and wrappers
// that say what they wrap (NetConn), nil if there is none.
func rawConn(c net.Conn) *net.TCPConn {
	for range 8 {
		switch v := c.(type) {
		case *net.TCPConn:
			return v
		case interface{ NetConn() net.Conn }:
			c = v.NetConn()
		default:
			return nil
		}
	}
	return nil
}
