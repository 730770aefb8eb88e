package cluster

import (
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/raft"
)

// tcpStream is Raft's stream layer over TCP, TLS unless Config.Insecure. We own it (rather
// than using raft.NewTCPTransport) so that hooks can wrap it (Config.WrapStreamLayer) and so
// that an incoming connection is authenticated before Raft sees it.
//
// With TLS, Accept hands raft only connections whose handshake completed: the peer presented
// a certificate of the cluster CA carrying the server SAN (PeerTLS's VerifyConnection). The
// handshakes run on their own goroutines, each bounded by the handshake timeout, so a peer
// that connects and stays silent costs one goroutine for a few seconds and never stalls
// raft's accept loop. At most maxHandshakes are pending at once, at most maxHandshakesPerIP
// from one source address; a new connection over either cap evicts the oldest pending one
// (of its address, else of all) instead of being refused. Refusing the newcomer let anyone
// who keeps 64 silent connections open (reopening each as it timed out) lock every peer out:
// a leader killed under that took 16 s instead of 1 to be replaced, and a restarted node
// could not be reached at all. Now a silent flood from one address only evicts its own
// connections, and one from many must open connections faster than a peer's handshake
// completes (maxHandshakes per handshake time, some 100,000/s) to keep a peer out. Refused
// connections are closed before a byte of Raft is read and logged at most once per
// refusalLogEvery.
type tcpStream struct {
	ln        net.Listener
	advertise net.Addr
	tls       *tls.Config
	timeout   time.Duration
	log       *slog.Logger

	conns   chan net.Conn // handshaken connections for Accept
	ctx     context.Context
	cancel  context.CancelFunc
	closed  chan struct{}
	closeMu sync.Once
	pending pendingHandshakes
	wg      sync.WaitGroup

	refusals refusalLog
}

const (
	maxHandshakes      = 256
	maxHandshakesPerIP = 16
	refusalLogEvery    = 10 * time.Second
)

func newTCPStream(bind string, tlsCfg *tls.Config, timeout time.Duration, log *slog.Logger) (*tcpStream, error) {
	l, err := net.Listen("tcp", bind)
	if err != nil {
		return nil, err
	}
	addr, ok := l.Addr().(*net.TCPAddr)
	if !ok || addr.IP.IsUnspecified() {
		l.Close()
		return nil, errors.New("the Raft address must be an address peers can dial, not " + l.Addr().String())
	}
	s := &tcpStream{
		ln: l, advertise: addr, tls: tlsCfg, timeout: timeout, log: log,
		conns: make(chan net.Conn), closed: make(chan struct{}),
		pending: pendingHandshakes{max: maxHandshakes, maxPerIP: maxHandshakesPerIP},
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	if tlsCfg != nil {
		s.wg.Add(1)
		go s.acceptLoop()
	}
	return s, nil
}

// Accept implements net.Listener: the next authenticated connection.
func (s *tcpStream) Accept() (net.Conn, error) {
	if s.tls == nil {
		return s.ln.Accept()
	}
	select {
	case c := <-s.conns:
		return c, nil
	case <-s.closed:
		return nil, net.ErrClosed
	}
}

// Close implements net.Listener.
func (s *tcpStream) Close() error {
	err := net.ErrClosed
	s.closeMu.Do(func() {
		close(s.closed)
		s.cancel()
		err = s.ln.Close()
	})
	s.wg.Wait()
	return err
}

func (s *tcpStream) acceptLoop() {
	defer s.wg.Done()
	var delay time.Duration
	for {
		c, err := s.ln.Accept()
		if err != nil {
			select {
			case <-s.closed:
				return
			default:
			}
			// Out of file descriptors and the like: back off as net/http does.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			s.log.Warn("raft transport: accept failed", "err", err, "retry_in", delay)
			select {
			case <-s.closed:
				return
			case <-time.After(delay):
			}
			continue
		}
		delay = 0
		p, evicted := s.pending.add(c)
		if evicted != nil {
			// Closing it ends its handshake at once; its goroutine counts the refusal.
			evicted.Close()
		}
		s.wg.Add(1)
		go s.handshake(p)
	}
}

// handshake authenticates p's connection and hands it to Accept, or closes it.
func (s *tcpStream) handshake(p *pendingConn) {
	defer s.wg.Done()
	c := p.conn
	tc := tls.Server(c, s.tls)
	ctx, cancel := context.WithTimeout(s.ctx, s.timeout) // s.ctx ends at Close
	_ = c.SetDeadline(time.Now().Add(s.timeout))
	err := tc.HandshakeContext(ctx)
	cancel()
	if s.pending.done(p) {
		err = errors.New("handshake evicted: more connections arrived from its address or in all than may be pending")
	}
	if err != nil {
		c.Close()
		s.refused(c.RemoteAddr(), err)
		return
	}
	_ = c.SetDeadline(time.Time{})
	select {
	case s.conns <- tc:
	case <-s.closed:
		tc.Close()
	}
}

func (s *tcpStream) refused(from net.Addr, err error) {
	if n, last := s.refusals.add(time.Now(), from, err); n > 0 {
		s.log.Warn("raft transport: refused connections without a server certificate of this cluster",
			"count", n, "last_from", last.from, "last_err", last.err, "per", refusalLogEvery)
	}
}

// Dial implements raft.StreamLayer. With TLS the handshake (and the check that the peer holds
// a server certificate) completes within timeout before raft writes anything.
func (s *tcpStream) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	d := &net.Dialer{Timeout: timeout}
	if s.tls != nil {
		return tls.DialWithDialer(d, "tcp", string(address), s.tls)
	}
	return d.Dial("tcp", string(address))
}

