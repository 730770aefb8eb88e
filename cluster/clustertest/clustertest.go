// Package clustertest starts in-process quotad clusters for tests: real Raft, real BoltDB
// files in t.TempDir(), real TCP and gossip on 127.0.0.1 with OS-assigned ports. Tests of
// cluster, rpc and the chaos suite share it (like raft's MakeCluster). It never sleeps for
// fixed times: helpers poll a condition until a deadline.
//
// A Cluster's methods must be called from the test goroutine (they may call t.Fatal).
package clustertest

import (
	"crypto/rand"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/internal/testpki"
	"github.com/quotad/quotad/internal/testports"
)

// Cluster is a set of in-process nodes named node0, node1, ... Node i may be stopped
// (Kill, Stop) and restarted from its data dir (Restart).
type Cluster struct {
	t         testing.TB
	newFSM    func() cluster.FSM
	configure func(i int, c *cluster.Config)
	logOut    *guardedWriter

	mu    sync.Mutex
	nodes []*slot
}

type slot struct {
	cfg  cluster.Config // as last started, with the actual addresses
	node *cluster.Node  // nil while stopped
	fsm  cluster.FSM
}

// Option customizes Start.
type Option func(*Cluster)

// WithConfig lets a test adjust node i's Config (timeouts, MinVoters, Clock, ...) before
// it starts, and again at every restart.
func WithConfig(f func(i int, c *cluster.Config)) Option {
	return func(c *Cluster) { c.configure = f }
}

// TestConfig returns DefaultConfig with loopback addresses on port 0, a fresh data dir and
// faster membership timings, so tests finish quickly. Raft timeouts stay the production
// defaults so failover tests measure what production gets. Peers are secured as in
// production: mutual TLS with a server certificate of the test CA (PKI) and a gossip key.
func TestConfig(t testing.TB, id string) cluster.Config {
	p := PKI(t)
	c := cluster.DefaultConfig()
	c.PeerTLS = p.PeerTLS.Clone()
	c.GossipSecretKey = append([]byte(nil), p.GossipKey...)
	c.ID = id
	c.DataDir = t.TempDir()
	c.RaftAddr = "127.0.0.1:0"
	c.GossipAddr = "127.0.0.1:0"
	// GRPCAddr and HTTPAddr are only advertised; rpc tests set them with WithConfig.
	c.ReconcileInterval = 200 * time.Millisecond
	c.MetaInterval = 100 * time.Millisecond
	c.PromoteStableFor = 500 * time.Millisecond
	c.DeadNodeTimeout = 2 * time.Second
	c.JoinRetryMin = 50 * time.Millisecond
	c.JoinRetryMax = 500 * time.Millisecond
	return c
}

// TestPKI is the test process's cluster CA, a server certificate of cluster "quotad", the
// peer TLS configuration built from it and a gossip key.
type TestPKI struct {
	CA        *testpki.CA
	Server    testpki.Pair
	PeerTLS   *tls.Config
	GossipKey []byte
}

var (
	pkiOnce sync.Once
	pki     *TestPKI
	pkiErr  error
)

// PKI returns the test process's TestPKI, made on first use (one CA per process: generating
// keys per node would cost more than many tests).
func PKI(t testing.TB) *TestPKI {
	t.Helper()
	pkiOnce.Do(func() {
		ca, err := testpki.NewCA("quotad test CA")
		if err != nil {
			pkiErr = err
			return
		}
		srv, err := ca.Server("quotad", "test-server")
		if err != nil {
			pkiErr = err
			return
		}
		peerTLS, err := auth.PeerTLSConfigFromPEM(srv.CertPEM, srv.KeyPEM, ca.PEM, "quotad")
		if err != nil {
			pkiErr = err
			return
		}
		key := make([]byte, 32)
		if _, err := rand.Read(key); err != nil {
			pkiErr = err
			return
		}
		pki = &TestPKI{CA: ca, Server: srv, PeerTLS: peerTLS, GossipKey: key}
	})
	if pkiErr != nil {
		t.Fatalf("clustertest: test PKI: %v", pkiErr)
	}
	return pki
}

