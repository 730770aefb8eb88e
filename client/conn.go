package client

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/internal/grpcflow"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// node is one cluster member the client may talk to.
type node struct {
	addr string
	cc   *grpc.ClientConn
	qc   quotadv1.QuotaClient
}

// nodes keeps a connection per known address and the address calls go to: the leader when
// one has named itself, else whichever node answered last. Safe for concurrent use.
type nodes struct {
	dialOpts []grpc.DialOption
	// configuredOnly: follow a leader only to a configured address (Config.ConfiguredAddrsOnly).
	configuredOnly bool

	mu     sync.Mutex
	byAddr map[string]*node
	order  []string // configured addresses, then discovered ones
	cur    int      // index into order of the current target
	closed bool
	// failedAt is when an attempt at an address last failed (failed): for staleFor after
	// that, moving on skips it while another node has not failed as recently.
	failedAt map[string]time.Time
	// silentAt is when an attempt at an address last failed without an answer from it (no
	// leader header, no ResourceExhausted or Aborted: refused, reset, timed out), unless it
	// answered since (answered). For staleFor after that, a leader hint naming it from a node
	// whose forward failed is not followed (staleHint). nsilent is len(silentAt), read
	// without mu so that an answer costs no lock while no node is silent.
	silentAt map[string]time.Time
	nsilent  atomic.Int32
}

// staleFor is how long a node that failed counts as just failed (nodes.failedAt, silentAt):
// about a leader election on a cluster with a 1 s heartbeat timeout.
const staleFor = time.Second

func newNodes(addrs []string, cfg Config, creds []grpc.DialOption) *nodes {
	opts := append(slices.Clone(creds), grpcflow.DialOptions()...) // no BDP pings (package grpcflow)
	opts = append(opts,
		// gRPC's default reconnect backoff grows to 120s; a restarted node should be usable
		// within about a second.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: time.Second,
		}),
	)
	opts = append(opts, cfg.DialOptions...)
	n := &nodes{dialOpts: opts, byAddr: make(map[string]*node), configuredOnly: cfg.ConfiguredAddrsOnly, failedAt: make(map[string]time.Time), silentAt: make(map[string]time.Time)}
	seen := map[string]bool{}
	for _, a := range addrs {
		if !seen[a] {
			seen[a] = true
			n.order = append(n.order, a)
		}
	}
	// Spread clients over the nodes until they learn the leader.
	n.cur = rand.IntN(len(n.order))
	return n
}

// target returns the node calls should go to now.
func (ns *nodes) target() (*node, error) {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	if ns.closed {
		return nil, ErrClosed
	}
	return ns.getLocked(ns.order[ns.cur])
}

func (ns *nodes) getLocked(addr string) (*node, error) {
	if n, ok := ns.byAddr[addr]; ok {
		return n, nil
	}
	cc, err := grpc.NewClient(addr, ns.dialOpts...)
	if err != nil {
		return nil, fmt.Errorf("quotad: connecting to %q: %w", addr, err)
	}
	n := &node{addr: addr, cc: cc, qc: quotaConn{quotadv1.NewQuotaClient(cc), cc}}
	ns.byAddr[addr] = n
	return n, nil
}

// follow makes addr (a leader named by the cluster) the target, learning it if new; with
// configuredOnly, an address not configured is ignored (false: the target did not change).
func (ns *nodes) follow(addr string) bool {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	if ns.order[ns.cur] == addr {
		return true
	}
	for i, a := range ns.order {
		if a == addr {
			ns.cur = i
			return true
		}
	}
	if ns.configuredOnly {
		return false
	}
	ns.order = append(ns.order, addr)
	ns.cur = len(ns.order) - 1
	return true
}

// failed moves the target past addr after a failed attempt there, to the next node that has
// not just failed too (the next one if all have). It does nothing if another goroutine has
// already moved on. silent: addr gave no answer (staleHint).
func (ns *nodes) failed(addr string, silent bool) {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	now := time.Now()
	ns.failedAt[addr] = now
	if silent {
		ns.silentAt[addr] = now
	} else {
		delete(ns.silentAt, addr)
	}
	ns.nsilent.Store(int32(len(ns.silentAt)))
	if ns.order[ns.cur] != addr {
		return
	}
	next := (ns.cur + 1) % len(ns.order)
	for i := range len(ns.order) - 1 {
		j := (ns.cur + 1 + i) % len(ns.order)
		if !ns.failedWithinLocked(ns.order[j], now) {
			next = j
			break
		}
	}
	ns.cur = next
}

