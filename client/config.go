package client

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/grpc"
)

// Defaults used by DefaultConfig and by New for zero fields.
const (
	DefaultBatchWindow    = 500 * time.Microsecond
	DefaultBatchMaxSize   = 256
	DefaultBackoffInitial = 10 * time.Millisecond
	DefaultBackoffMax     = time.Second
	DefaultBackoffFactor  = 2.0
	DefaultAttemptTimeout = 2 * time.Second
)

const (
	// maxAdmissionsPerBatch keeps batches well under the server's per-call cap.
	maxAdmissionsPerBatch = 4096
	minLeaseRenewInterval = 10 * time.Millisecond
	// minRenewRetry floors the cap on a renewal's retry delay (a tenth of the lease TTL).
	minRenewRetry = 10 * time.Millisecond
	// minRenewAttempt floors the cap on one renewal attempt (a third of the lease TTL).
	minRenewAttempt = 50 * time.Millisecond
	// leaderHeader is the response metadata key naming the leader's gRPC address.
	leaderHeader = "x-quotad-leader"
)

// Config configures a Client. The zero value of every field except Addrs is usable: New fills
// in the defaults listed on each field. A Config is read once by New; changing it afterwards
// has no effect (nothing is reloadable).
type Config struct {
	// Addrs are gRPC addresses (host:port) of cluster nodes. Any node will do: followers
	// forward to the leader and name it, and the client then talks to the leader directly.
	// At least one is required.
	Addrs []string

	// ConfiguredAddrsOnly makes the client dial only Addrs: a leader named by the cluster
	// (the x-quotad-leader header) is followed only if it is one of them. Set it when the
	// nodes are reached through a proxy, a Kubernetes Service/LoadBalancer or NAT, where the
	// leader's own address is unreachable (following it costs each call an attempt timeout)
	// or goes around the proxy. The trade-off: a call sent to a follower is forwarded to the
	// leader (one more hop, a little more latency and follower load). Default false: follow
	// the leader wherever it says it is. LoadEnv sets it from $QUOTAD_CONFIGURED_ADDRS_ONLY;
	// the quotad CLI's flag is --configured-addrs-only.
	ConfiguredAddrsOnly bool

	// ClientID is this client's idempotency namespace: request IDs are unique within it.
	// Empty means a random 96-bit ID (16 characters), which is what almost every caller
	// wants. If you set a stable ID, never run two live clients with the same one, and keep it
	// short: it is stored with every admission in the replicated log. With a stable ID request
	// sequences start at the wall-clock time in nanoseconds, so a restarted process with the
	// same ID does not reuse the IDs of its previous life.
	ClientID string

	// TLS, when non-nil, is used for every connection (set RootCAs and, for mTLS,
	// Certificates). Nil with TLSFiles empty means plaintext, which only a cluster run with
	// --insecure accepts.
	TLS *tls.Config

	// TLSFiles builds the TLS settings from PEM files instead (CA, client certificate and
	// key; $QUOTAD_CACERT, $QUOTAD_CLIENT_CERT, $QUOTAD_CLIENT_KEY with LoadEnv). Set TLS or
	// TLSFiles, not both.
	TLSFiles TLSFiles

	// Token is a bearer token sent with every call as "authorization: Bearer <token>"
	// ($QUOTAD_TOKEN with LoadEnv); TokenFile names a file holding it instead (read once by
	// New). A token is only sent over TLS unless Insecure is set.
	Token     string
	TokenFile string

	// Insecure allows sending Token over a plaintext connection (a cluster run with
	// --insecure, on loopback). It does not turn TLS off.
	Insecure bool

	// Batch configures the coalescing of concurrent admissions into one RPC.
	Batch BatchConfig

	// Stream configures how waiting admissions (Wait, Acquire, a Request with MaxWait) reach
	// the leader: by default over one AcquireStream per Client, shared by its callers.
	Stream StreamConfig

	// LimiterClock, if set, replaces the system clocks the Limiters time their shares with
	// (CLOCK_MONOTONIC_RAW and CLOCK_BOOTTIME): for tests and the chaos suite, which slew and
	// stop clocks. Nil: the system clocks.
	LimiterClock LimiterClock

	// Logger receives the client's rare warnings: a concurrency lease lost while held
	// (Lease.Err says why; Stats.LeasesLost counts them). Nil: nothing is logged — a library
	// does not write into its host program's logs unasked; everything it would log is also in
	// an error or Stats. Set it (slog.Default() for the program's default logger) to see them.
	Logger *slog.Logger

	// Backoff configures the delay between retries of a failed RPC.
	Backoff BackoffConfig

	// AttemptTimeout bounds one RPC attempt (default DefaultAttemptTimeout). When it expires
	// the call is retried with the same request ID, so a decision that was committed but
	// whose answer was lost is returned, not made again. The caller's context bounds all
	// attempts together.
	AttemptTimeout time.Duration

	// RetryHorizon bounds how long after its first attempt one request ID is retried
	// (default DefaultRetryHorizon). The cluster remembers a decision for its dedup window
	// (2 minutes of cluster time by default); a retry after that could be decided afresh, so
	// past the horizon the call ends with ErrUnavailable instead. Keep it well below the
	// server's window.
	RetryHorizon time.Duration

	// DialOptions are appended to the client's own gRPC dial options (interceptors, keepalive,
	// a custom dialer). Transport and per-call credentials are set from TLS, TLSFiles and
	// Token; do not pass them here.
	DialOptions []grpc.DialOption

	envErr error // what LoadEnv could not read; Validate reports it
}