// Start starts n nodes that form a new cluster through BootstrapExpect=n and gossip join,
// and registers a cleanup that shuts them all down. It does not wait for a leader: call
// WaitLeader.
func Start(t testing.TB, n int, newFSM func() cluster.FSM, opts ...Option) *Cluster {
	t.Helper()
	c := &Cluster{t: t, newFSM: newFSM, logOut: &guardedWriter{w: testOutput(t)}}
	for _, o := range opts {
		o(c)
	}
	// The data dirs first, Close's cleanup after them: cleanups run last-registered first, so
	// the nodes stop before their dirs are removed. The other way round a running node wrote
	// into a dir being removed (CI: "TempDir RemoveAll cleanup: unlinkat …/002: directory not
	// empty" in TestFormApplyFollowerRejects).
	for i := range n {
		cfg := TestConfig(t, fmt.Sprintf("node%d", i))
		cfg.BootstrapExpect = n
		reserveAddrs(t, &cfg)
		c.nodes = append(c.nodes, &slot{cfg: cfg})
	}
	t.Cleanup(c.Close)
	for i := range n {
		c.start(i, false)
	}
	return c
}

// testOutput is where node logs go: the test's output (shown on failure or with -v), or
// stderr if QUOTAD_TEST_LOG=stderr.
func testOutput(t testing.TB) io.Writer {
	if os.Getenv("QUOTAD_TEST_LOG") == "stderr" {
		return os.Stderr
	}
	return t.Output()
}

func logLevel() slog.Level {
	var l slog.Level
	if err := l.UnmarshalText([]byte(os.Getenv("QUOTAD_TEST_LOG_LEVEL"))); err != nil {
		return slog.LevelInfo
	}
	return l
}

// reserveAddrs gives a node of a Cluster Raft and gossip ports of its own (testports) instead
// of port 0: Restart binds them again after a kill, and a port the kernel chose for :0 is one
// it also hands to other listeners and to outgoing connections in between (CI: "raft
// transport on 127.0.0.1:46641: bind: address already in use" at a restart).
func reserveAddrs(t testing.TB, cfg *cluster.Config) {
	t.Helper()
	ports, err := testports.Reserve(2)
	if err != nil {
		t.Fatalf("clustertest: %v", err)
	}
	cfg.RaftAddr = net.JoinHostPort("127.0.0.1", fmt.Sprint(ports[0]))
	cfg.GossipAddr = net.JoinHostPort("127.0.0.1", fmt.Sprint(ports[1]))
}

// StartRetryingInUse calls start until it returns an error other than "address already in
// use", or until 10 s passed: a restarted node's port may still be held for a moment by
// something the reservation does not cover (a program outside this module's tests).
func StartRetryingInUse[T any](start func() (T, error)) (T, error) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		v, err := start()
		if !testports.InUse(err) || time.Now().After(deadline) {
			return v, err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// start (re)starts node i from its slot's config, on its previous addresses or, with
// newAddrs, on new reserved ports.
func (c *Cluster) start(i int, newAddrs bool) {
	c.t.Helper()
	s := c.nodes[i]
	cfg := s.cfg
	if newAddrs {
		reserveAddrs(c.t, &cfg)
	}
	cfg.Join = nil
	for j, o := range c.nodes {
		if j != i && o.node != nil {
			cfg.Join = append(cfg.Join, o.node.GossipAddr())
		}
	}
	cfg.Logger = slog.New(slog.NewTextHandler(c.logOut, &slog.HandlerOptions{Level: logLevel()})).With("node", cfg.ID)
	if c.configure != nil {
		c.configure(i, &cfg)
	}
	var f cluster.FSM
	node, err := StartRetryingInUse(func() (*cluster.Node, error) {
		f = c.newFSM()
		return cluster.NewNode(cfg, f)
	})
	if err != nil {
		c.t.Fatalf("start %s: %v", cfg.ID, err)
	}
	cfg.RaftAddr, cfg.GossipAddr = node.RaftAddr(), node.GossipAddr()
	c.mu.Lock()
	s.cfg, s.node, s.fsm = cfg, node, f
	c.mu.Unlock()
}

// Len returns the number of node slots (running or not).
func (c *Cluster) Len() int { return len(c.nodes) }

// Node returns node i, or nil while it is stopped.
func (c *Cluster) Node(i int) *cluster.Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[i].node
}

// FSM returns the FSM node i runs (or last ran).
func (c *Cluster) FSM(i int) cluster.FSM {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[i].fsm
}

