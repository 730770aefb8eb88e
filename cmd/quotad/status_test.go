package main

import (
	"strings"
	"testing"
)

// TestStatusColumnsAlign: every column of `quotad status` starts at the same offset on every
// line, also when a node is "unreachable" (wider than the other states; user trial: its row's
// columns were shifted) or has a long ID.
func TestStatusColumnsAlign(t *testing.T) {
	var b strings.Builder
	err := writeMembers(&b, []statusMember{
		{ID: "node1", State: "leader", Suffrage: "voter", GRPCAddr: "127.0.0.1:7101", RaftAddr: "127.0.0.1:7201", AppliedIndex: 1234, CommandVersion: 7},
		{ID: "node2", State: "unreachable", Suffrage: "voter", GRPCAddr: "127.0.0.1:7102", RaftAddr: "127.0.0.1:7202", AppliedIndex: 12},
		{ID: "r1-node10", State: "follower", Suffrage: "nonvoter", GRPCAddr: "10.0.0.3:7103", RaftAddr: "10.0.0.3:7203", AppliedIndex: 1234, CommandVersion: 7},
	})
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
	for _, col := range []string{"voter", "grpc=", "raft=", "applied=", "cmd="} {
		at := -1
		for _, l := range lines {
			i := strings.Index(l, " "+col) + 1
			if col == "voter" {
				i = strings.Index(l, "voter")
				if j := strings.Index(l, "nonvoter"); j >= 0 {
					i = j
				}
			}
			if at >= 0 && i != at {
				t.Fatalf("column %q starts at %d and %d:\n%s", col, at, i, b.String())
			}
			at = i
		}
	}
	if !strings.Contains(lines[1], "node2 ") || !strings.Contains(lines[1], " unreachable ") || !strings.Contains(lines[1], " cmd=none") {
		t.Fatalf("unreachable row: %q", lines[1])
	}
}