// Addr implements net.Listener with the advertised address.
func (s *tcpStream) Addr() net.Addr { return s.advertise }

// pendingHandshakes tracks the incoming connections whose handshake is in progress. Adding one
// over a cap evicts the oldest of its source address (over maxPerIP) or of all (over max). The
// zero value is not usable: set max and maxPerIP. Safe for concurrent use.
type pendingHandshakes struct {
	max, maxPerIP int

	mu    sync.Mutex
	order []*pendingConn // oldest first; at most max long
	perIP map[string]int
}

// pendingConn is one connection whose handshake is in progress.
type pendingConn struct {
	conn    net.Conn
	ip      string
	evicted bool // guarded by pendingHandshakes.mu
}

// add registers c and returns it, and the connection it evicted (nil if none), which the
// caller closes.
func (h *pendingHandshakes) add(c net.Conn) (*pendingConn, net.Conn) {
	p := &pendingConn{conn: c, ip: sourceIP(c.RemoteAddr())}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.perIP == nil {
		h.perIP = make(map[string]int)
	}
	victim := -1
	if h.perIP[p.ip] >= h.maxPerIP {
		victim = slices.IndexFunc(h.order, func(o *pendingConn) bool { return o.ip == p.ip })
	} else if len(h.order) >= h.max {
		victim = 0
	}
	var evicted net.Conn
	if victim >= 0 {
		o := h.order[victim]
		h.removeLocked(victim)
		o.evicted = true
		evicted = o.conn
	}
	h.order = append(h.order, p)
	h.perIP[p.ip]++
	return p, evicted
}

// done removes p once its handshake ended; it reports whether p had been evicted meanwhile (its
// connection was closed, perhaps after the handshake completed).
func (h *pendingHandshakes) done(p *pendingConn) (evicted bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if p.evicted {
		return true
	}
	if i := slices.Index(h.order, p); i >= 0 {
		h.removeLocked(i)
	}
	return false
}

func (h *pendingHandshakes) removeLocked(i int) {
	o := h.order[i]
	h.order = slices.Delete(h.order, i, i+1)
	if h.perIP[o.ip]--; h.perIP[o.ip] <= 0 {
		delete(h.perIP, o.ip)
	}
}

// sourceIP is the source a connection counts against: its IPv4 address, or its IPv6 /64 (one
// host commonly holds a whole /64), or the whole address if it is neither.
func sourceIP(a net.Addr) string {
	if ta, ok := a.(*net.TCPAddr); ok {
		if ta.IP.To4() == nil && len(ta.IP) == net.IPv6len {
			return ta.IP.Mask(net.CIDRMask(64, 128)).String() + "/64"
		}
		return ta.IP.String()
	}
	host, _, err := net.SplitHostPort(a.String())
	if err != nil {
		return a.String()
	}
	return host
}

// refusalLog counts refused connections and lets one log line through per refusalLogEvery.
type refusalLog struct {
	mu      sync.Mutex
	count   int
	total   uint64
	lastLog time.Time
	last    refusal
}

type refusal struct {
	from string
	err  string
}

// add records a refusal; it returns how many to report (0: stay quiet) and the latest one.
func (r *refusalLog) add(now time.Time, from net.Addr, err error) (int, refusal) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.count++
	r.total++
	r.last = refusal{from: from.String(), err: err.Error()}
	if now.Sub(r.lastLog) < refusalLogEvery {
		return 0, r.last
	}
	n := r.count
	r.count, r.lastLog = 0, now
	return n, r.last
}

// Refused returns how many incoming Raft connections this stream refused.
func (r *refusalLog) Refused() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.total
}
