package rpc

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/config"
	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/internal/grpcflow"
	"github.com/quotad/quotad/quota"
)

// streamWorkers is the number of gRPC stream workers (grpc.NumStreamWorkers). A worker is
// busy for a whole call, commit wait included (~1-2 ms), so this covers the calls in flight
// on a node at c=64 with client batching; past it calls get goroutines of their own.
const streamWorkers = 64

// AgentConfig configures a whole quotad server process: a cluster node, its gRPC API and its
// HTTP endpoints.
type AgentConfig struct {
	Cluster cluster.Config
	// LimitsFile, if set, is applied by whichever agent first leads a cluster that has no
	// limits yet. Once the cluster has limits the file is ignored (change them with
	// `quotad limits apply`).
	LimitsFile string
	Proposer   ProposerConfig
	FSM        fsm.Options
	// Insecure runs without TLS and without a gossip key: plaintext gRPC, HTTP and Raft, and
	// calls without credentials act as admin. Logged as a warning at every start. Without it
	// TLS (all three files) and Cluster.GossipSecretKey are required.
	Insecure bool
	// ClusterName names the cluster in certificates: node certificates carry
	// auth.ServerName(ClusterName), client certificates a role URI for it (default
	// DefaultClusterName).
	ClusterName string
	// TLS is the node's one identity for gRPC, HTTP, forwarding and, unless Cluster.PeerTLS is
	// set, Raft. Clients may present a certificate of the CA (verified) or none (a token).
	TLS TLSFiles
	// BootstrapTokenFile names a file holding the bootstrap admin token, which every node
	// knows locally (no replicated state needed to administer a new cluster).
	// BootstrapToken is the token itself (from $QUOTAD_BOOTSTRAP_TOKEN), used when no file is
	// given. Both empty: admins authenticate by client certificate only.
	BootstrapTokenFile string
	BootstrapToken     string
	// GossipKeyFile names the file Cluster.GossipSecretKey was read from ("" if none). It is
	// only checked: a warning is logged if group or other can read it (as for TLS.KeyFile and
	// BootstrapTokenFile).
	GossipKeyFile string
	// EnableDebug mounts pprof and /debug/state, /debug/fair on the HTTP port, for the admin
	// credential only. Off by default.
	EnableDebug bool
	// ExtraHTTP handlers are mounted on the HTTP port (the chaos build adds its fault controls).
	ExtraHTTP map[string]http.Handler
	// HTTPIdleTimeout closes a keep-alive connection to the HTTP port after this long
	// without a request (0: DefaultHTTPIdleTimeout). Responses have a write deadline; the port has
	// no cap on open connections (rpc/conns.go).
	HTTPIdleTimeout time.Duration
	// GRPCHandshakeTimeout closes a connection to the gRPC port that has not completed its TLS
	// handshake and HTTP/2 preface this long after it was accepted (0:
	// DefaultGRPCHandshakeTimeout).
	GRPCHandshakeTimeout time.Duration
	// MaxRequestBytes caps one gRPC message a node accepts (--max-request-bytes); a larger one
	// is refused with ResourceExhausted before it is decoded. 0 means DefaultMaxRequestBytes.
	MaxRequestBytes int
	// Waiters caps the admissions waiting on the leader per client, per identity and per
	// domain (--max-waiters-per-client, --max-waiters-per-identity, --max-waiters-per-domain)
	// and the undecided admissions of one AcquireStream (--max-stream-admissions); zero
	// fields mean the defaults.
	Waiters WaiterCaps
	// MaxWait caps how long the leader queues one admission (--max-wait): a larger
	// max_wait_ms is taken as MaxWait, and a denial of it says so. 0 means DefaultMaxWait.
	MaxWait time.Duration
	// MaxCallsPerIdentity caps the gRPC calls one identity (a token, a client certificate)
	// may have in flight on this node, counted from their headers to their end
	// (--max-calls-per-identity); one more is refused ResourceExhausted at its headers. Cluster
	// nodes and --insecure callers are not counted. 0 means DefaultMaxCallsPerIdentity.
	MaxCallsPerIdentity int
	// UnaryInterceptors are chained innermost on the gRPC server, after authentication (the
	// chaos build adds one that loses replies of committed admissions).
	UnaryInterceptors []grpc.UnaryServerInterceptor
	// RLS configures Envoy's rate limit service (--rls-unknown-domain, --rls-headers,
	// --rls-near-limit-ratio).
	RLS RLSOptions
	// DisableAcquireStream refuses AcquireStream with UNIMPLEMENTED, as a build without it
	// would (--disable-acquire-stream): clients decide waiting admissions by unary Acquire.
	DisableAcquireStream bool
	// MaxStreamsPerIdentity caps the AcquireStreams one identity (token or client
	// certificate; with --insecure, one client_id) may have open on the leader
	// (--max-streams-per-identity); more are refused RESOURCE_EXHAUSTED. 0 means
	// DefaultMaxStreamsPerIdentity.
	MaxStreamsPerIdentity int
	// StreamSendTimeout ends an AcquireStream (DEADLINE_EXCEEDED) whose write of answers has
	// waited this long for the client to read them (--stream-send-timeout); its undecided
	// admissions are canceled. 0 means DefaultStreamSendTimeout.
	StreamSendTimeout time.Duration
	// Region, if set, makes the agent a member of a regional cluster under a global one
	// (--region, --global-addrs; rpc/region.go, package region).
	Region *RegionConfig
}

