// Package rpctest starts in-process quotad clusters of full agents (Raft node, FSM, gRPC API,
// HTTP endpoints) for tests of the API, the client library and the chaos checkers: real Raft,
// real BoltDB files, real gRPC over loopback. Helpers poll conditions; they never sleep for a
// fixed time to "let things settle".
//
// A Cluster's methods must be called from the test goroutine (they may call t.Fatal).
package rpctest

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/internal/testports"
	"github.com/quotad/quotad/rpc"
)

// Cluster is n agents named node0..node{n-1}. Agent i keeps its addresses and data dir across
// Kill/Stop and Restart, so a client's address list stays valid.
type Cluster struct {
	t      testing.TB
	closed atomic.Bool
	cfgs   []rpc.AgentConfig
	agents []*rpc.Agent
}

// Option adjusts agent i's configuration before every start.
type Option func(i int, c *rpc.AgentConfig)

// Start starts n agents that form a cluster with the limits in limitsYAML (may be empty) and
// waits until they have a leader and the limits are applied.
func Start(t testing.TB, n int, limitsYAML string, opts ...Option) *Cluster {
	t.Helper()
	c := &Cluster{t: t}
	var limitsFile string
	if limitsYAML != "" {
		limitsFile = filepath.Join(t.TempDir(), "limits.yaml")
		if err := os.WriteFile(limitsFile, []byte(limitsYAML), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for i := range n {
		cc := clustertest.TestConfig(t, fmt.Sprintf("node%d", i))
		cc.BootstrapExpect = n
		// Ports of its own, not port 0: Restart binds them again after a kill, and a port the
		// kernel chose for :0 it also hands to other listeners and outgoing connections in
		// between (CI: "starting node0: raft transport on 127.0.0.1:46641: bind: address
		// already in use").
		ports, err := testports.Reserve(4)
		if err != nil {
			t.Fatalf("rpctest: %v", err)
		}
		a := func(p int) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(p)) }
		cc.GRPCAddr, cc.HTTPAddr, cc.RaftAddr, cc.GossipAddr = a(ports[0]), a(ports[1]), a(ports[2]), a(ports[3])
		// Plaintext and debug endpoints on: the API tests; a test of security turns them off.
		cfg := rpc.AgentConfig{Cluster: cc, LimitsFile: limitsFile, Insecure: true, EnableDebug: true}
		for _, o := range opts {
			o(i, &cfg)
		}
		c.cfgs = append(c.cfgs, cfg)
		c.agents = append(c.agents, nil)
	}
	// Registered after the temp dirs so it runs before they are removed.
	t.Cleanup(c.Close)
	for i := range n {
		c.start(i)
	}
	c.WaitLeader(10 * time.Second)
	if limitsFile != "" {
		clustertest.Eventually(t, 10*time.Second, func() error {
			for i, a := range c.agents {
				if v := a.FSM().Limits().Version; v == 0 {
					return fmt.Errorf("node%d has no limits yet", i)
				}
			}
			return nil
		})
	}
	return c
}

func (c *Cluster) start(i int) {
	c.t.Helper()
	cfg := c.cfgs[i]
	cfg.Cluster.Join = nil
	for j, a := range c.agents {
		if j != i && a != nil {
			cfg.Cluster.Join = append(cfg.Cluster.Join, a.Node().GossipAddr())
		}
	}
	if cfg.Cluster.Logger == nil {
		cfg.Cluster.Logger = slog.New(slog.NewTextHandler(logWriter{c}, &slog.HandlerOptions{Level: slog.LevelWarn})).With("node", cfg.Cluster.ID)
	}
	a, err := clustertest.StartRetryingInUse(func() (*rpc.Agent, error) { return rpc.StartAgent(cfg) })
	if err != nil {
		c.t.Fatalf("starting %s: %v", cfg.Cluster.ID, err)
	}
	// Keep the ports the OS chose so a restart comes back on the same addresses.
	c.cfgs[i].Cluster.GRPCAddr = a.GRPCAddr()
	c.cfgs[i].Cluster.HTTPAddr = a.HTTPAddr()
	c.cfgs[i].Cluster.RaftAddr = a.Node().RaftAddr()
	c.cfgs[i].Cluster.GossipAddr = a.Node().GossipAddr()
	c.agents[i] = a
}

