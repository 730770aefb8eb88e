package chaos

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// envConfig reads the run's knobs from the environment (the Makefile targets set them):
//
//	QUOTAD_CHAOS=1                  enable the real-process run (otherwise TestChaos skips)
//	QUOTAD_CHAOS_SEED=N             reproduce a run
//	QUOTAD_CHAOS_DURATION=4m        fault period
//	QUOTAD_CHAOS_NODES=3            3 or 5
//	QUOTAD_CHAOS_FLOOR=100          decisions/s required before the first fault
//	QUOTAD_CHAOS_REQUIRE_ALL=1      fail unless every fault kind was injected
//	QUOTAD_CHAOS_OUT=out            output directory (relative to chaos/)
//	QUOTAD_CHAOS_ONLY=kill-leader,… restrict the nemesis to these faults
//	QUOTAD_CHAOS_AGENT_ARGS="--raft-log-store wal"  more agent flags for every node
//	QUOTAD_CHAOS_HOLDER_TAGS=chaos_bug_holderexpiry  build tags of the shares holder only
func envConfig(t *testing.T) Config {
	cfg := DefaultConfig()
	cfg.Log = func(f string, a ...any) { t.Logf(f, a...) }
	if v := os.Getenv("QUOTAD_CHAOS_SEED"); v != "" {
		s, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			t.Fatalf("QUOTAD_CHAOS_SEED=%q: %v", v, err)
		}
		cfg.Seed = s
	}
	if v := os.Getenv("QUOTAD_CHAOS_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("QUOTAD_CHAOS_DURATION=%q: %v", v, err)
		}
		cfg.Duration = d
	}
	if v := os.Getenv("QUOTAD_CHAOS_NODES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || (n != 3 && n != 5) {
			t.Fatalf("QUOTAD_CHAOS_NODES=%q: want 3 or 5", v)
		}
		cfg.Nodes = n
	}
	if v := os.Getenv("QUOTAD_CHAOS_FLOOR"); v != "" {
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			t.Fatalf("QUOTAD_CHAOS_FLOOR=%q: %v", v, err)
		}
		cfg.Floor = f
	}
	if v := os.Getenv("QUOTAD_CHAOS_OUT"); v != "" {
		cfg.OutDir = v
	}
	if v := os.Getenv("QUOTAD_CHAOS_ONLY"); v != "" {
		cfg.Nemesis.Only = strings.Split(v, ",")
	}
	if v := os.Getenv("QUOTAD_CHAOS_AGENT_ARGS"); v != "" {
		cfg.AgentArgs = strings.Fields(v)
	}
	if v := os.Getenv("QUOTAD_CHAOS_HOLDER_TAGS"); v != "" {
		cfg.HolderTags = splitTags(v)
	}
	if v := os.Getenv("QUOTAD_CHAOS_BINARY"); v != "" {
		cfg.BinaryPath = v
	}
	return cfg
}

// TestChaos is the real-process chaos run (make chaos / make chaos-long).
func TestChaos(t *testing.T) {
	if os.Getenv("QUOTAD_CHAOS") != "1" {
		t.Skip("set QUOTAD_CHAOS=1 to run the chaos suite against real quotad processes (make chaos)")
	}
	runAndReport(t, envConfig(t))
}

// runAndReport runs cfg, prints the summary and fails on anomalies (and, with
// QUOTAD_CHAOS_REQUIRE_ALL=1, on fault kinds never injected).
func runAndReport(t *testing.T, cfg Config) {
	t.Helper()
	start := time.Now()
	rep := runLogged(t, cfg)
	t.Logf("wall time %v", time.Since(start).Round(time.Second))
	t.Logf("seed %d: %d ops; unknown outcomes created %d %v: resolved by re-send %d, left ambiguous %d (%d never re-sent on purpose); faults %v; %d anomalies",
		rep.Seed, rep.Ops, rep.UnknownOutcomes, rep.UnknownCauses, rep.ResolvedOutcomes, rep.AmbiguousOutcomes, rep.NotResent, rep.Faults, rep.Anomalies)
	if !rep.OK {
		t.Errorf("seed %d: %d anomalies; history, node logs and porcupine visualizations are in %s", rep.Seed, rep.Anomalies, cfg.OutDir)
	}
	if os.Getenv("QUOTAD_CHAOS_REQUIRE_ALL") == "1" && len(rep.Missing) > 0 {
		t.Errorf("seed %d: fault kinds never injected: %v", rep.Seed, rep.Missing)
	}
}

// runLogged runs the suite with cfg (bounded by its duration plus time to check) and logs the
// summary table.
func runLogged(t *testing.T, cfg Config) *Report {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Duration+8*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatalf("seed %d: %v", cfg.Seed, err)
	}
	var sb strings.Builder
	PrintSummary(&sb, rep)
	t.Log("\n" + sb.String())
	return rep
}

// TestChaosDocker is the same run with one container per node (make chaos-docker): an image
// FROM scratch with the static chaos binary, a private network with fixed addresses,
// partitions by `docker network disconnect`, pauses by `docker pause`, kills by `docker kill`.
func TestChaosDocker(t *testing.T) {
	if os.Getenv("QUOTAD_CHAOS") != "1" {
		t.Skip("set QUOTAD_CHAOS=1 to run the chaos suite in Docker containers (make chaos-docker)")
	}
	if ok, why := DockerAvailable(); !ok {
		t.Skipf("Docker is not available: %s", why)
	}
	CleanupDocker() // whatever a killed earlier run left behind
	t.Cleanup(CleanupDocker)
	cfg := envConfig(t)
	cfg.Docker = true
	cfg.OutDir = filepath.Join(cfg.OutDir, "docker")
	runAndReport(t, cfg)
}