// answered records that addr answered an attempt (with a result, a leader header, or a
// refusal such as ResourceExhausted): hints naming it are followed again.
func (ns *nodes) answered(addr string) {
	if ns.nsilent.Load() == 0 {
		return
	}
	ns.mu.Lock()
	defer ns.mu.Unlock()
	delete(ns.silentAt, addr)
	ns.nsilent.Store(int32(len(ns.silentAt)))
}

// staleHint reports whether addr, named as the leader by a node whose forward to it failed,
// is a hint to ignore: addr itself failed without answering just now (and has not answered
// since). A leader that answers "overloaded" (ResourceExhausted) is alive: hints naming it
// are followed. After a leader dies a follower keeps naming it until its own election
// timeout; following that hint sent every retry back and forth between the dead leader and
// that follower, never to the node the cluster was electing (a lease then lost its renewal
// window: client TestClusterLeaseSurvivesLeaderFailover, once in CI).
func (ns *nodes) staleHint(addr string) bool {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	at, ok := ns.silentAt[addr]
	return ok && time.Since(at) < staleFor
}

func (ns *nodes) failedWithinLocked(addr string, now time.Time) bool {
	at, ok := ns.failedAt[addr]
	return ok && now.Sub(at) < staleFor
}

func (ns *nodes) close() error {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	ns.closed = true
	var errs []error
	for _, n := range ns.byAddr {
		errs = append(errs, n.cc.Close())
	}
	return errors.Join(errs...)
}

// delay returns the full-jitter backoff before retry number attempt (0-based):
// uniform in [0, delayCeil(attempt)].
func (b BackoffConfig) delay(attempt int) time.Duration {
	ceil := b.delayCeil(attempt)
	if ceil <= 0 {
		return 0
	}
	return time.Duration(rand.Int64N(int64(ceil) + 1))
}

// delayCeil is min(Max, Initial*Factor^attempt).
func (b BackoffConfig) delayCeil(attempt int) time.Duration {
	ceil := float64(b.Initial) * math.Pow(b.Factor, float64(attempt))
	if ceil > float64(b.Max) || math.IsInf(ceil, 0) || math.IsNaN(ceil) {
		return b.Max
	}
	return time.Duration(ceil)
}

// backoffMaxKey is the context key of a call's own cap on the delay between its retries
// (withBackoffMax).
type backoffMaxKey struct{}

// withBackoffMax caps the delay between the retries of calls made with the returned context at
// d (when below Config.Backoff.Max): a call that must land within a short window — a lease's
// renewal before its TTL runs out — keeps trying often enough to meet a leader elected late in
// that window.
func withBackoffMax(ctx context.Context, d time.Duration) context.Context {
	return context.WithValue(ctx, backoffMaxKey{}, d)
}

// attemptMaxKey is the context key of a call's own cap on one attempt's timeout
// (withAttemptMax).
type attemptMaxKey struct{}

// withAttemptMax caps each attempt of calls made with the returned context at d (when below
// Config.AttemptTimeout): a call that must land within a short window gives up on a node that
// does not answer at all (a blackholed path: no reset, no refusal) in time to try another.
func withAttemptMax(ctx context.Context, d time.Duration) context.Context {
	return context.WithValue(ctx, attemptMaxKey{}, d)
}

// backoffFor is b with ctx's cap (withBackoffMax) applied.
func backoffFor(ctx context.Context, b BackoffConfig) BackoffConfig {
	if d, ok := ctx.Value(backoffMaxKey{}).(time.Duration); ok && d > 0 && d < b.Max {
		b.Max = d
	}
	return b
}

// retryable reports whether a failed attempt may be repeated: the cluster gave no answer
// (or answered "not now"). Retrying an admission is safe because it keeps its request ID.
func retryable(code codes.Code) bool {
	switch code {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Aborted, codes.Canceled, codes.ResourceExhausted:
		return true
	}
	return false
}

// rpcFunc performs one attempt of an RPC against qc.
type rpcFunc func(ctx context.Context, qc quotadv1.QuotaClient, opts ...grpc.CallOption) error

// invoke runs call with retries until it succeeds, fails permanently, or ctx ends.
// extra lengthens each attempt's timeout (for admissions that may wait on the leader).
func (c *Client) invoke(ctx context.Context, op string, extra time.Duration, call rpcFunc) error {
	var (
		lastErr error
		byNode  nodeErrors
	)
	start := time.Now()
	for attempt := 0; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return c.unavailable(op, attempt, lastErr, err)
		}
		if attempt > 0 && time.Since(start) > c.cfg.RetryHorizon {
			return c.unavailable(op, attempt, lastErr, errRetryHorizon)
		}
		n, err := c.nodes.target()
		if errors.Is(err, ErrClosed) {
			return err
		}
		if err != nil {
			byNode.add("", err) // no connection to try (its address does not parse, say)
		} else {
			err = c.attempt(ctx, n, extra, call)
			if err == nil {
				return nil
			}
			st, _ := status.FromError(err)
			byNode.add(n.addr, err)
			if ctx.Err() != nil {
				return c.unavailable(op, attempt+1, byNode.err(), ctx.Err())
			}
			if !retryable(st.Code()) || IsMessageTooLarge(err) {
				return permanentError(op, st, err)
			}
			c.metrics.retries.Add(1)
		}
		lastErr = byNode.err()
		if !sleep(ctx, backoffFor(ctx, c.cfg.Backoff).delay(attempt)) {
			return c.unavailable(op, attempt+1, lastErr, ctx.Err())
		}
	}
}