// newAuthenticator builds the caller authentication of cfg over f's token table, with the
// bootstrap admin token (already loaded; "" for none).
func newAuthenticator(cfg AgentConfig, f *fsm.FSM, bootstrapToken string) *authenticator {
	a := &authenticator{insecure: cfg.Insecure, cluster: cfg.ClusterName, token: func(h [32]byte) (auth.Identity, bool) {
		t, ok := f.TokenByHash(h)
		return t.Identity(), ok
	}, generation: f.TokensGeneration, calls: newCallCounter(cfg.MaxCallsPerIdentity),
		certRevoked: f.CertRevoked, anyCertRevoked: f.AnyCertRevoked, certGeneration: f.CertsGeneration}
	if a.cluster == "" {
		a.cluster = DefaultClusterName
	}
	if bootstrapToken != "" {
		h := auth.HashToken(bootstrapToken)
		a.bootstrap = &h
	}
	return a
}

// Agent is one running quotad server. Start it with StartAgent; Stop it once.
type Agent struct {
	cfg     AgentConfig
	authn   *authenticator
	log     *slog.Logger
	fsm     *fsm.FSM
	node    *cluster.Node
	server  *Server
	metrics *Metrics
	grpc    *grpc.Server
	health  *health.Server
	http    *http.Server
	grpcLn  net.Listener
	httpLn  net.Listener

	stop chan struct{}
	wg   sync.WaitGroup

	// bootstrapToken is the bootstrap admin token ("" if none).
	bootstrapToken string
}

