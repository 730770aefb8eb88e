package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/internal/agentconfig"
	"github.com/quotad/quotad/internal/gctune"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/rpc"
)

// pathFlags are the agent flags that take file system paths: a relative one in the --config
// file draws a warning (agentconfig.RelativePaths).
var pathFlags = []string{"data-dir", "limits", "tls-cert", "tls-key", "tls-ca", "gossip-key-file", "bootstrap-token-file",
	"global-cacert", "global-cert", "global-key", "global-token-file"}

func agentCmd() *cobra.Command {
	cc := cluster.DefaultConfig()
	var (
		join       string
		limits     string
		logLevel   string
		logFormat  string
		gcPercent  int
		memLimit   string
		gcHeadroom string
		proposer   = rpc.DefaultProposerConfig()
		caps       = capFlags{maxRequestBytes: rpc.DefaultMaxRequestBytes}
		rls        rlsFlags
		reg        regionFlags
	)
	var (
		acfg          rpc.AgentConfig // security settings; the rest is filled in at run
		gossipKeyFile string
		configFile    string
	)
	cmd := &cobra.Command{
		Use:   "agent",
		Short: "Run a quotad server node",
		Long: `Run one quotad server. Start --bootstrap-expect N nodes that --join each other's gossip
addresses to form a new cluster; a node started later with --join is added as a non-voter and
promoted once caught up. A node restarted with its --data-dir resumes where it stopped.

Every flag can also be set in the --config file (YAML: "data-dir: /var/lib/quotad") or by the
environment variable QUOTAD_<FLAG> ($QUOTAD_DATA_DIR); a flag given on the command line wins
over the environment, which wins over the file (docs/operations.md, "Configuration").`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if configFile == "" {
				configFile = os.Getenv(agentconfig.EnvName(agentconfig.FileFlag))
			}
			if err := agentconfig.Apply(cmd.LocalFlags(), configFile, os.Environ()); err != nil {
				return err
			}
			for _, w := range agentconfig.UnknownEnv(cmd.LocalFlags(), os.Environ(), otherEnv...) {
				fmt.Fprintln(os.Stderr, "quotad: warning: "+w)
			}
			wd, _ := os.Getwd()
			for _, w := range agentconfig.RelativePaths(cmd.LocalFlags(), configFile, wd) {
				fmt.Fprintln(os.Stderr, "quotad: warning: "+w)
			}
			switch {
			case cc.ID == "":
				return fmt.Errorf("--id is required: a unique, stable name for this node, e.g. --id n1")
			case cc.DataDir == "":
				return fmt.Errorf("--data-dir is required: the directory for this node's Raft log and snapshots, e.g. --data-dir /var/lib/quotad")
			}
			level := new(slog.LevelVar)
			if err := level.UnmarshalText([]byte(logLevel)); err != nil {
				return fmt.Errorf("--log-level %q: use debug, info, warn or error", logLevel)
			}
			opts := &slog.HandlerOptions{Level: level}
			var h slog.Handler = slog.NewTextHandler(os.Stderr, opts)
			if logFormat == "json" {
				h = slog.NewJSONHandler(os.Stderr, opts)
			}
			cc.Logger = slog.New(h).With("node", cc.ID)
			cc.Join = splitList(join)
			cc.Clock = nodeClock()
			key, err := gossipKey(gossipKeyFile)
			if err != nil {
				return err
			}
			cc.GossipSecretKey = key
			acfg.GossipKeyFile = gossipKeyFile
			if acfg.BootstrapTokenFile == "" {
				acfg.BootstrapToken = os.Getenv(rpc.EnvBootstrapToken)
			}
			cc.Insecure = acfg.Insecure
			acfg.Cluster, acfg.LimitsFile, acfg.Proposer = cc, limits, proposer
			if err := acfg.CheckSecurity(); err != nil {
				return err
			}
			if err := proposer.Validate(); err != nil {
				return err
			}
			if err := setGC(gcPercent, memLimit, gcHeadroom); err != nil {
				return err
			}
			if err := caps.apply(&acfg); err != nil {
				return err
			}
			if err := rls.apply(&acfg); err != nil {
				return err
			}
			if err := reg.apply(&acfg); err != nil {
				return err
			}
			chaosHooks(&acfg)
			agent, err := rpc.StartAgent(acfg)
			if err != nil {
				return flagNames(err)
			}
			dataDir, _ := filepath.Abs(cc.DataDir)
			cc.Logger.Info("quotad agent started", "grpc", agent.GRPCAddr(), "http", agent.HTTPAddr(), "raft", cc.RaftAddr, "gossip", cc.GossipAddr, "data_dir", dataDir)
			sig := make(chan os.Signal, 1)
			signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
			s := <-sig
			cc.Logger.Info("shutting down", "signal", s.String())
			return agent.Stop()
		},
	}
	f := cmd.Flags()
	f.StringVar(&configFile, agentconfig.FileFlag, "", "YAML file of agent settings, keyed by flag name (or $QUOTAD_CONFIG); flags and $QUOTAD_<FLAG> override it")
	f.StringVar(&cc.ID, "id", "", "unique, stable node ID (required)")
	f.StringVar(&cc.DataDir, "data-dir", "", "directory for the Raft log and snapshots (required)")
	f.StringVar(&cc.GRPCAddr, "grpc-addr", "127.0.0.1:7101", "gRPC API listen address")
	f.StringVar(&cc.RaftAddr, "raft-addr", "127.0.0.1:7201", "Raft transport address (advertised to peers)")
	f.StringVar(&cc.GossipAddr, "gossip-addr", "127.0.0.1:7301", "gossip (memberlist) address")
	f.StringVar(&cc.HTTPAddr, "http-addr", "127.0.0.1:7401", "HTTP address for /metrics, /healthz and, with --enable-debug, /debug/* (empty: off)")
	f.IntVar(&cc.BootstrapExpect, "bootstrap-expect", 0, "number of nodes that form a new cluster (0: join an existing one)")
	f.StringVar(&join, "join", "", "comma-separated gossip addresses of other nodes")
	f.StringVar(&limits, "limits", "", "limits YAML applied if the cluster has none yet")
	f.IntVar(&cc.MinVoters, "min-voters", cc.MinVoters, "dead-node cleanup never leaves fewer voters than this")
	f.DurationVar(&cc.DeadNodeTimeout, "dead-node-timeout", cc.DeadNodeTimeout, "how long a node must be dead before the leader removes it")
	f.DurationVar(&cc.RejoinDelay, "rejoin-delay", cc.RejoinDelay, "how long the leader waits before adding back a node it removed")
	f.Uint64Var(&cc.SnapshotThreshold, "snapshot-threshold", cc.SnapshotThreshold, "log entries since the last snapshot that make the next one due")
	f.DurationVar(&cc.SnapshotInterval, "snapshot-interval", cc.SnapshotInterval, "how often to check whether a snapshot is due")
	f.DurationVar(&cc.HeartbeatTimeout, "raft-heartbeat-timeout", cc.HeartbeatTimeout, "a follower without leader contact for this long starts an election (sets how fast a crashed leader is replaced)")
	f.DurationVar(&cc.ElectionTimeout, "raft-election-timeout", cc.ElectionTimeout, "how long a candidate waits for votes before retrying (>= --raft-heartbeat-timeout)")
	f.DurationVar(&cc.LeaderLeaseTimeout, "raft-leader-lease-timeout", cc.LeaderLeaseTimeout, "a leader that cannot reach a quorum for this long steps down (<= --raft-heartbeat-timeout)")
	f.Uint64Var(&cc.TrailingLogs, "trailing-logs", cc.TrailingLogs, "log entries kept after a snapshot for slow followers")
	f.StringVar(&cc.LogStore, "raft-log-store", cc.LogStore, "Raft log storage: wal (segment files in wal/, one write and one fdatasync per append) or boltdb (raft.db, two fdatasyncs per append); both fsync every append. Unset: the one the data dir was written with, wal for a new data dir. A value the data dir was not written with is refused; to move a node to the other, replace it (README: \"Raft log store\")")
	f.IntVar(&proposer.MaxInflight, "max-entries-in-flight", proposer.MaxInflight, "group commit: log entries the leader lets commit at once (more queue and ride in the next entry)")
	f.IntVar(&proposer.MaxBatch, "max-entry-ops", proposer.MaxBatch, "group commit: most operations in one log entry")
	f.StringVar(&acfg.ClusterName, "cluster-name", rpc.DefaultClusterName, "cluster name in certificates: node certificates carry server.<name>.quotad")
	f.StringVar(&acfg.TLS.CertFile, "tls-cert", "", "PEM node certificate (quotad tls cert create --server) for gRPC, HTTP and Raft")
	f.StringVar(&acfg.TLS.KeyFile, "tls-key", "", "PEM key for --tls-cert")
	f.StringVar(&acfg.TLS.CAFile, "tls-ca", "", "PEM CA of the cluster (quotad tls ca create): verifies peers and client certificates")
	f.StringVar(&gossipKeyFile, "gossip-key-file", "", "file holding the base64 gossip encryption key (quotad keygen), the same on every node (or $QUOTAD_GOSSIP_KEY)")
	f.StringVar(&acfg.BootstrapTokenFile, "bootstrap-token-file", "", "file holding the bootstrap admin token (quotad keygen --token) (or $QUOTAD_BOOTSTRAP_TOKEN)")
	f.BoolVar(&acfg.Insecure, "insecure", false, "run without TLS and gossip encryption, calls without credentials act as admin: a throwaway cluster on a trusted network only")
	f.BoolVar(&acfg.EnableDebug, "enable-debug", false, "serve /debug/pprof, /debug/state and /debug/fair on the HTTP port (admin credential required)")
	f.BoolVar(&acfg.DisableAcquireStream, "disable-acquire-stream", false, "refuse AcquireStream (UNIMPLEMENTED): clients then send each waiting admission in its own Acquire call")
	f.IntVar(&gcPercent, "gc-percent", defaultGCPercent, "Go GC target: heap growth in percent over the live heap between collections (GOGC; -1 keeps $GOGC or Go's 100)")
	f.StringVar(&memLimit, "memory-limit", "", "soft memory limit for the Go runtime, e.g. 2GiB (GOMEMLIMIT; empty keeps $GOMEMLIMIT or none)")
	f.StringVar(&gcHeadroom, "gc-headroom", "64MiB", "once the live heap is large, let it grow at most this much between collections (0: GOGC alone decides)")
	f.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	f.StringVar(&logFormat, "log-format", "text", "text or json")
	caps.register(f)
	rls.register(f)
	reg.register(f)
	agentconfig.RefuseRepeats(f)
	agentconfig.MarkPaths(f, pathFlags...)
	return cmd
}