// invokeConn is invoke for an RPC of another service than Quota (Admin): call gets the
// node's connection.
func (c *Client) invokeConn(ctx context.Context, op string, call func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) error) error {
	return c.invoke(ctx, op, 0, func(ctx context.Context, qc quotadv1.QuotaClient, opts ...grpc.CallOption) error {
		qn, ok := qc.(quotaConn)
		if !ok {
			return status.Error(codes.Internal, "quotad: no connection for "+op)
		}
		return call(ctx, qn.cc, opts...)
	})
}

// quotaConn is a node's Quota client with the connection under it (for invokeConn).
type quotaConn struct {
	quotadv1.QuotaClient
	cc *grpc.ClientConn
}

// attempt performs one try against n and updates the leader from the response metadata.
func (c *Client) attempt(ctx context.Context, n *node, extra time.Duration, call rpcFunc) error {
	timeout := c.cfg.AttemptTimeout + extra
	if d, ok := ctx.Value(attemptMaxKey{}).(time.Duration); ok && d > 0 && d < timeout {
		timeout = d
	}
	actx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	actx = context.WithValue(actx, nodeAddrKey{}, n.addr)
	var hdr, trl metadata.MD
	err := call(actx, n.qc, grpc.Header(&hdr), grpc.Trailer(&trl))
	if err != nil && c.plaintext() && strings.Contains(err.Error(), prefaceError) {
		c.tlsProbes.probe(c.baseCtx, n.addr) // evidence for transportHint, gathered beside the call
	}
	leader := firstValue(hdr, trl)
	quiet := err != nil && silent(status.Code(err), leader)
	if !quiet {
		c.nodes.answered(n.addr)
	}
	switch {
	case leader != "" && leader != n.addr && (err == nil || !c.nodes.staleHint(leader)) && c.nodes.follow(leader):
	case err != nil && retryable(status.Code(err)):
		// No answer from this node: try the next one (a follower forwards to the leader).
		c.nodes.failed(n.addr, quiet)
	}
	return err
}

// silent reports whether a failed attempt had no answer from its node: not a refusal the
// node sends when overloaded or busy (ResourceExhausted, Aborted), and no leader header
// (a node that answers names the leader whenever it knows one).
func silent(code codes.Code, leader string) bool {
	switch code {
	case codes.ResourceExhausted, codes.Aborted:
		return false
	}
	return leader == ""
}

func firstValue(mds ...metadata.MD) string {
	for _, md := range mds {
		if v := md.Get(leaderHeader); len(v) > 0 && v[0] != "" {
			return v[0]
		}
	}
	return ""
}

// nodeAddrKey is the context key under which attempt passes the address of the node it
// asks to call (for errors that name the node: nodeErrors).
type nodeAddrKey struct{}

// attemptAddr is the address of the node an attempt's ctx is for ("" outside an attempt).
func attemptAddr(ctx context.Context) string {
	addr, _ := ctx.Value(nodeAddrKey{}).(string)
	return addr
}

// nodeErrors keeps the last error of each node a call tried, in the order they were first
// tried, so a call that ends without a decision names them all: when quorum is lost, the
// survivor's "no leader: … lost quorum" is what an operator needs, and it must not be hidden
// behind whichever dead node ("connection refused") the last attempt happened to try. The
// zero value is empty; not safe for concurrent use.
type nodeErrors struct {
	addrs []string
	errs  []error
}

// add records err as addr's last error (addr "" counts as a node of its own).
func (e *nodeErrors) add(addr string, err error) {
	for i, a := range e.addrs {
		if a == addr {
			e.errs[i] = err
			return
		}
	}
	e.addrs = append(e.addrs, addr)
	e.errs = append(e.errs, err)
}

// err is what to report: nil if nothing was recorded, the error itself for one node, and
// for several a copy listing each node's last error.
func (e *nodeErrors) err() error {
	switch len(e.errs) {
	case 0:
		return nil
	case 1:
		return e.errs[0]
	}
	return &perNodeError{addrs: slices.Clone(e.addrs), errs: slices.Clone(e.errs)}
}