// logWriter sends node logs to the test log (shown on failure or with -v), and drops them once
// the cluster is closed (testing panics on logs after a test ends).
type logWriter struct{ c *Cluster }

func (w logWriter) Write(p []byte) (int, error) {
	if !w.c.closed.Load() {
		w.c.t.Log(string(p))
	}
	return len(p), nil
}

// Len returns the number of agents, live or not.
func (c *Cluster) Len() int { return len(c.agents) }

// Agent returns agent i, or nil while it is stopped.
func (c *Cluster) Agent(i int) *rpc.Agent { return c.agents[i] }

// Addrs returns every agent's gRPC address, live or not (what a client is configured with).
func (c *Cluster) Addrs() []string {
	out := make([]string, len(c.cfgs))
	for i, cfg := range c.cfgs {
		out[i] = cfg.Cluster.GRPCAddr
	}
	return out
}

// Leader returns the index of the live agent that leads, or -1.
func (c *Cluster) Leader() int {
	for i, a := range c.agents {
		if a != nil && a.Node().IsLeader() {
			if _, err := a.Node().Now(); err == nil {
				return i
			}
		}
	}
	return -1
}

// WaitLeader waits until a live agent leads (and can stamp time) and returns its index.
func (c *Cluster) WaitLeader(timeout time.Duration) int {
	c.t.Helper()
	leader := -1
	clustertest.Eventually(c.t, timeout, func() error {
		if leader = c.Leader(); leader < 0 {
			return fmt.Errorf("no leader")
		}
		return nil
	})
	return leader
}

// Kill crashes agent i (no graceful handover).
func (c *Cluster) Kill(i int) {
	c.t.Helper()
	if a := c.agents[i]; a != nil {
		c.agents[i] = nil
		_ = a.Kill()
	}
}

// Stop shuts agent i down gracefully.
func (c *Cluster) Stop(i int) {
	c.t.Helper()
	if a := c.agents[i]; a != nil {
		c.agents[i] = nil
		if err := a.Stop(); err != nil {
			c.t.Logf("stopping node%d: %v", i, err)
		}
	}
}

// Restart starts a stopped agent i again from its data dir on its old addresses.
func (c *Cluster) Restart(i int) {
	c.t.Helper()
	if c.agents[i] != nil {
		c.t.Fatalf("node%d is running", i)
	}
	c.start(i)
}

// Reconfigure applies o to agent i's configuration for its next Restart (say, another build's
// advertised command version).
func (c *Cluster) Reconfigure(i int, o Option) { o(i, &c.cfgs[i]) }

// Close stops every live agent.
func (c *Cluster) Close() {
	for i := range c.agents {
		if a := c.agents[i]; a != nil {
			c.agents[i] = nil
			_ = a.Kill()
		}
	}
	c.closed.Store(true)
}

// ClusterConfig returns agent i's cluster configuration as last started.
func (c *Cluster) ClusterConfig(i int) cluster.Config { return c.cfgs[i].Cluster }

// Secure is an Option that runs every agent in secure mode with creds: its own node
// certificate (named after the node), the cluster's CA, the gossip key and the bootstrap
// admin token, debug endpoints off.
func Secure(t testing.TB, creds *pkifiles.Local) Option {
	keyB64, err := pkifiles.ReadSecret(creds.GossipKeyFile)
	if err != nil {
		t.Fatal(err)
	}
	key, err := auth.DecodeGossipKey(keyB64)
	if err != nil {
		t.Fatal(err)
	}
	return func(_ int, cfg *rpc.AgentConfig) {
		cert, certKey, err := creds.ServerCert(cfg.Cluster.ID)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Insecure, cfg.EnableDebug = false, false
		cfg.ClusterName = creds.Cluster
		cfg.TLS = rpc.TLSFiles{CertFile: cert, KeyFile: certKey, CAFile: creds.CAFile}
		cfg.Cluster.GossipSecretKey = key
		cfg.BootstrapTokenFile = creds.TokenFile
	}
}