// BatchConfig configures batching. The zero value enables batching with the defaults.
type BatchConfig struct {
	// Disabled sends every admission in its own Acquire RPC.
	Disabled bool
	// Window is how long the first admission of a batch waits for others to join it while
	// another batch is in flight (default DefaultBatchWindow). With nothing in flight an
	// admission is sent at once, so a lone caller pays no window.
	Window time.Duration
	// MaxSize sends a batch as soon as it holds this many admissions (default
	// DefaultBatchMaxSize, at most 4096).
	MaxSize int
}

// StreamConfig configures the stream that carries waiting admissions. The zero value
// streams.
//
// Waiting admissions of concurrent callers share one AcquireStream to the leader: what is
// queued goes in one message, and each admission is answered the moment the leader decides
// it (a unary batch would answer all of them with its slowest). A stream that breaks, or a
// node that does not serve it (an older build, a regional node, a leader this client cannot
// dial), costs nothing but the unary path: each undecided admission is decided by its own
// Acquire RPC with the same request ID, never twice.
type StreamConfig struct {
	// Disabled sends every waiting admission in its own Acquire RPC (the behaviour before
	// streams).
	Disabled bool
}

// BackoffConfig configures exponential backoff with full jitter: before retry n (n = 0, 1,
// ...) the client sleeps a uniformly random duration in [0, min(Max, Initial*Factor^n)].
// The zero value uses the defaults.
type BackoffConfig struct {
	// Initial is the ceiling of the first delay (default DefaultBackoffInitial).
	Initial time.Duration
	// Max caps the ceiling (default DefaultBackoffMax).
	Max time.Duration
	// Factor multiplies the ceiling per attempt (default DefaultBackoffFactor; must be ≥ 1).
	Factor float64
}

// DefaultConfig returns a Config for the given node addresses with every default spelled out.
func DefaultConfig(addrs ...string) Config {
	return Config{
		Addrs:          addrs,
		Batch:          BatchConfig{Window: DefaultBatchWindow, MaxSize: DefaultBatchMaxSize},
		Backoff:        BackoffConfig{Initial: DefaultBackoffInitial, Max: DefaultBackoffMax, Factor: DefaultBackoffFactor},
		AttemptTimeout: DefaultAttemptTimeout,
	}
}

// withDefaults returns c with zero fields replaced by defaults.
func (c Config) withDefaults() Config {
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Batch.Window == 0 {
		c.Batch.Window = DefaultBatchWindow
	}
	if c.Batch.MaxSize == 0 {
		c.Batch.MaxSize = DefaultBatchMaxSize
	}
	if c.Backoff.Initial == 0 {
		c.Backoff.Initial = DefaultBackoffInitial
	}
	if c.Backoff.Max == 0 {
		c.Backoff.Max = DefaultBackoffMax
	}
	if c.Backoff.Factor == 0 {
		c.Backoff.Factor = DefaultBackoffFactor
	}
	if c.AttemptTimeout == 0 {
		c.AttemptTimeout = DefaultAttemptTimeout
	}
	if c.RetryHorizon == 0 {
		c.RetryHorizon = DefaultRetryHorizon
	}
	return c
}

// DefaultRetryHorizon is half the server's default dedup window (fsm.DefaultDedupWindow).
const DefaultRetryHorizon = time.Minute

// Validate reports every problem with c (after defaults are applied), quoting the values.
func (c Config) Validate() error {
	c = c.withDefaults()
	var errs []error
	if len(c.Addrs) == 0 {
		errs = append(errs, errors.New("no node addresses (Addrs is empty): give at least one node's gRPC address, e.g. 127.0.0.1:7101"))
	}
	for i, a := range c.Addrs {
		if a == "" {
			errs = append(errs, fmt.Errorf("node address %d (Addrs[%d]) is empty", i, i))
		} else if err := CheckAddr(a); err != nil {
			errs = append(errs, fmt.Errorf("node address %d (Addrs[%d]): %w", i, i, err))
		}
	}
	if len(c.ClientID) > 128 {
		errs = append(errs, fmt.Errorf("ClientID is %d bytes; at most 128", len(c.ClientID)))
	}
	if c.Batch.Window < 0 {
		errs = append(errs, fmt.Errorf("Batch.Window %v is negative", c.Batch.Window))
	}
	if c.Batch.MaxSize < 1 || c.Batch.MaxSize > maxAdmissionsPerBatch {
		errs = append(errs, fmt.Errorf("Batch.MaxSize %d is outside [1, %d]", c.Batch.MaxSize, maxAdmissionsPerBatch))
	}
	if c.Backoff.Initial < 0 || c.Backoff.Max < c.Backoff.Initial {
		errs = append(errs, fmt.Errorf("Backoff.Initial %v and Backoff.Max %v: need 0 ≤ Initial ≤ Max", c.Backoff.Initial, c.Backoff.Max))
	}
	if c.Backoff.Factor < 1 {
		errs = append(errs, fmt.Errorf("Backoff.Factor %v is below 1", c.Backoff.Factor))
	}
	if c.AttemptTimeout < 0 {
		errs = append(errs, fmt.Errorf("AttemptTimeout %v is negative", c.AttemptTimeout))
	}
	if c.envErr != nil {
		errs = append(errs, c.envErr)
	}
	if err := c.validateCredentials(); err != nil {
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		return fmt.Errorf("client: invalid config: %w", errors.Join(errs...))
	}
	return nil
}
