package cluster_test

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/internal/testpki"
)

// victim is a one-node cluster holding count 5, for attacks on its Raft port.
type victim struct {
	c    *clustertest.Cluster
	node *cluster.Node
	term uint64
	last uint64
}

func startVictim(t testing.TB) *victim {
	c := clustertest.Start(t, 1, newCounterFSM, clustertest.WithConfig(func(_ int, cfg *cluster.Config) {
		cfg.MinVoters = 1
		cfg.PeerHandshakeTimeout = 300 * time.Millisecond
		cfg.TickInterval = time.Hour // no idle ticks: the log only moves when the test writes
	}))
	c.WaitLeader(leaderTimeout)
	n := c.Node(0)
	if tt, ok := t.(*testing.T); ok {
		add(tt, n, 5)
	} else {
		ts, _ := n.Now()
		if f := n.Raft().Apply(encodeAdd(ts, 5), 5*time.Second); f.Error() != nil {
			t.Fatal(f.Error())
		}
	}
	return &victim{c: c, node: n, term: n.Raft().CurrentTerm(), last: n.Raft().LastIndex()}
}

// intact fails the test unless the victim still leads in its term with count 5 and its log
// unchanged.
func (v *victim) intact(t testing.TB) {
	t.Helper()
	if !v.node.IsLeader() || v.node.Raft().CurrentTerm() != v.term {
		t.Fatalf("victim lost leadership or changed term: leader %v, term %d (was %d)", v.node.IsLeader(), v.node.Raft().CurrentTerm(), v.term)
	}
	if got := counter(v.c, 0).Count(); got != 5 {
		t.Fatalf("victim's count is %d, want 5: a forged entry was applied", got)
	}
	if got := v.node.Raft().LastIndex(); got != v.last {
		t.Fatalf("victim's last index is %d, want %d", got, v.last)
	}
}

// attackTLS returns TLS client configurations an attacker could bring.
func attackTLS(t *testing.T) map[string]*tls.Config {
	t.Helper()
	pki := clustertest.PKI(t)
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pki.CA.PEM)
	withCert := func(p testpki.Pair) *tls.Config {
		c, err := tls.X509KeyPair(p.CertPEM, p.KeyPEM)
		if err != nil {
			t.Fatal(err)
		}
		return &tls.Config{InsecureSkipVerify: true, GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &c, nil }}
	}
	worker, err := pki.CA.Client("quotad", auth.Identity{Name: "w", Role: auth.RoleWorker, Domains: []string{"provider"}})
	if err != nil {
		t.Fatal(err)
	}
	admin, err := pki.CA.ClientBothUsages("quotad", auth.Identity{Name: "root", Role: auth.RoleAdmin})
	if err != nil {
		t.Fatal(err)
	}
	self, err := testpki.SelfSignedServer("quotad", "intruder")
	if err != nil {
		t.Fatal(err)
	}
	return map[string]*tls.Config{
		"plain TCP":                     nil,
		"TLS without a certificate":     {InsecureSkipVerify: true},
		"TLS with a worker certificate": withCert(worker),
		"TLS with an admin certificate": withCert(admin),
		"TLS with a self-signed server": withCert(self),
	}
}

func TestForgedRaftTrafficIsRefused(t *testing.T) {
	t.Parallel()
	v := startVictim(t)
	addr := v.node.RaftAddr()
	attacks := attackTLS(t)
	for name, cfg := range attacks {
		f, err := clustertest.NewForger(cfg)
		if err != nil {
			t.Fatal(err)
		}
		// Entries after the victim's log, at a higher term, committed at once: accepted, they
		// would depose the leader and add 1000 to the count.
		ts, _ := v.node.Now()
		resp, err := f.AppendEntries(addr, v.term+10, v.last, v.term, encodeAdd(ts, 1000))
		if err == nil {
			t.Errorf("%s: forged AppendEntries answered: %+v", name, resp)
		}
		if vr, err := f.RequestVote(addr, v.term+10, v.last+100, v.term+9); err == nil {
			t.Errorf("%s: forged RequestVote answered: %+v", name, vr)
		}
		f.Close()
		t.Logf("%s: refused", name)
	}
	// A connection that says nothing is closed once the handshake times out.
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	start := time.Now()
	if _, err := conn.Read(make([]byte, 1)); err == nil {
		t.Error("a silent connection got bytes")
	} else if d := time.Since(start); d > 3*time.Second {
		t.Errorf("a silent connection stayed open %s (handshake timeout 300ms)", d)
	}
	conn.Close()
	v.intact(t)
	if got := v.node.RefusedPeerConns(); got < uint64(len(attacks)) {
		t.Errorf("RefusedPeerConns = %d, want at least %d", got, len(attacks))
	}
	add(t, v.node, 1) // and it keeps serving
}

// FuzzStreamHandshake writes arbitrary bytes to a node's Raft port: whatever they are, the
// connection is closed without an answer from Raft, and the node keeps leading with its log
// unchanged.
func FuzzStreamHandshake(f *testing.F) {
	v := startVictim(f)
	addr := v.node.RaftAddr()
	f.Add([]byte{})
	f.Add([]byte{0x00, 0x80})                                     // rpcAppendEntries + an empty msgpack map
	f.Add([]byte{0x16, 0x03, 0x01, 0x00, 0x05, 0x01, 0, 0, 1, 0}) // a truncated TLS ClientHello
	f.Add([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
	r := rand.New(rand.NewPCG(1, 2))
	for range 4 {
		b := make([]byte, 1+r.IntN(2048))
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		_, _ = conn.Write(data)
		// Whatever the victim sends back (at most a TLS alert or handshake messages), it must
		// close the connection.
		if _, err := io.Copy(io.Discard, conn); err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				t.Fatal("the connection stayed open past the handshake timeout")
			}
		}
		v.intact(t)
	})
}