// StartAgent opens the data directory, joins or forms the cluster and starts serving.
// Listen addresses with port 0 pick free ports; GRPCAddr and HTTPAddr report them.
func StartAgent(cfg AgentConfig) (*Agent, error) {
	log := cfg.Cluster.Logger
	if log == nil {
		log = slog.Default()
	}
	if cfg.ClusterName == "" {
		cfg.ClusterName = DefaultClusterName
	}
	if err := cfg.CheckSecurity(); err != nil {
		return nil, err
	}
	if cfg.Insecure {
		log.Warn(insecureWarning)
	}
	cfg.warnLooseSecrets(log)
	cfg.Cluster.Insecure = cfg.Insecure
	bootstrapToken, err := cfg.loadBootstrapToken()
	if err != nil {
		return nil, err
	}
	a := &Agent{cfg: cfg, log: log, bootstrapToken: bootstrapToken, fsm: fsm.New(cfg.FSM), metrics: NewMetrics(), stop: make(chan struct{})}
	var limits *quota.Limits
	if cfg.LimitsFile != "" {
		l, err := config.LoadFile(cfg.LimitsFile)
		if err != nil {
			return nil, err
		}
		if len(l.Domains) == 0 {
			return nil, fmt.Errorf("limits file %s (--limits) has no domains: a limits document starts with domain: NAME (examples/limits.yaml); to start without limits, leave --limits out and apply them later with quotad limits apply", cfg.LimitsFile)
		}
		limits = l
	}
	authn := newAuthenticator(cfg, a.fsm, bootstrapToken)
	authn.calls.refused = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "quotad_calls_refused_total",
		Help: "gRPC calls refused ResourceExhausted at their headers because their identity already had --max-calls-per-identity calls in flight on this node.",
	})
	authn.calls.evicted = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "quotad_open_calls_ended_total",
		Help: "Calls to open methods (health Check, List) ended Canceled before their request arrived because a newer one came from their source address, which had 64 waiting, or the node had 1024 waiting.",
	})
	a.metrics.Registry.MustRegister(authn.calls.refused, authn.calls.evicted)
	a.authn = authn
	maxRequest := cfg.MaxRequestBytes
	if maxRequest <= 0 {
		maxRequest = DefaultMaxRequestBytes
	}
	grpcOpts := append([]grpc.ServerOption{grpc.MaxRecvMsgSize(maxRequest),
		// Calls run on long-lived workers instead of a new goroutine each: a new goroutine
		// starts with a small stack and grows it (copying it) several times on the way
		// through gRPC, the interceptors and the handler, on every call. When every worker
		// is busy grpc-go starts a goroutine as before.
		grpc.NumStreamWorkers(streamWorkers),
	}, grpcflow.ServerOptions()...)
	grpcOpts = append(grpcOpts, grpcConnOptions(cfg.GRPCHandshakeTimeout)...)
	var forwardCreds credentials.TransportCredentials
	var httpTLS *tls.Config
	nodeCerts := newNodeCertSet()
	if cfg.TLS.Enabled() {
		serverTLS, clientTLS, err := cfg.TLS.Load(cfg.ClusterName)
		if err != nil {
			return nil, err
		}
		nodeEnd, caEnd, err := certExpiries(cfg.TLS)
		if err != nil {
			return nil, err
		}
		a.metrics.Registry.MustRegister(certExpiryGauge(nodeEnd, caEnd))
		warnCertExpiry(log, cfg.TLS, nodeEnd, caEnd, time.Now())
		for _, c := range serverTLS.Certificates {
			nodeCerts.add(c.Leaf) // this node's own
		}
		grpcOpts = append(grpcOpts, grpc.Creds(certCreds{TransportCredentials: credentials.NewTLS(serverTLS), nodes: nodeCerts, cluster: cfg.ClusterName}))
		forwardCreds = credentials.NewTLS(clientTLS)
		httpTLS = serverTLS
		if cfg.Cluster.PeerTLS == nil {
			// The same identity secures Raft: each node is both server and client there, and
			// a peer must present a certificate carrying the server SAN.
			peerTLS, err := auth.PeerTLSConfig(cfg.TLS.CertFile, cfg.TLS.KeyFile, cfg.TLS.CAFile, cfg.ClusterName)
			if err != nil {
				return nil, err
			}
			cfg.Cluster.PeerTLS = peerTLS
		}
	}
	// The node's settings are checked before any port is bound: a bad value is refused for
	// what it is, not as "address already in use" when another process holds a default port
	// (cluster.NewNode checks them again).
	if err := cfg.Cluster.Validate(); err != nil {
		return nil, err
	}
	if a.grpcLn, err = net.Listen("tcp", cfg.Cluster.GRPCAddr); err != nil {
		return nil, fmt.Errorf("grpc address %q: %w", cfg.Cluster.GRPCAddr, err)
	}
	cfg.Cluster.GRPCAddr = a.grpcLn.Addr().String()
	conns := newConnListener(a.grpcLn)
	a.grpcLn = conns
	if cfg.Cluster.HTTPAddr != "" {
		if a.httpLn, err = net.Listen("tcp", cfg.Cluster.HTTPAddr); err != nil {
			a.grpcLn.Close()
			return nil, fmt.Errorf("http address %q: %w", cfg.Cluster.HTTPAddr, err)
		}
		cfg.Cluster.HTTPAddr = a.httpLn.Addr().String()
		if httpTLS != nil {
			a.httpLn = tls.NewListener(a.httpLn, httpTLS)
		}
	}
	if a.node, err = cluster.NewNode(cfg.Cluster, a.fsm); err != nil {
		a.closeListeners()
		return nil, err
	}
	grpcOpts = append(grpcOpts, grpc.InTapHandle(authn.tap), grpc.ChainUnaryInterceptor(authn.unary), grpc.ChainStreamInterceptor(authn.stream))
	if len(cfg.UnaryInterceptors) > 0 {
		grpcOpts = append(grpcOpts, grpc.ChainUnaryInterceptor(cfg.UnaryInterceptors...))
	}
	a.server = NewServer(a.node, a.fsm, cfg.Proposer, forwardCreds, a.metrics)
	a.server.nodeCerts, a.server.clusterName = nodeCerts, cfg.ClusterName
	a.server.SetWaiterCaps(cfg.Waiters)
	a.server.insecure = cfg.Insecure
	a.server.maxWait = cfg.MaxWait
	a.server.SetRLSOptions(cfg.RLS)
	a.server.setLogger(log)
	a.server.rls.batchBytes = maxRequest / 2
	a.server.rls.authn = authn
	a.server.authn = authn
	a.server.noStream = cfg.DisableAcquireStream
	a.server.maxStreamsPerIdentity = cfg.MaxStreamsPerIdentity
	a.server.streamSendTimeout = cfg.StreamSendTimeout
	a.server.conns = conns
	a.registerGauges()

	a.grpc = grpc.NewServer(grpcOpts...)
	a.server.Register(a.grpc)
	quotadv1.RegisterSnapshotServer(a.grpc, &snapshotService{s: a.server, node: a.node, tempDir: cfg.Cluster.DataDir})
	a.health = health.NewServer()
	healthpb.RegisterHealthServer(a.grpc, a.health)
	a.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		if err := a.grpc.Serve(a.grpcLn); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			a.log.Error("grpc server stopped", "err", err)
		}
	}()
	if a.httpLn != nil {
		a.http = newHTTPServer(a.httpHandler(), cfg.HTTPIdleTimeout)
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			if err := a.http.Serve(a.httpLn); err != nil && !errors.Is(err, http.ErrServerClosed) {
				a.log.Error("http server stopped", "err", err)
			}
		}()
	}
	a.wg.Add(1)
	go a.watch(limits)
	if cfg.Region != nil {
		a.server.SetRegion(*cfg.Region)
		a.metrics.Registry.MustRegister(newRegionCollector(a.server))
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			a.server.RunRegion(a.stop, cfg.Cluster.ID, log)
		}()
	}
	return a, nil
}

