package cluster

import (
	"bytes"
	"crypto/tls"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"

	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/internal/testpki"
)

// acceptRecorder remembers the connections it accepted, so a test can close them as a
// process that exits does.
type acceptRecorder struct {
	*tcpStream
	mu    sync.Mutex
	conns []net.Conn
}

func (r *acceptRecorder) Accept() (net.Conn, error) {
	c, err := r.tcpStream.Accept()
	if err == nil {
		r.mu.Lock()
		r.conns = append(r.conns, c)
		r.mu.Unlock()
	}
	return c, err
}

// votePeer is a raft NetworkTransport on addr that grants every vote, standing in for a peer
// node; stop ends it the way an exiting process does (listener and every connection closed).
func votePeer(t *testing.T, addr string, tlsCfg *tls.Config) (bound string, stop func()) {
	t.Helper()
	s, err := newTCPStream(addr, tlsCfg, 5*time.Second, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	rec := &acceptRecorder{tcpStream: s}
	trans := raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream: rec, MaxPool: 3, Timeout: 5 * time.Second, MaxRPCsInFlight: 1, Logger: hclog.NewNullLogger(),
	})
	done := make(chan struct{})
	go func() {
		for {
			select {
			case rpc := <-trans.Consumer():
				rpc.Respond(&raft.RequestVoteResponse{Term: 1, Granted: true}, nil)
			case <-done:
				return
			}
		}
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			close(done)
			_ = trans.Close()
			rec.mu.Lock()
			for _, c := range rec.conns {
				_ = c.Close()
			}
			rec.mu.Unlock()
		})
	}
	t.Cleanup(stop)
	return string(trans.LocalAddr()), stop
}

// TestPooledConnectionSurvivesPeerRestart: raft pools idle connections and reuses them
// blindly; a vote asked on one that the peer's previous process closed failed with EOF (the
// first election after a rolling restart lost that vote and logged an ERROR). With
// redialLayer the request goes out on a new connection instead, and a connection that is
// still open is reused, not redialed.
func TestPooledConnectionSurvivesPeerRestart(t *testing.T) {
	ca, err := testpki.NewCA("redial-test")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ca.Server("quotad", "node")
	if err != nil {
		t.Fatal(err)
	}
	peerTLS, err := auth.PeerTLSConfigFromPEM(srv.CertPEM, srv.KeyPEM, ca.PEM, "quotad")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		tls  *tls.Config
	}{{"tcp", nil}, {"tls", peerTLS}} {
		t.Run(tc.name, func(t *testing.T) {
			addr, stop := votePeer(t, "127.0.0.1:0", tc.tls)
			s, err := newTCPStream("127.0.0.1:0", tc.tls, 5*time.Second, slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			layer := newRedialLayer(s, slog.New(slog.DiscardHandler))
			layer.idle = 20 * time.Millisecond
			trans := raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
				Stream: layer, MaxPool: 3, Timeout: 5 * time.Second, MaxRPCsInFlight: 1, Logger: hclog.NewNullLogger(),
			})
			defer trans.Close()
			vote := func() error {
				req := &raft.RequestVoteRequest{RPCHeader: raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax}, Term: 1}
				var resp raft.RequestVoteResponse
				err := trans.RequestVote("peer", raft.ServerAddress(addr), req, &resp)
				if err == nil && !resp.Granted {
					t.Fatalf("vote not granted: %+v", resp)
				}
				return err
			}
			if err := vote(); err != nil {
				t.Fatalf("first vote: %v", err)
			}
			time.Sleep(3 * layer.idle)
			if err := vote(); err != nil {
				t.Fatalf("vote on an idle connection to a live peer: %v", err)
			}
			if n := layer.redials.Load(); n != 0 {
				t.Fatalf("redials = %d with the peer up all along, want 0 (a live idle connection is reused)", n)
			}

			// The peer restarts on the same address; the pooled connection is its old process's.
			stop()
			votePeer(t, addr, tc.tls)
			time.Sleep(3 * layer.idle)
			if err := vote(); err != nil {
				t.Fatalf("vote after the peer restarted: %v (the pooled connection of its old process was reused)", err)
			}
			if n := layer.redials.Load(); n != 1 {
				t.Fatalf("redials = %d after one restart, want 1", n)
			}
			if err := vote(); err != nil {
				t.Fatalf("vote right after: %v", err)
			}
			if n := layer.redials.Load(); n != 1 {
				t.Fatalf("redials = %d, want still 1 (the new connection is live)", n)
			}
		})
	}
}

// rpcPeer is a raft NetworkTransport on addr standing in for a peer node: it reads a
// snapshot whole and accepts it, grants every vote, and counts the RPCs it got; stop ends it
// the way an exiting process does (listener and every connection closed).
func rpcPeer(t *testing.T, addr string, tlsCfg *tls.Config) (bound string, got *atomic.Int64, stop func()) {
	t.Helper()
	s, err := newTCPStream(addr, tlsCfg, 5*time.Second, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	rec := &acceptRecorder{tcpStream: s}
	trans := raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream: rec, MaxPool: 3, Timeout: 5 * time.Second, MaxRPCsInFlight: 1, Logger: hclog.NewNullLogger(),
	})
	got = new(atomic.Int64)
	done := make(chan struct{})
	go func() {
		for {
			select {
			case rpc := <-trans.Consumer():
				got.Add(1)
				if _, ok := rpc.Command.(*raft.InstallSnapshotRequest); ok {
					_, err := io.Copy(io.Discard, rpc.Reader)
					rpc.Respond(&raft.InstallSnapshotResponse{Term: 1, Success: err == nil}, err)
					continue
				}
				rpc.Respond(&raft.RequestVoteResponse{Term: 1, Granted: true}, nil)
			case <-done:
				return
			}
		}
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			close(done)
			_ = trans.Close()
			rec.mu.Lock()
			for _, c := range rec.conns {
				_ = c.Close()
			}
			rec.mu.Unlock()
		})
	}
	t.Cleanup(stop)
	return string(trans.LocalAddr()), got, stop
}

