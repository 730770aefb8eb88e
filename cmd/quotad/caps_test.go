package main

import (
	"strings"
	"testing"

	"github.com/spf13/pflag"

	"github.com/quotad/quotad/rpc"
)

// TestWaiterFlags: --max-waiters-per-identity reaches the agent config (0: the default, a
// quarter of the domain's cap, chosen by rpc), and a negative value is refused naming it.
func TestWaiterFlags(t *testing.T) {
	parse := func(args ...string) (rpc.AgentConfig, error) {
		c := capFlags{maxRequestBytes: rpc.DefaultMaxRequestBytes}
		f := pflag.NewFlagSet("t", pflag.ContinueOnError)
		c.register(f)
		if err := f.Parse(args); err != nil {
			t.Fatal(err)
		}
		var cfg rpc.AgentConfig
		return cfg, c.apply(&cfg)
	}
	cfg, err := parse("--max-waiters-per-identity", "7")
	if err != nil || cfg.Waiters.PerIdentity != 7 {
		t.Fatalf("--max-waiters-per-identity 7: %+v %v", cfg.Waiters, err)
	}
	if cfg, err := parse(); err != nil || cfg.Waiters.PerIdentity != 0 {
		t.Fatalf("default: %+v %v", cfg.Waiters, err)
	}
	if _, err := parse("--max-waiters-per-identity", "-1"); err == nil || !strings.Contains(err.Error(), "--max-waiters-per-identity -1") {
		t.Fatalf("negative: %v", err)
	}
	if cfg, err := parse(); err != nil || cfg.MaxCallsPerIdentity != rpc.DefaultMaxCallsPerIdentity {
		t.Fatalf("default --max-calls-per-identity: %d %v", cfg.MaxCallsPerIdentity, err)
	}
	if cfg, err := parse("--max-calls-per-identity", "50"); err != nil || cfg.MaxCallsPerIdentity != 50 {
		t.Fatalf("--max-calls-per-identity 50: %d %v", cfg.MaxCallsPerIdentity, err)
	}
	if _, err := parse("--max-calls-per-identity", "0"); err == nil || !strings.Contains(err.Error(), "--max-calls-per-identity 0") {
		t.Fatalf("--max-calls-per-identity 0: %v", err)
	}
	if cfg, err := parse(); err != nil || cfg.MaxWait != rpc.DefaultMaxWait {
		t.Fatalf("default --max-wait: %v %v", cfg.MaxWait, err)
	}
	if _, err := parse("--max-wait", "500ms"); err == nil || !strings.Contains(err.Error(), "--max-wait 500ms") {
		t.Fatalf("--max-wait 500ms: %v", err)
	}
	if got := rpc.DefaultPerIdentity(rpc.DefaultMaxWaitersPerDomain); got != 2500 {
		t.Fatalf("default per identity for 10000 per domain: %d", got)
	}
}
