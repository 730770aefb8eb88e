package rpctest_test

import (
	"net"
	"testing"
	"time"

	"github.com/quotad/quotad/rpc/rpctest"
)

// TestRestartWaitsForItsPort: a killed agent restarts on its old addresses even when one of
// them is still held for a moment (the restart retries "address already in use" instead of
// failing the test), and its addresses are reserved ports, not ones the kernel hands to :0.
func TestRestartWaitsForItsPort(t *testing.T) {
	c := rpctest.Start(t, 1, "")
	raftAddr := c.ClusterConfig(0).RaftAddr
	c.Kill(0)
	l, err := net.Listen("tcp", raftAddr)
	if err != nil {
		t.Fatalf("take the killed node's Raft address %s: %v", raftAddr, err)
	}
	go func() {
		time.Sleep(500 * time.Millisecond)
		l.Close()
	}()
	c.Restart(0)
	if got := c.ClusterConfig(0).RaftAddr; got != raftAddr {
		t.Fatalf("restarted on %s, want its old address %s", got, raftAddr)
	}
	c.WaitLeader(10 * time.Second)
}