func TestInsecureClusterForms(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 3, newCounterFSM, clustertest.WithConfig(func(_ int, cfg *cluster.Config) {
		cfg.PeerTLS, cfg.GossipSecretKey, cfg.Insecure = nil, nil, true
	}))
	li := c.WaitLeader(leaderTimeout)
	add(t, c.Node(li), 3)
	waitCount(t, c, 3)
}

// TestClusterIDRecordedAndLearned: the bootstrapping nodes record the same cluster ID in
// their data dirs; a node that joins later learns it from its leader.
func TestClusterIDRecordedAndLearned(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, 3, newCounterFSM)
	li := c.WaitLeader(leaderTimeout)
	add(t, c.Node(li), 1)
	readID := func(i int) string {
		b, _ := os.ReadFile(filepath.Join(c.Config(i).DataDir, "cluster-id"))
		return strings.TrimSpace(string(b))
	}
	clustertest.Eventually(t, 5*time.Second, func() error {
		if id := readID(0); id == "" || readID(1) != id || readID(2) != id {
			return fmt.Errorf("cluster IDs %q %q %q", readID(0), readID(1), readID(2))
		}
		return nil
	})
	j := c.AddNode()
	clustertest.Eventually(t, 15*time.Second, func() error {
		if got, want := readID(j), readID(0); got != want {
			return fmt.Errorf("node%d cluster ID %q, want %q", j, got, want)
		}
		return nil
	})
}

// TestSilentConnectionsDoNotLockPeersOut holds more silent connections to every node's Raft
// port than may be pending (reopening each as soon as it is closed, as an attacker would),
// from another address, then kills the leader: the others still elect one and commit. With
// the newcomer refused once 64 handshakes were pending, the attacker held every slot until
// the handshake timeout (30 s here) and no vote request got through.
func TestSilentConnectionsDoNotLockPeersOut(t *testing.T) {
	t.Parallel()
	attacker := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}
	if l, err := net.ListenTCP("tcp", &net.TCPAddr{IP: attacker.IP}); err != nil {
		t.Skipf("cannot use %s as a second loopback address: %v", attacker.IP, err)
	} else {
		l.Close()
	}
	c := clustertest.Start(t, 3, newCounterFSM, clustertest.WithConfig(func(_ int, cfg *cluster.Config) {
		cfg.PeerHandshakeTimeout = 30 * time.Second
	}))
	li := c.WaitLeader(leaderTimeout)
	add(t, c.Node(li), 1)

	stop := make(chan struct{})
	var wg sync.WaitGroup
	const perNode = 100 // more than the 64 slots the old code had, and than maxHandshakesPerIP
	var opened atomic.Int64
	for i := range c.Len() {
		addr := c.Node(i).RaftAddr()
		for range perNode {
			wg.Add(1)
			go func() {
				defer wg.Done()
				d := net.Dialer{LocalAddr: attacker, Timeout: time.Second}
				buf := make([]byte, 1)
				for {
					select {
					case <-stop:
						return
					default:
					}
					conn, err := d.Dial("tcp", addr)
					if err != nil {
						time.Sleep(5 * time.Millisecond)
						continue
					}
					opened.Add(1)
					go func() { <-stop; conn.Close() }()
					_, _ = conn.Read(buf) // silent until the node closes it
					conn.Close()
					time.Sleep(time.Millisecond)
				}
			}()
		}
	}
	defer func() { close(stop); wg.Wait() }()
	clustertest.Eventually(t, 5*time.Second, func() error {
		if n := opened.Load(); n < int64(c.Len()*perNode) {
			return fmt.Errorf("attacker opened %d connections", n)
		}
		return nil
	})

	c.Kill(li)
	nl := c.WaitLeader(leaderTimeout)
	if got := add(t, c.Node(nl), 1); got != 2 {
		t.Fatalf("count after failover = %d, want 2", got)
	}
	t.Logf("new leader node%d under %d silent connections opened", nl, opened.Load())
}

// TestBootstrapWhenOneMemberBootstrappedFirst: in a fresh 3-node cluster, one node sees all
// three members and bootstraps before the others look (here: the others' first bootstrap
// check held 1.5 s). They see a member with Raft state — the cluster this very member set
// bootstraps, by its cluster ID — and bootstrap the same configuration, so they vote and a
// leader is elected. Before, they took it for an existing cluster, did not bootstrap, and,
// with no state, refused every vote while recovering: no leader ever (make test -race, once).
func TestBootstrapWhenOneMemberBootstrappedFirst(t *testing.T) {
	cluster.SetBootstrapHold(func(id string) time.Duration {
		if strings.HasSuffix(id, "0") {
			return 0
		}
		return 1500 * time.Millisecond
	})
	t.Cleanup(func() { cluster.SetBootstrapHold(nil) })
	c := clustertest.Start(t, 3, newCounterFSM)
	li := c.WaitLeader(leaderTimeout)
	add(t, c.Node(li), 1)
}
