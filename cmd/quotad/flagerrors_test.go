package main

import (
	"strings"
	"testing"

	"github.com/quotad/quotad/cluster"
)

// TestJoinErrorNamesFlag: a bad --join element is reported as --join, quoting the element,
// not as the Go field Join[0] (user trial: `quotad agent --join bogus`).
func TestJoinErrorNamesFlag(t *testing.T) {
	cc := cluster.DefaultConfig()
	cc.ID, cc.DataDir, cc.RaftAddr, cc.GossipAddr, cc.Insecure = "n1", t.TempDir(), "127.0.0.1:7201", "127.0.0.1:7301", true
	cc.Join = []string{"127.0.0.1:7302", "bogus"}
	err := cc.Validate()
	if err == nil {
		t.Fatal("Validate accepted --join bogus")
	}
	got := flagNames(err).Error()
	if !strings.HasPrefix(got, `--join "bogus" is not host:port`) || strings.Contains(got, "Join[") {
		t.Fatalf("flagNames(%q) = %q, want it to start --join \"bogus\" is not host:port", err, got)
	}
	// Fields whose names start like a mapped one are left alone (JoinRetryMin has no flag).
	cc.Join, cc.JoinRetryMin = nil, -1
	if got := flagNames(cc.Validate()).Error(); !strings.HasPrefix(got, "JoinRetryMin -1ns") {
		t.Fatalf("JoinRetryMin: %q", got)
	}
}