func (a *Agent) closeListeners() {
	a.grpcLn.Close()
	if a.httpLn != nil {
		a.httpLn.Close()
	}
}

// watch keeps health and metrics in line with leadership and applies the initial limits file.
func (a *Agent) watch(limits *quota.Limits) {
	defer a.wg.Done()
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	lastLeader := ""
	for {
		select {
		case <-a.stop:
			return
		case <-t.C:
		}
		id, _ := a.node.Leader()
		if id != lastLeader {
			lastLeader = id
			a.metrics.LeaderChanged()
			st := healthpb.HealthCheckResponse_NOT_SERVING
			if id != "" {
				st = healthpb.HealthCheckResponse_SERVING
			}
			a.health.SetServingStatus("", st)
		}
		if limits != nil && a.node.IsLeader() && a.fsm.Limits().Version == 0 {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			v, err := a.server.applyLimits(ctx, limits)
			cancel()
			if err != nil {
				a.log.Warn("applying the initial limits file failed; will retry", "file", a.cfg.LimitsFile, "err", err)
				continue
			}
			a.log.Info("applied the initial limits file", "file", a.cfg.LimitsFile, "version", v)
			limits = nil
		} else if limits != nil && a.fsm.Limits().Version > 0 {
			limits = nil // the cluster has limits; they are changed with `limits apply` only
		}
	}
}

func (a *Agent) registerGauges() {
	a.metrics.Registry.MustRegister(newAllocationCollector(a.fsm))
	a.metrics.Registry.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "quotad_raft_leader", Help: "1 if this node is the Raft leader.",
		}, func() float64 {
			if a.node.IsLeader() {
				return 1
			}
			return 0
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "quotad_raft_applied_index", Help: "Index of the last log entry applied to the FSM.",
		}, func() float64 { return float64(a.fsm.AppliedIndex()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "quotad_raft_voters", Help: "Voters in this node's Raft configuration.",
		}, func() float64 { v, _ := a.node.Voters(); return float64(v) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "quotad_raft_voters_live", Help: "On the leader: voters that answered it within 2 x --raft-heartbeat-timeout, itself included (0 on followers); below quotad_raft_voters, the cluster tolerates one failure less.",
		}, func() float64 { _, l := a.node.Voters(); return float64(l) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "quotad_raft_snapshot_index", Help: "Log index of this node's newest Raft snapshot (0: none); applied index minus it grows without bound while snapshots fail (disk full).",
		}, func() float64 { return float64(a.node.LastSnapshotIndex()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "quotad_active_buckets", Help: "Buckets held in memory (absent buckets are full).",
		}, func() float64 { return float64(a.fsm.Stats().Buckets) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "quotad_active_leases", Help: "Concurrency leases currently held.",
		}, func() float64 { return float64(a.fsm.Stats().Leases) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "quotad_dedup_entries", Help: "Decisions remembered for request-ID retries.",
		}, func() float64 { return float64(a.fsm.Stats().DedupEntries) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "quotad_calls_in_flight", Help: "gRPC calls of callers' identities in flight on this node (counted against --max-calls-per-identity; cluster nodes' and --insecure calls are not), and calls to open methods (health checks, counted per source address).",
		}, func() float64 { return float64(a.authn.calls.inFlight.Load()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "quotad_acquire_streams", Help: "AcquireStreams open on this node (a follower refuses them).",
		}, func() float64 { return float64(a.AcquireStreams()) }),
	)
}