// Config returns node i's config as last started (actual addresses filled in).
func (c *Cluster) Config(i int) cluster.Config {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[i].cfg
}

// Leader returns the index of a running node that is the established leader, or -1.
func (c *Cluster) Leader() int {
	for i := range c.nodes {
		if n := c.Node(i); n != nil && n.IsLeader() {
			return i
		}
	}
	return -1
}

// WaitLeader waits until a running node is the established leader (Now works) and
// returns its index. It fails the test after timeout.
func (c *Cluster) WaitLeader(timeout time.Duration) int {
	c.t.Helper()
	leader := -1
	Eventually(c.t, timeout, func() error {
		if leader = c.Leader(); leader < 0 {
			return fmt.Errorf("no established leader among running nodes")
		}
		return nil
	})
	return leader
}

// Kill stops node i as a crash would (no leadership transfer, no gossip leave).
func (c *Cluster) Kill(i int) {
	c.t.Helper()
	c.stop(i, false)
}

// Stop shuts node i down gracefully (Node.Shutdown).
func (c *Cluster) Stop(i int) {
	c.t.Helper()
	c.stop(i, true)
}

func (c *Cluster) stop(i int, graceful bool) {
	c.t.Helper()
	c.mu.Lock()
	n := c.nodes[i].node
	c.nodes[i].node = nil
	c.mu.Unlock()
	if n == nil {
		c.t.Fatalf("node%d is not running", i)
	}
	var err error
	if graceful {
		err = n.Shutdown()
	} else {
		err = n.Kill()
	}
	if err != nil {
		c.t.Errorf("stop node%d: %v", i, err)
	}
}

// Restart starts stopped node i again from its data dir, on the same addresses, joining
// the running nodes' gossip.
func (c *Cluster) Restart(i int) {
	c.t.Helper()
	if c.Node(i) != nil {
		c.t.Fatalf("node%d is running", i)
	}
	c.start(i, false)
}

// RestartNewAddr restarts stopped node i from its data dir on new ports (same ID).
func (c *Cluster) RestartNewAddr(i int) {
	c.t.Helper()
	if c.Node(i) != nil {
		c.t.Fatalf("node%d is running", i)
	}
	c.start(i, true)
}

// AddNode starts a new node (empty data dir, BootstrapExpect 0) that joins the running
// nodes through gossip, and returns its index. The leader adds it as a non-voter and
// promotes it once caught up.
func (c *Cluster) AddNode() int {
	c.t.Helper()
	i := len(c.nodes)
	cfg := TestConfig(c.t, fmt.Sprintf("node%d", i))
	reserveAddrs(c.t, &cfg)
	c.mu.Lock()
	c.nodes = append(c.nodes, &slot{cfg: cfg})
	c.mu.Unlock()
	// Its data dir's cleanup came after Close's (see Start): stop it first.
	c.t.Cleanup(func() { c.killIfRunning(i) })
	c.start(i, false)
	return i
}

// killIfRunning kills node i if it is running (a cleanup: no test failure if it is not).
func (c *Cluster) killIfRunning(i int) {
	c.mu.Lock()
	n := c.nodes[i].node
	c.nodes[i].node = nil
	c.mu.Unlock()
	if n != nil {
		_ = n.Kill()
	}
}

// Close stops every running node (as Kill does, in parallel: fast) and stops their logging.
// Start registers it with t.Cleanup.
func (c *Cluster) Close() {
	var wg sync.WaitGroup
	for i := range c.nodes {
		c.mu.Lock()
		n := c.nodes[i].node
		c.nodes[i].node = nil
		c.mu.Unlock()
		if n == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = n.Kill()
		}()
	}
	wg.Wait()
	c.logOut.close()
}

// Eventually polls cond every 20 ms until it returns nil, failing the test with cond's last
// error after timeout.
func Eventually(t testing.TB, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %s: %v", timeout, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// guardedWriter drops writes after close: library goroutines may log after a test ended,
// and writing to t.Output then panics.
type guardedWriter struct {
	mu     sync.Mutex
	w      io.Writer
	closed atomic.Bool
}

func (g *guardedWriter) Write(p []byte) (int, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed.Load() {
		return len(p), nil
	}
	return g.w.Write(p)
}

func (g *guardedWriter) close() {
	g.mu.Lock()
	g.closed.Store(true)
	g.mu.Unlock()
}