// defaultGCPercent: see setGC.
const defaultGCPercent = -1

// setGC applies --gc-percent and --memory-limit (the runtime already read $GOGC and
// $GOMEMLIMIT; a flag overrides them), then starts the --gc-headroom tuner under that limit.
func setGC(percent int, limit, headroom string) error {
	if percent >= 0 {
		debug.SetGCPercent(percent)
	}
	if limit != "" {
		n, err := parseBytes(limit)
		if err != nil {
			return fmt.Errorf("--memory-limit %q: %v", limit, err)
		}
		debug.SetMemoryLimit(n)
	}
	if headroom != "0" {
		n, err := parseBytes(headroom)
		if err != nil {
			return fmt.Errorf("--gc-headroom %q: %v (or 0 to turn it off)", headroom, err)
		}
		gctune.Start(n)
	}
	return nil
}

// parseBytes reads a byte count with an optional KiB, MiB, GiB, KB, MB or GB suffix.
func parseBytes(s string) (int64, error) {
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"B", 1}} {
		if v, ok := strings.CutSuffix(s, u.suffix); ok {
			s, mult = v, u.mult
			break
		}
	}
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("want a positive byte count such as 512MiB")
	}
	return n * mult, nil
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// otherEnv are the QUOTAD_* variables quotad reads besides $QUOTAD_<FLAG> of the agent's
// flags: the client commands' connection, secrets, `quotad dev`'s directory.
var otherEnv = []string{client.EnvAddr, client.EnvToken, client.EnvCACert, client.EnvClientCert, client.EnvClientKey,
	client.EnvConfiguredAddrsOnly, rpc.EnvBootstrapToken, envGossipKey, "QUOTAD_DEV_DIR"}

