package cluster

import (
	"crypto/tls"
	"errors"
	"net"
	"time"

	"github.com/hashicorp/raft"
)

// tcpStream is Raft's stream layer over TCP, optionally TLS. We own it (rather than using
// raft.NewTCPTransport) so that hooks can wrap it: Config.WrapStreamLayer.
type tcpStream struct {
	net.Listener
	advertise net.Addr
	tls       *tls.Config
}

func newTCPStream(bind string, tlsCfg *tls.Config) (*tcpStream, error) {
	l, err := net.Listen("tcp", bind)
	if err != nil {
		return nil, err
	}
	addr, ok := l.Addr().(*net.TCPAddr)
	if !ok || addr.IP.IsUnspecified() {
		l.Close()
		return nil, errors.New("the Raft address must be an address peers can dial, not " + l.Addr().String())
	}
	s := &tcpStream{Listener: l, advertise: addr, tls: tlsCfg}
	if tlsCfg != nil {
		s.Listener = tls.NewListener(l, tlsCfg)
	}
	return s, nil
}

// Dial implements raft.StreamLayer.
func (s *tcpStream) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	d := &net.Dialer{Timeout: timeout}
	if s.tls != nil {
		return tls.DialWithDialer(d, "tcp", string(address), s.tls)
	}
	return d.Dial("tcp", string(address))
}

// Addr implements net.Listener with the advertised address.
func (s *tcpStream) Addr() net.Addr { return s.advertise }
