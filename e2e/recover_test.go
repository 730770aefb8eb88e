package e2e

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"
)

// TestRecoverLostMajority runs `quotad recover` on real processes: three agents hold three
// concurrency leases; all die and two lose their data dirs for good. The survivor alone has
// no leader; after `quotad recover` names it the only voter it leads again with the three
// leases still held (state kept), and a replacement node joins.
func TestRecoverLostMajority(t *testing.T) {
	c := startClusterWith(t, 3, snapshotLimits)
	l, err := c.WaitLeader(30 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	for i := range 3 {
		if d, err := acquireOn(ctx, dialNode(t, c, l), "recover-test", uint64(100+i), 1, "endpoint=reports"); err != nil || !d.Admitted {
			t.Fatalf("lease %d: %v %v", i, d, err)
		}
	}
	// A follower survives; wait until it has applied what the leader has (the leases).
	s := (l + 1) % 3
	ls, err := c.State(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	for {
		fs, err := c.State(ctx, s)
		if err == nil && fs.AppliedIndex >= ls.AppliedIndex {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("follower %d never applied index %d: %+v %v", s, ls.AppliedIndex, fs, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	c.KillAll()
	for i := range 3 {
		if i != s {
			if err := os.RemoveAll(c.Nodes[i].DataDir); err != nil {
				t.Fatal(err)
			}
		}
	}
	dir := c.Nodes[s].DataDir

	out, err := runCLI(t, c, "recover", "--data-dir", dir, "--dry-run", "--json")
	if err != nil {
		t.Fatalf("recover --dry-run: %v\n%s", err, out)
	}
	var st struct {
		NodeID    string            `json:"node_id"`
		LastIndex uint64            `json:"last_index"`
		Servers   []json.RawMessage `json:"servers"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil || st.NodeID != c.Nodes[s].ID || st.LastIndex == 0 || len(st.Servers) != 3 {
		t.Fatalf("recover --dry-run printed %s (%v); want node %s with a log and 3 servers", out, err, c.Nodes[s].ID)
	}
	if out, err := runCLI(t, c, "recover", "--data-dir", dir, "--voter", "node9=127.0.0.1:1"); err == nil || !strings.Contains(out, c.Nodes[s].ID) {
		t.Fatalf("recover without the node itself: %v\n%s", err, out)
	}
	if out, err := runCLI(t, c, "recover", "--data-dir", dir, "--voter", c.Nodes[s].ID+"="+c.Nodes[s].RaftAddr); err != nil || !strings.Contains(out, "recovered") {
		t.Fatalf("recover: %v\n%s", err, out)
	}

	if err := c.Start(s); err != nil {
		t.Fatal(err)
	}
	if nl, err := c.WaitLeader(30 * time.Second); err != nil || nl != s {
		t.Fatalf("leader after recovery: node %d, %v; want the survivor %d", nl, err, s)
	}
	conn := dialNode(t, c, s)
	// max_in_flight 4 with the three leases still held: one more, then refused.
	if d, err := acquireOn(ctx, conn, "recover-test", 200, 1, "endpoint=reports"); err != nil || !d.Admitted {
		t.Fatalf("4th lease after recovery: %v %v", d, err)
	}
	if d, err := acquireOn(ctx, conn, "recover-test", 201, 1, "endpoint=reports"); err != nil || d.Admitted {
		t.Fatalf("5th lease after recovery admitted (%v, %v): the recovered state lost the leases", d, err)
	}

	// A replacement node (empty data dir) joins and becomes a voter.
	r, err := c.AddNode()
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, err := runCLI(t, c, "status", "--json", "--addr", c.Nodes[s].GRPCAddr)
		if err == nil && strings.Count(out, `"suffrage": "voter"`)+strings.Count(out, `"suffrage":"voter"`) == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("replacement node %s never became a voter:\n%s %v", c.Nodes[r].ID, out, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}