// perNodeError is the last error of each of several nodes. It unwraps to them all.
type perNodeError struct {
	addrs []string
	errs  []error
}

func (e *perNodeError) Error() string {
	var b strings.Builder
	for i, a := range e.addrs {
		if i > 0 {
			b.WriteString("; ")
		}
		if a == "" {
			a = "(no node)"
		}
		b.WriteString(a + ": " + e.errs[i].Error())
	}
	return b.String()
}

func (e *perNodeError) Unwrap() []error { return e.errs }

// errRetryHorizon: the request ID is too old to be retried safely (Config.RetryHorizon).
var errRetryHorizon = errors.New("retry horizon reached: the cluster may no longer remember this request ID")

func (c *Client) unavailable(op string, attempts int, last, ctxErr error) error {
	if last == nil {
		return fmt.Errorf("%w: %s: no decision after %d attempts: %w", ErrUnavailable, op, attempts, ctxErr)
	}
	label := "last error"
	if _, ok := last.(*perNodeError); ok {
		label = "each node's last error"
	}
	return fmt.Errorf("%w: %s: no decision after %d attempts (%s: %v%s): %w", ErrUnavailable, op, attempts, label, last, c.transportHint(last), ctxErr)
}

// transportHint explains an error that says the client and the nodes disagree on TLS ("" for
// any other error): gRPC retries them as Unavailable, so without it a caller sees only its
// deadline pass. A plaintext client's prefaceError is explained only when a node it came from
// answered a TLS handshake (tlsProbes): the same words mean a node that dropped the
// connection (killed or restarting), and "set TLSFiles" would mislead there.
func (c *Client) transportHint(err error) string {
	msg := err.Error()
	switch {
	case c.plaintext() && strings.Contains(msg, prefaceError):
		addrs := c.tlsProbes.answered()
		if len(addrs) == 0 {
			return ""
		}
		slices.Sort(addrs)
		return fmt.Sprintf("; %s answered a TLS handshake: the cluster speaks TLS, set Config.TLSFiles or TLS — Config.LoadEnv reads $%s, $%s, $%s, which `quotad dev` writes to DATA_DIR/dev.env", strings.Join(addrs, ", "), EnvCACert, EnvClientCert, EnvClientKey)
	case !c.plaintext() && strings.Contains(msg, "first record does not look like a TLS handshake"):
		return "; the server does not speak TLS (a cluster run with --insecure?): leave TLS and TLSFiles unset"
	case !c.plaintext() && strings.Contains(msg, "missing selected ALPN property"):
		// A TLS server that does not speak HTTP/2: the node's HTTP port (--http-addr, 7401 by
		// default), not its gRPC port (user trial: the bare ALPN error said nothing of it).
		return "; the address answers TLS but not gRPC — is it a node's HTTP port (--http-addr, default 7401)? use its gRPC address (--grpc-addr, default 7101)"
	}
	return ""
}

// plaintext reports whether the client dials without TLS.
func (c *Client) plaintext() bool { return c.cfg.TLS == nil && c.cfg.TLSFiles.IsZero() }

func permanentError(op string, st *status.Status, err error) error {
	switch st.Code() {
	case codes.InvalidArgument:
		return fmt.Errorf("%w: %s: %s", ErrInvalid, op, st.Message())
	}
	return &callError{op: op, st: st, err: err}
}

// IsMessageTooLarge reports whether err is a node refusing a request above its message cap
// (ResourceExhausted "grpc: received message larger than max (N vs. M)", the agent's
// --max-request-bytes, default 1 MiB). Retrying cannot help: the request must be smaller, or
// every agent's cap larger.
func IsMessageTooLarge(err error) bool {
	st, ok := status.FromError(err)
	return ok && st.Code() == codes.ResourceExhausted && strings.Contains(st.Message(), "message larger than max")
}

// callError is a call the cluster refused: "quotad: <op>: <code>: <message>", read once
// (gRPC's own text, "rpc error: code = … desc = …", repeated the code and read as a second
// wrapping). It unwraps to the gRPC error, so status.Code and errors.As still find it.
type callError struct {
	op  string
	st  *status.Status
	err error
}

func (e *callError) Error() string {
	msg := "quotad: " + e.op + ": " + e.st.Code().String() + ": " + e.st.Message()
	if IsMessageTooLarge(e.err) {
		msg += " (the request is larger than a node accepts: send less per call, or raise --max-request-bytes on every agent)"
	}
	return msg
}

func (e *callError) Unwrap() error { return e.err }

// sleep waits d or until ctx ends; it reports whether the full d elapsed.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
