package main

import (
	"strings"
	"testing"

	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/rpc"
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

// TestRegionNameRefused: `quotad agent --region 'bad name!'` stops before anything connects,
// naming the value and the rule (user trial: it was accepted and reached metric labels).
func TestRegionNameRefused(t *testing.T) {
	r := regionFlags{name: "bad name!", addrs: "127.0.0.1:7101", insecure: true, followLeader: true}
	var cfg rpc.AgentConfig
	err := r.apply(&cfg)
	if err == nil || !strings.Contains(err.Error(), `--region: region name "bad name!" is not allowed`) || cfg.Region != nil {
		t.Fatalf("--region 'bad name!': %v (region config %v), want it refused", err, cfg.Region)
	}
	r.name = "eu-west-1"
	if err := r.apply(&cfg); err != nil || cfg.Region == nil || cfg.Region.Name != "eu-west-1" {
		t.Fatalf("--region eu-west-1: %v", err)
	}
}

// TestTransferLeadershipEmptyTo: an explicitly empty --to is refused naming the flag (it was
// taken as "no --to": raft picked a voter the operator did not ask for). It fails before
// dialing: --addr names a port nothing listens on.
func TestTransferLeadershipEmptyTo(t *testing.T) {
	for _, to := range []string{"", "  "} {
		cmd := operatorCmd()
		cmd.SetArgs([]string{"transfer-leadership", "--to", to, "--addr", "127.0.0.1:1"})
		cmd.SilenceUsage, cmd.SilenceErrors = true, true
		if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), "--to") || !strings.Contains(err.Error(), "is empty") {
			t.Fatalf("transfer-leadership --to %q: %v, want it refused naming --to", to, err)
		}
	}
}
