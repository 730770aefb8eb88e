package rpc

import (
	"net/http"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
)

// Connection limits of an agent's two ports. A client that opens connections and leaves them
// idle must not hold a file descriptor and a goroutine each forever.
const (
	// DefaultHTTPIdleTimeout closes a keep-alive HTTP connection idle this long
	// (AgentConfig.HTTPIdleTimeout). Prometheus scrapes every 15-60 s and keeps its
	// connection; an idle one costs a reconnect after two minutes at most.
	DefaultHTTPIdleTimeout = 2 * time.Minute
	// httpWriteTimeout bounds writing one HTTP response (set per request, so a /debug
	// handler that takes ?seconds=N gets N more: a 30 s CPU profile is pprof's default).
	httpWriteTimeout = 30 * time.Second
	// httpMaxDebugSeconds caps the extra write time ?seconds= grants a /debug handler.
	httpMaxDebugSeconds = 10 * 60
	// The HTTP port has no cap on open connections: it accepts callers without a client
	// certificate, and a cap would let anyone hold every slot with idle keep-alive
	// connections and hang /healthz and /metrics for everyone. ReadHeaderTimeout, the idle
	// timeout and the write deadline bound how long each one lives.

	// DefaultGRPCHandshakeTimeout bounds a new gRPC connection's TLS handshake and HTTP/2
	// preface (AgentConfig.GRPCHandshakeTimeout). grpc-go's default is 120 s: a connection
	// that said nothing held a file descriptor and a goroutine for two minutes, so some 550
	// new silent connections a second kept 65,536 descriptors (the systemd unit's limit) busy.
	// A handshake takes a few round trips, well under a second even across regions.
	DefaultGRPCHandshakeTimeout = 10 * time.Second

	// grpcMaxConnectionIdle closes a gRPC connection with no call for this long (GOAWAY; a
	// client reconnects at its next call). Streams — lender shares, snapshot transfers,
	// admissions waiting up to their max_wait — are calls, so a connection that has one
	// is never idle.
	grpcMaxConnectionIdle = 15 * time.Minute
	// grpcPingTime and grpcPingTimeout: the server pings a connection quiet for
	// grpcPingTime and closes it when no answer comes in grpcPingTimeout, so a vanished
	// client's streams end instead of holding their shares and waiters.
	grpcPingTime    = 2 * time.Minute
	grpcPingTimeout = 20 * time.Second
	// grpcMinPingInterval is the most frequent client keepalive ping the server accepts
	// (also without a call in flight); a client pinging more often is sent GOAWAY
	// ("too_many_pings"). grpc-go's default is 5 minutes and no pings without calls, which
	// would cut a client that keeps an idle connection warm with DialOptions keepalive.
	grpcMinPingInterval = 10 * time.Second
	// grpcMaxConcurrentStreams caps the calls in flight on one gRPC connection; more wait in
	// the client for a stream to end (grpc-go queues them; none fails). A follower forwards
	// every caller's calls to the leader over one connection, waiting admissions included,
	// so the cap is well above the default waiter caps (10000 per domain).
	grpcMaxConcurrentStreams = 1 << 15
)

// grpcConnOptions are the gRPC server options that bound connections (handshake, keepalive,
// idle, concurrent streams). handshake 0 means DefaultGRPCHandshakeTimeout.
func grpcConnOptions(handshake time.Duration) []grpc.ServerOption {
	if handshake <= 0 {
		handshake = DefaultGRPCHandshakeTimeout
	}
	return []grpc.ServerOption{
		grpc.ConnectionTimeout(handshake),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: grpcMaxConnectionIdle,
			Time: grpcPingTime, Timeout: grpcPingTimeout}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: grpcMinPingInterval, PermitWithoutStream: true}),
		grpc.MaxConcurrentStreams(grpcMaxConcurrentStreams),
	}
}

// newHTTPServer is the HTTP port's server: idle keep-alive connections close after idle
// (0: DefaultHTTPIdleTimeout) and every response has a write deadline.
func newHTTPServer(h http.Handler, idle time.Duration) *http.Server {
	if idle <= 0 {
		idle = DefaultHTTPIdleTimeout
	}
	return &http.Server{Handler: withWriteDeadline(h), ReadHeaderTimeout: 5 * time.Second, IdleTimeout: idle}
}

// withWriteDeadline sets each response's write deadline (writeDeadline). A per-request
// deadline rather than http.Server.WriteTimeout, which pprof would refuse to exceed.
func withWriteDeadline(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(writeDeadline(r)))
		h.ServeHTTP(w, r)
	})
}

// writeDeadline is how long r's response may take to write: httpWriteTimeout, plus for
// /debug/ the time the handler samples before it writes (at most httpMaxDebugSeconds):
// ?seconds= as the pprof handler reads it (a decimal for trace, an integer otherwise), or
// without a valid one pprof's default — 30 s for /debug/pprof/profile, 1 s for
// /debug/pprof/trace (`go tool pprof URL` sends no seconds), none for the others.
func writeDeadline(r *http.Request) time.Duration {
	if !strings.HasPrefix(r.URL.Path, "/debug/") {
		return httpWriteTimeout
	}
	q := r.URL.Query().Get("seconds")
	var s float64
	if r.URL.Path == "/debug/pprof/trace" {
		if f, err := strconv.ParseFloat(q, 64); err == nil && f > 0 { // f > 0 is false for NaN
			s = f
		} else {
			s = 1
		}
	} else if n, err := strconv.ParseInt(q, 10, 64); err == nil && n > 0 {
		s = float64(n)
	} else if r.URL.Path == "/debug/pprof/profile" {
		s = 30
	}
	return httpWriteTimeout + time.Duration(min(s, httpMaxDebugSeconds)*float64(time.Second))
}
