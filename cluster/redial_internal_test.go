package cluster

import (
	"crypto/tls"
	"log/slog"
	"net"
	"sync"
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