// teeLayer records every byte raft writes on the connections it dials.
type teeLayer struct {
	raft.StreamLayer
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *teeLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	c, err := l.StreamLayer.Dial(address, timeout)
	if err != nil {
		return nil, err
	}
	return &teeConn{Conn: c, l: l}, nil
}

type teeConn struct {
	net.Conn
	l *teeLayer
}

func (c *teeConn) Write(p []byte) (int, error) {
	c.l.mu.Lock()
	c.l.buf.Write(p)
	c.l.mu.Unlock()
	return c.Conn.Write(p)
}

// stallReader is snapshot data that pauses after head until resume is closed, then yields
// tail.
type stallReader struct {
	head, tail      []byte
	stalled, resume chan struct{}
	paused          bool
}

func (r *stallReader) Read(p []byte) (int, error) {
	if len(r.head) > 0 {
		n := copy(p, r.head)
		r.head = r.head[n:]
		return n, nil
	}
	if !r.paused {
		r.paused = true
		close(r.stalled)
		<-r.resume
	}
	if len(r.tail) > 0 {
		n := copy(p, r.tail)
		r.tail = r.tail[n:]
		return n, nil
	}
	return 0, io.EOF
}

// TestNoRedialMidRequest: only the first write of a request may redial. A snapshot whose
// reader paused longer than the idle time while the peer restarted had its rest written on a
// new connection, where the peer's new process took it for a request of its own: here the
// rest is the bytes of a RequestVote, and the new process granted that vote — which nobody
// asked for. The transfer must fail instead, and the new process see nothing.
func TestNoRedialMidRequest(t *testing.T) {
	ca, err := testpki.NewCA("redial-test")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ca.Server("quotad", "node")
	if err != nil {
		t.Fatal(err)
	}
	peerTLS, err := auth.PeerTLSConfigFromPEM(srv.CertPEM, srv.KeyPEM, ca.PEM, "quotad")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		tls  *tls.Config
	}{{"tcp", nil}, {"tls", peerTLS}} {
		t.Run(tc.name, func(t *testing.T) {
			addr, _, stop := rpcPeer(t, "127.0.0.1:0", tc.tls)
			newTrans := func(layer raft.StreamLayer) *raft.NetworkTransport {
				trans := raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
					Stream: layer, MaxPool: 3, Timeout: 5 * time.Second, MaxRPCsInFlight: 1, Logger: hclog.NewNullLogger(),
				})
				t.Cleanup(func() { _ = trans.Close() })
				return trans
			}
			// The bytes raft sends for a RequestVote: the snapshot's tail.
			s0, err := newTCPStream("127.0.0.1:0", tc.tls, 5*time.Second, slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			tee := &teeLayer{StreamLayer: s0}
			vote := &raft.RequestVoteRequest{RPCHeader: raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax}, Term: 7}
			if err := newTrans(tee).RequestVote("peer", raft.ServerAddress(addr), vote, &raft.RequestVoteResponse{}); err != nil {
				t.Fatalf("vote: %v", err)
			}
			tee.mu.Lock()
			tail := bytes.Clone(tee.buf.Bytes())
			tee.mu.Unlock()

			s, err := newTCPStream("127.0.0.1:0", tc.tls, 5*time.Second, slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			layer := newRedialLayer(s, slog.New(slog.DiscardHandler))
			layer.idle = 20 * time.Millisecond
			trans := newTrans(layer)
			// head fills raft's 256 KiB write buffer exactly, so it is written before the pause.
			data := &stallReader{
				head: make([]byte, 256*1024), tail: tail,
				stalled: make(chan struct{}), resume: make(chan struct{}),
			}
			req := &raft.InstallSnapshotRequest{
				RPCHeader:          raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax},
				SnapshotVersion:    raft.SnapshotVersionMax,
				Term:               1,
				LastLogIndex:       10,
				LastLogTerm:        1,
				Size:               int64(len(data.head) + len(tail)),
				ConfigurationIndex: 1,
			}
			errc := make(chan error, 1)
			go func() {
				errc <- trans.InstallSnapshot("peer", raft.ServerAddress(addr), req, &raft.InstallSnapshotResponse{}, data)
			}()
			select {
			case <-data.stalled:
			case err := <-errc:
				t.Fatalf("InstallSnapshot ended before its reader paused: %v", err)
			}
			// The peer restarts while the snapshot's reader is paused.
			stop()
			_, got, _ := rpcPeer(t, addr, tc.tls)
			time.Sleep(5 * layer.idle)
			close(data.resume)
			if err := <-errc; err == nil {
				t.Error("InstallSnapshot succeeded though the peer restarted in the middle of it")
			}
			time.Sleep(200 * time.Millisecond) // time for a stray request to be served
			if n := got.Load(); n != 0 {
				t.Errorf("the peer's new process got %d RPCs: the rest of the snapshot went to it on a new connection", n)
			}
			if n := layer.redials.Load(); n != 0 {
				t.Errorf("redials = %d in the middle of a request, want 0", n)
			}
		})
	}
}
