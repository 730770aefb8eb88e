package client

// Tests against a real in-process 3-node quotad cluster (rpc/rpctest): rpc agents (gRPC API,
// group commit, forwarding) over cluster nodes (hashicorp/raft, BoltDB, fsync) and the real
// FSM. Only the tests import the server; the package itself imports only api/.

import (
	"runtime"
	"testing"

	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
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
rate_limit: {unit: minute, requests_per_unit: 2, burst: 1}
---
domain: bench
rate_limit: {unit: second, requests_per_unit: 100000000, burst: 100000000}
---
domain: slots
concurrency: {max_in_flight: 1, lease_ttl: 1s}
---
domain: longslots
concurrency: {max_in_flight: 1, lease_ttl: 3s}
`

type testCluster struct {
	*rpctest.Cluster
}

// startCluster starts three agents with testLimits and waits for a leader with the limits.
func startCluster(t *testing.T) *testCluster { return startClusterB(t) }

// startClusterB is startCluster for tests and benchmarks.
func startClusterB(t testing.TB) *testCluster {
	t.Helper()
	return &testCluster{rpctest.Start(t, 3, testLimits)}
}

// leader returns the index of the live agent that leads, or -1.
func (tc *testCluster) leader() int { return tc.Leader() }

// agent returns agent i (nil once killed).
func (tc *testCluster) agent(i int) *rpc.Agent { return tc.Agent(i) }

func (tc *testCluster) addrs() []string { return tc.Addrs() }

// kill crashes agent i: no leadership transfer, connections dropped.
func (tc *testCluster) kill(i int) { tc.Kill(i) }

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

// startShareCluster starts three agents with the share test limits.
func startShareCluster(t testing.TB) *rpctest.Cluster {
	t.Helper()
	return rpctest.Start(t, 3, shareTestLimits)
}
