package e2e

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// TestTransferToLaggingFollowerRetried: a leadership transfer whose target does not answer
// within raft's one attempt (ElectionTimeout, 400 ms: a follower that lags after a burst, or
// a loaded machine — the flakes of TestStreamUnreadStillRechecked/transfer and
// TestClusterStreamLeaderChange/transfer under -race) is made again while the leader still
// leads, instead of failing the operator's TransferLeadership with "leadership transfer
// timeout". The target is frozen (SIGSTOP) for the first attempt and thawed as the leader logs
// its retry; the call succeeds and the target leads.
func TestTransferToLaggingFollowerRetried(t *testing.T) {
	c := startCluster(t, 3)
	leader, err := c.WaitLeader(10 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	target := (leader + 1) % 3
	opts, err := c.DialOptions()
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(c.Nodes[leader].GRPCAddr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	logPath := c.Nodes[leader].LogPath
	before, err := os.Stat(logPath)
	if err != nil {
		t.Fatal(err)
	}
	c.Pause(target)
	thawed := make(chan struct{})
	go func() {
		defer close(thawed)
		defer c.Resume(target)
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			b, _ := os.ReadFile(logPath)
			if int64(len(b)) > before.Size() && strings.Contains(string(b[before.Size():]), "leadership transfer attempt failed") {
				return
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	_, err = quotadv1.NewAdminClient(conn).TransferLeadership(ctx, &quotadv1.TransferLeadershipRequest{To: c.Nodes[target].ID})
	took := time.Since(start)
	c.Resume(target)
	<-thawed
	if err != nil {
		t.Fatalf("transfer to %s, frozen for the first attempt: %v after %v; want it tried again once the target answers", c.Nodes[target].ID, err, took)
	}
	now, err := c.WaitLeader(10 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if now != target {
		t.Fatalf("leader after the transfer: %s, want %s", c.Nodes[now].ID, c.Nodes[target].ID)
	}
	t.Logf("transfer to a target frozen for the first attempt took %v", took.Round(time.Millisecond))
}