// envGossipKey holds the gossip key when --gossip-key-file is not given.
const envGossipKey = "QUOTAD_GOSSIP_KEY"

// gossipKey reads the gossip key from file, else from $QUOTAD_GOSSIP_KEY (nil if neither).
func gossipKey(file string) ([]byte, error) {
	s, what := os.Getenv(envGossipKey), "$"+envGossipKey
	if file != "" {
		var err error
		if s, err = pkifiles.ReadSecret(file); err != nil {
			return nil, fmt.Errorf("--gossip-key-file: %w", err)
		}
		what = "--gossip-key-file " + file
	}
	if s == "" {
		return nil, nil
	}
	key, err := auth.DecodeGossipKey(s)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return key, nil
}

// configFlags maps cluster.Config fields to the agent flags that set them, so that a
// configuration error names what the operator typed (flagNames).
var configFlags = []struct{ field, flag string }{
	{"LeaderLeaseTimeout", "--raft-leader-lease-timeout"},
	{"HeartbeatTimeout", "--raft-heartbeat-timeout"},
	{"ElectionTimeout", "--raft-election-timeout"},
	{"SnapshotThreshold", "--snapshot-threshold"},
	{"SnapshotInterval", "--snapshot-interval"},
	{"DeadNodeTimeout", "--dead-node-timeout"},
	{"BootstrapExpect", "--bootstrap-expect"},
	{"GossipSecretKey", "the gossip key (--gossip-key-file)"},
	{"TrailingLogs", "--trailing-logs"},
	{"RejoinDelay", "--rejoin-delay"},
	{"GossipAddr", "--gossip-addr"},
	{"MinVoters", "--min-voters"},
	{"GRPCAddr", "--grpc-addr"},
	{"RaftAddr", "--raft-addr"},
	{"HTTPAddr", "--http-addr"},
	{"LogStore", "--raft-log-store"},
	{"DataDir", "--data-dir"},
	{"Join", "--join"}, // a list: Join[1] "b" reads --join "b"
}

var configFieldRE = func() *regexp.Regexp {
	names := make([]string, len(configFlags))
	for i, c := range configFlags {
		names[i] = c.field
	}
	// A list field's index (Join[1]) goes with it: the flag takes the whole list and the
	// message quotes the offending element.
	return regexp.MustCompile(`\b(` + strings.Join(names, "|") + `)\b(\[\d+\])?`)
}()

// flagNames rewrites a startup error's Go field names (cluster: LeaderLeaseTimeout 300ms must
// be <= HeartbeatTimeout 5ms) into the flags that set them.
func flagNames(err error) error {
	msg := err.Error()
	rest, ok := strings.CutPrefix(msg, "cluster: ")
	if !ok {
		return err
	}
	if r, isID := strings.CutPrefix(rest, "ID "); isID {
		rest = "--id " + r
	}
	return errors.New(configFieldRE.ReplaceAllStringFunc(rest, func(f string) string {
		f, _, _ = strings.Cut(f, "[")
		for _, c := range configFlags {
			if c.field == f {
				return c.flag
			}
		}
		return f
	}))
}
