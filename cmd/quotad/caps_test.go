package main

import (
	"strings"
	"testing"
	"time"

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

// TestStreamFlags: --max-streams-per-identity and --stream-send-timeout reach the agent config
// with their defaults, and values that would turn them off are refused naming the flag.
func TestStreamFlags(t *testing.T) {
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
	cfg, err := parse()
	if err != nil || cfg.MaxStreamsPerIdentity != rpc.DefaultMaxStreamsPerIdentity || cfg.StreamSendTimeout != rpc.DefaultStreamSendTimeout {
		t.Fatalf("defaults: %d %v %v", cfg.MaxStreamsPerIdentity, cfg.StreamSendTimeout, err)
	}
	if cfg, err := parse("--max-streams-per-identity", "3", "--stream-send-timeout", "10s"); err != nil || cfg.MaxStreamsPerIdentity != 3 || cfg.StreamSendTimeout != 10*time.Second {
		t.Fatalf("set: %d %v %v", cfg.MaxStreamsPerIdentity, cfg.StreamSendTimeout, err)
	}
	for _, bad := range [][]string{{"--max-streams-per-identity", "0"}, {"--stream-send-timeout", "100ms"}} {
		if _, err := parse(bad...); err == nil || !strings.Contains(err.Error(), bad[0]+" "+bad[1]) {
			t.Fatalf("%v: %v, want a refusal naming the flag and value", bad, err)
		}
	}
}
