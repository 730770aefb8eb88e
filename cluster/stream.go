package cluster

import (
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
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
// handshakes run on their own goroutines, at most maxHandshakes at a time and each bounded by
// the handshake timeout, so a peer that connects and stays silent (or a flood of them) costs
// one goroutine for a few seconds and never stalls raft's accept loop. Refused connections
// are closed before a byte of Raft is read and logged at most once per refusalLogEvery.
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
	slots   chan struct{} // handshakes in progress
	wg      sync.WaitGroup

	refusals refusalLog
}

const (
	maxHandshakes   = 64
	refusalLogEvery = 10 * time.Second
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
		conns: make(chan net.Conn), closed: make(chan struct{}), slots: make(chan struct{}, maxHandshakes),
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
		select {
		case s.slots <- struct{}{}:
		default:
			c.Close()
			s.refused(c.RemoteAddr(), errors.New("too many handshakes in progress"))
			continue
		}
		s.wg.Add(1)
		go s.handshake(c)
	}
}

// handshake authenticates c and hands it to Accept, or closes it.
func (s *tcpStream) handshake(c net.Conn) {
	defer s.wg.Done()
	tc := tls.Server(c, s.tls)
	ctx, cancel := context.WithTimeout(s.ctx, s.timeout) // s.ctx ends at Close
	_ = c.SetDeadline(time.Now().Add(s.timeout))
	err := tc.HandshakeContext(ctx)
	cancel()
	<-s.slots
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
