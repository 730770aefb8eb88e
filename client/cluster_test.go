package client

// Tests against a real in-process 3-node quotad cluster: rpc agents (gRPC API, group commit,
// forwarding) over cluster nodes (hashicorp/raft, BoltDB, fsync) and the real FSM.

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc"
)

const testLimits = `
domain: fixed
rate_limit: {unit: year, requests_per_unit: 1, burst: 5000}
---
domain: small
rate_limit: {unit: year, requests_per_unit: 1, burst: 10}
---
domain: paced
rate_limit: {unit: second, requests_per_unit: 20, burst: 1}
---
domain: slow
rate_limit: {unit: second, requests_per_unit: 2, burst: 1}
---
domain: bench
rate_limit: {unit: second, requests_per_unit: 100000000, burst: 100000000}
---
domain: slots
concurrency: {max_in_flight: 1, lease_ttl: 1s}
`

type testCluster struct {
	t      testing.TB
	agents []*rpc.Agent // nil once killed
}

// startCluster starts three agents that bootstrap one cluster with testLimits and waits
// until one of them leads with the limits applied.
func startCluster(t *testing.T) *testCluster { return startClusterB(t) }

// startClusterB is startCluster for tests and benchmarks.
func startClusterB(t testing.TB) *testCluster {
	t.Helper()
	limits := filepath.Join(t.TempDir(), "limits.yaml")
	if err := os.WriteFile(limits, []byte(testLimits), 0o644); err != nil {
		t.Fatal(err)
	}
	tc := &testCluster{t: t}
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	if os.Getenv("QUOTAD_TEST_LOG") == "stderr" {
		logger = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	for i := range 3 {
		cc := clustertest.TestConfig(t, "node"+string(rune('0'+i)))
		cc.BootstrapExpect = 3
		cc.GRPCAddr = "127.0.0.1:0"
		cc.Logger = logger
		if i > 0 {
			cc.Join = []string{tc.agents[0].Node().GossipAddr()}
		}
		a, err := rpc.StartAgent(rpc.AgentConfig{Cluster: cc, LimitsFile: limits})
		if err != nil {
			t.Fatalf("start node%d: %v", i, err)
		}
		tc.agents = append(tc.agents, a)
	}
	t.Cleanup(func() {
		for _, a := range tc.agents {
			if a != nil {
				a.Stop()
			}
		}
	})
	clustertest.Eventually(t, 30*time.Second, func() error {
		i := tc.leader()
		if i < 0 {
			return errNoLeader
		}
		if tc.agents[i].FSM().Limits().Version == 0 {
			return errNoLimits
		}
		return nil
	})
	return tc
}

type testErr string

func (e testErr) Error() string { return string(e) }

const (
	errNoLeader = testErr("no leader yet")
	errNoLimits = testErr("limits not applied yet")
)

// leader returns the index of the running agent that leads, or -1.
func (tc *testCluster) leader() int {
	for i, a := range tc.agents {
		if a != nil && a.Node().IsLeader() {
			return i
		}
	}
	return -1
}

func (tc *testCluster) addrs() []string {
	var out []string
	for _, a := range tc.agents {
		if a != nil {
			out = append(out, a.GRPCAddr())
		}
	}
	return out
}

// kill crashes agent i: its Raft node stops as in a crash (no leadership transfer, no gossip
// leave), then its gRPC server goes away.
func (tc *testCluster) kill(i int) {
	tc.t.Helper()
	a := tc.agents[i]
	tc.agents[i] = nil
	if err := a.Node().Kill(); err != nil {
		tc.t.Logf("kill node%d: %v", i, err)
	}
	go a.Stop() // closes the listener; the node is already dead
}

func newTestClient(t testing.TB, addrs []string, mutate func(*Config)) *Client {
	t.Helper()
	cfg := Config{Addrs: addrs}
	if mutate != nil {
		mutate(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func testingProcs() int { return runtime.GOMAXPROCS(0) }
