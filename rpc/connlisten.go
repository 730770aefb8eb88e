package rpc

import (
	"context"
	"net"
	"sync"

	"google.golang.org/grpc/peer"
)

// connListener tracks the gRPC listener's connections by the caller's address, so that a call
// can end its caller's whole connection. grpc-go frees a finished stream only once its
// trailer is written, which waits behind answers the client has not read: an AcquireStream
// ended for --stream-send-timeout kept its queued answers and unread requests (~3 MB for a
// stream of 5,000 admissions, measured in session 11) until the client read or the connection
// closed, and a caller that never reads could repeat it stream after stream. A handler cannot
// reset its own stream, so the stream's connection is closed instead (endConn).
type connListener struct {
	net.Listener
	mu    sync.Mutex
	conns map[string]*trackedConn // by remote address
}

func newConnListener(l net.Listener) *connListener {
	return &connListener{Listener: l, conns: make(map[string]*trackedConn)}
}

func (l *connListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	tc := &trackedConn{Conn: c, l: l, key: c.RemoteAddr().String()}
	l.mu.Lock()
	l.conns[tc.key] = tc
	l.mu.Unlock()
	return tc, nil
}

// closeRemote closes the connection from remote address addr and reports whether there was one.
func (l *connListener) closeRemote(addr string) bool {
	l.mu.Lock()
	c := l.conns[addr]
	l.mu.Unlock()
	if c == nil {
		return false
	}
	c.Close()
	return true
}

type trackedConn struct {
	net.Conn
	l    *connListener
	key  string
	once sync.Once
}

func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.l.mu.Lock()
		if c.l.conns[c.key] == c {
			delete(c.l.conns, c.key)
		}
		c.l.mu.Unlock()
	})
	return c.Conn.Close()
}

// endConn closes the connection the call of ctx came in on (no-op without a tracking
// listener, e.g. a Server served by a test's own listener) and reports whether it did.
func (s *Server) endConn(ctx context.Context) bool {
	if s.conns == nil {
		return false
	}
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return false
	}
	return s.conns.closeRemote(p.Addr.String())
}