// DebugState is served at /debug/state: enough to compare replicas.
type DebugState struct {
	ID       string `json:"id"`
	Leader   string `json:"leader"`
	IsLeader bool   `json:"is_leader"`
	fsm.StateHash
	LimitsVersion uint64 `json:"limits_version"`
}

// Status is State without the state hash: cheap enough to poll (/debug/state), where the
// hash reads the whole state (/debug/state?hash=1: seconds with millions of dedup records).
func (a *Agent) Status() DebugState {
	id, _ := a.node.Leader()
	return DebugState{
		ID: a.cfg.Cluster.ID, Leader: id, IsLeader: a.node.IsLeader(),
		StateHash: fsm.StateHash{AppliedIndex: a.fsm.AppliedIndex(), Clock: a.fsm.Clock()}, LimitsVersion: a.fsm.Limits().Version,
	}
}

// State returns this agent's DebugState.
func (a *Agent) State() DebugState {
	id, _ := a.node.Leader()
	return DebugState{
		ID: a.cfg.Cluster.ID, Leader: id, IsLeader: a.node.IsLeader(),
		StateHash: a.fsm.Hash(), LimitsVersion: a.fsm.Limits().Version,
	}
}

// httpHandler serves /metrics and /healthz to anyone; pprof and /debug/* only with
// EnableDebug and then only to the admin; ExtraHTTP only to the admin.
func (a *Agent) httpHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(a.metrics.Registry, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if reason := a.notReady(); reason != "" {
			http.Error(w, "not ready: "+reason, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	if a.cfg.EnableDebug {
		debug := http.NewServeMux()
		debug.HandleFunc("/debug/pprof/", pprof.Index)
		debug.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		debug.HandleFunc("/debug/pprof/profile", pprof.Profile)
		debug.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		debug.HandleFunc("/debug/pprof/trace", pprof.Trace)
		debug.HandleFunc("/debug/state", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			if r.URL.Query().Get("hash") == "1" {
				_ = json.NewEncoder(w).Encode(a.State())
				return
			}
			_ = json.NewEncoder(w).Encode(a.Status())
		})
		debug.Handle("/debug/fair", a.server.fairHandler(a.cfg.Cluster.ID))
		mux.Handle("/debug/", a.requireAdmin(debug))
	}
	for path, h := range a.cfg.ExtraHTTP {
		mux.Handle(path, a.requireAdmin(h))
	}
	return mux
}

// GRPCAddr returns the address the gRPC API listens on.
func (a *Agent) GRPCAddr() string { return a.grpcLn.Addr().String() }

// HTTPAddr returns the address of the HTTP endpoints, or "".
func (a *Agent) HTTPAddr() string {
	if a.httpLn == nil {
		return ""
	}
	return a.httpLn.Addr().String()
}

// Node returns the agent's cluster node.
func (a *Agent) Node() *cluster.Node { return a.node }

// FSM returns the agent's state machine.
func (a *Agent) FSM() *fsm.FSM { return a.fsm }

// Kill stops the agent abruptly, as a crash would: connections are cut, leadership is not
// handed over, nothing is flushed beyond what Raft already fsynced. For tests.
func (a *Agent) Kill() error {
	close(a.stop)
	a.grpc.Stop()
	if a.http != nil {
		a.http.Close()
	}
	a.server.Close()
	err := a.node.Kill()
	a.wg.Wait()
	return err
}

// Stop shuts the agent down gracefully: stops taking calls, hands leadership over if it leads,
// and closes its data files.
func (a *Agent) Stop() error {
	close(a.stop)
	a.health.Shutdown()
	stopped := make(chan struct{})
	go func() { a.grpc.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(3 * time.Second):
		a.grpc.Stop()
	}
	if a.http != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_ = a.http.Shutdown(ctx)
		cancel()
	}
	a.server.Close()
	err := a.node.Shutdown()
	a.wg.Wait()
	return err
}
