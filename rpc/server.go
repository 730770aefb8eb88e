// Package rpc serves quotad's gRPC API (quotad.v1 Quota and Admin, grpc.health.v1) and its HTTP
// endpoints (/metrics, /healthz, and with EnableDebug /debug/pprof, /debug/state) on top of one cluster node.
//
// It owns leader routing (a follower forwards to the leader and names it in the
// "x-quotad-leader" response header), group commit (concurrent calls share log entries) and
// input validation (a bad request is refused with a message and never reaches the log). It holds
// no quota logic: decisions are made by the FSM on every replica.
package rpc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/config"
	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/quota"
)

// Metadata keys.
const (
	// LeaderHeader is set on every response to the leader's gRPC address, when known.
	LeaderHeader = "x-quotad-leader"
	// forwardedHeader marks a call a follower forwarded, so it is never forwarded twice.
	forwardedHeader = "x-quotad-forwarded"
)

// Limits on one call, so one request cannot monopolise the leader.
const (
	MaxAdmissionsPerCall = 10000
	MaxDescriptors       = quota.MaxDescriptors
	MaxCost              = 1 << 40
	maxStringLen         = quota.MaxFieldBytes
)

// Node is what the server needs of a cluster node (*cluster.Node implements it).
type Node interface {
	Applier
	// Now returns the leader's FSM timestamp, or an error if this node is not an established
	// leader (for reading the time; commands take theirs through ApplyNow).
	Now() (int64, error)
	IsLeader() bool
	Leader() (id, grpcAddr string)
	VerifyRead(ctx context.Context) error
	Members() []cluster.Member
	// CommandVersion is the FSM command version this node writes entries at as leader, from
	// the Raft configuration and gossip (the cluster's effective version).
	CommandVersion() int
	TransferLeadership(to string) error
	RemoveServer(ctx context.Context, id string, force bool) ([]string, error)
}

// Server implements quotadv1.QuotaServer and quotadv1.AdminServer.
type Server struct {
	quotadv1.UnimplementedQuotaServer
	quotadv1.UnimplementedAdminServer

	node    Node
	fsm     *fsm.FSM
	prop    *proposer
	fwd     *forwarder
	metrics *Metrics
	fair    *fair // leader-side fair scheduler for waiting admissions (sched.go)
	// conns tracks the gRPC listener's connections (connlisten.go; nil when not served by
	// an Agent): a stream ended for --stream-send-timeout closes its connection.
	conns *connListener
	rls   *rlsServer // Envoy's rate limit service (envoy.go)

	limitsMu sync.Mutex // serializes ApplyLimits' read-merge-propose on the leader (limits.go)

	region *regionGate // a regional cluster's scope: global levels (region.go); nil: not regional

	// authn re-checks the token of an open AcquireStream (stream.go); nil: no tokens (tests
	// that build a Server without an agent).
	authn *authenticator
	// noStream refuses AcquireStream (AgentConfig.DisableAcquireStream).
	noStream bool
	// openStreams counts the AcquireStreams being served (quotad_acquire_streams).
	openStreams atomic.Int64
	// streamsByIdentity counts the open AcquireStreams per identity (per client_id for the
	// insecure identity), capped at maxStreamsPerIdentity (0: DefaultMaxStreamsPerIdentity).
	streamsMu             sync.Mutex
	streamsByIdentity     map[string]int
	maxStreamsPerIdentity int
	// streamSendTimeout ends an AcquireStream whose write of answers waits this long for the
	// client to read (0: DefaultStreamSendTimeout).
	streamSendTimeout time.Duration

	// maxWait caps an admission's max_wait_ms on this leader (--max-wait; 0: DefaultMaxWait).
	maxWait time.Duration

	// nodeCerts are the node certificates this node has seen (a revoke of one needs force);
	// clusterName is the cluster's name (its server certificates' SAN). Set by the agent.
	nodeCerts   *nodeCertSet
	clusterName string

	// insecure: the agent runs with --insecure, so callers without a credential are all
	// insecureIdentity (the waiter caps then count them by client_id only).
	insecure bool
}

// NewServer returns a server for node, whose state machine is f. forwardCreds secure calls
// forwarded to the leader (nil: plaintext). metrics may be nil.
func NewServer(node Node, f *fsm.FSM, pc ProposerConfig, forwardCreds credentials.TransportCredentials, metrics *Metrics) *Server {
	s := &Server{node: node, fsm: f, prop: newProposer(node, pc), fwd: newForwarder(forwardCreds), metrics: metrics}
	if metrics != nil {
		s.prop.observe = metrics.observeCommit
		metrics.registerShares(f)
	}
	s.fair = newFair(s)
	s.rls = &rlsServer{s: s}
	s.SetRLSOptions(RLSOptions{})
	return s
}

// Register registers the Quota and Admin services, Envoy's RateLimitService and the
// node-to-node Peer service on g.
func (s *Server) Register(g *grpc.Server) {
	quotadv1.RegisterQuotaServer(g, s)
	quotadv1.RegisterAdminServer(g, s)
	rlsv3.RegisterRateLimitServiceServer(g, s.rls)
	quotadv1.RegisterPeerServer(g, &peerServer{r: s.rls})
}

// Close stops group commit and closes forwarding connections.
func (s *Server) Close() {
	s.fair.close()
	s.prop.close()
	s.fwd.close()
}

// route decides where a call runs. It returns a connection to forward to, or nil to run here.
// It always sets the leader header when the leader is known.
func (s *Server) route(ctx context.Context) (*grpc.ClientConn, error) {
	_, leaderAddr := s.node.Leader()
	if leaderAddr != "" {
		_ = grpc.SetHeader(ctx, metadata.Pairs(LeaderHeader, leaderAddr))
	}
	if s.node.IsLeader() {
		return nil, nil
	}
	if leaderAddr == "" {
		return nil, status.Error(codes.Unavailable, "no leader: the cluster is electing one or has lost quorum; retry shortly or check `quotad status`")
	}
	if md, ok := metadata.FromIncomingContext(ctx); ok && len(md.Get(forwardedHeader)) > 0 {
		return nil, status.Errorf(codes.Unavailable, "not the leader (leader is %s); the call was already forwarded once — retry there", leaderAddr)
	}
	conn, err := s.fwd.conn(leaderAddr)
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "leader %s unreachable: %v", leaderAddr, err)
	}
	return conn, nil
}

// forwardCtx marks a call as forwarded and passes the caller on to the leader: a token caller's
// authorization header (the leader authenticates it again), any other caller's identity as a
// principal, which the leader believes because this node's certificate has the server role.
// Nothing the client sent besides the token is passed on (a principal it sent is not).
func forwardCtx(ctx context.Context) context.Context {
	kv := []string{forwardedHeader, "1"}
	c := callerFrom(ctx)
	switch {
	case c.viaToken:
		md, _ := metadata.FromIncomingContext(ctx)
		for _, v := range md.Get(authorizationHeader) {
			kv = append(kv, authorizationHeader, v)
		}
	case !c.id.IsZero():
		kv = append(kv, auth.PrincipalHeader, auth.EncodePrincipal(c.id))
	}
	return metadata.AppendToOutgoingContext(ctx, kv...)
}

// Acquire decides a batch of admissions.
func (s *Server) Acquire(ctx context.Context, req *quotadv1.AcquireRequest) (*quotadv1.AcquireResponse, error) {
	if err := validateAcquire(req); err != nil {
		return nil, err
	}
	id := IdentityFrom(ctx)
	for i, adm := range req.Admissions {
		if err := s.admissionChecks(id, i, adm); err != nil {
			return nil, err
		}
	}
	if resp, ok := s.plantedFollowerDecides(req); ok {
		return resp, nil
	}
	conn, err := s.route(ctx)
	if err != nil {
		return nil, err
	}
	if conn != nil {
		return quotadv1.NewQuotaClient(conn).Acquire(forwardCtx(ctx), req)
	}
	if s.region != nil {
		return s.regionAcquire(ctx, req, id) // scope: global levels first (region.go)
	}
	return s.acquireLeader(ctx, req, id)
}

// acquireLeader decides req on the leader. A max_wait_ms above the node's --max-wait is
// capped to it, and a denial of such an admission says so.
func (s *Server) acquireLeader(ctx context.Context, req *quotadv1.AcquireRequest, id auth.Identity) (*quotadv1.AcquireResponse, error) {
	asked := s.capWaits(req)
	resp, err := s.decideLeader(ctx, req, id)
	if asked != nil && resp != nil {
		for i, d := range resp.Decisions {
			if asked[i] > 0 && d != nil && !d.Admitted {
				d.Message = strings.TrimSpace(d.Message + fmt.Sprintf(" (max_wait_ms %d was capped at %d, this cluster's --max-wait %v)", asked[i], req.Admissions[i].MaxWaitMs, s.maxWaitCap()))
			}
		}
	}
	return resp, err
}

// DefaultMaxWait caps how long the leader queues one admission (--max-wait). The Go client
// asks for at most client.MaxServerWait (30 s) per call and asks again; a wait for hours would
// hold a waiter slot and a goroutine that long, and the queues are soft state a leader change
// loses anyway.
const DefaultMaxWait = 5 * time.Minute

func (s *Server) maxWaitCap() time.Duration {
	if s.maxWait <= 0 {
		return DefaultMaxWait
	}
	return s.maxWait
}

// capWaits lowers every max_wait_ms of req above the cap to it and returns what each capped
// admission asked for (0 for the others), or nil when none was capped.
func (s *Server) capWaits(req *quotadv1.AcquireRequest) []int64 {
	limit := s.maxWaitCap().Milliseconds()
	var asked []int64
	for i, adm := range req.Admissions {
		if adm.GetMaxWaitMs() > limit {
			if asked == nil {
				asked = make([]int64, len(req.Admissions))
			}
			asked[i], adm.MaxWaitMs = adm.MaxWaitMs, limit
		}
	}
	return asked
}

// decideLeader decides req on the leader (its waits capped).
func (s *Server) decideLeader(ctx context.Context, req *quotadv1.AcquireRequest, id auth.Identity) (*quotadv1.AcquireResponse, error) {
	var seen gateSeen
	if nonWaitingHook.Load() != nil {
		// Traced (tests): route and read what the scheduler holds in one look under its
		// lock, so a check that skips the gate wrongly shows in the trace.
		var handled bool
		if handled, seen = s.fair.handlesSeen(req); handled {
			return s.fair.acquire(ctx, req, id.Name, id.Cert)
		}
	} else if s.fair.handles(req) {
		return s.fair.acquire(ctx, req, id.Name, id.Cert)
	}
	start := time.Now()
	n := len(req.Admissions)
	resp := &quotadv1.AcquireResponse{Decisions: make([]*quotadv1.Decision, n)}
	// One slab for the answers and one buffer for the encoded ops: a call of n admissions
	// costs a handful of allocations, not a few per admission.
	slab := make([]quotadv1.Decision, n)
	ops := make([][]byte, 0, n)
	idx := make([]int, 0, n)
	buf := make([]byte, 0, n*(64+len(req.ClientId)+len(id.Name)))
	for i, adm := range req.Admissions {
		if msg := admissionProblem(adm); msg != "" {
			slab[i] = quotadv1.Decision{Reason: string(quota.ReasonInvalid), Message: msg}
			resp.Decisions[i] = &slab[i]
			continue
		}
		from := len(buf)
		buf = fsm.AppendOwnedAcquireOp(buf, id.Name, req.ClientId, adm)
		ops = append(ops, buf[from:len(buf):len(buf)])
		idx = append(idx, i)
	}
	if len(ops) > 0 {
		// buf may have been reallocated while appending: re-slice every op from the final one.
		off := 0
		for j, op := range ops {
			ops[j] = buf[off : off+len(op) : off+len(op)]
			off += len(op)
		}
		c, err := s.prop.do(ctx, ops)
		if err != nil {
			return nil, s.applyError(err)
		}
		var errs []error
		for j, r := range c.results {
			if r.err != nil {
				errs = append(errs, r.err)
				continue
			}
			i := idx[j]
			setDecision(&slab[i], &r.res.Decision)
			resp.Decisions[i] = &slab[i]
			if r.res.Decision.Admitted && r.res.Decision.RetryAfter > 0 {
				// A scheduled grant: here only a retry answered from the dedup table (a fresh
				// admission is scheduled only if it waits, and those go through the scheduler),
				// sent without max_wait_ms (the request's fingerprint leaves it out) while
				// nothing waits. Held as the scheduler holds one (never before the original,
				// which an exchange may have moved), not handed over with its retry_after_ms.
				if err := s.fair.hold(ctx, r); err != nil {
					return nil, err
				}
				slab[i].RetryAfterMs = 0
			}
		}
		if err := errors.Join(errs...); err != nil {
			return nil, s.applyError(err)
		}
	}
	s.metrics.observeDecisions(resp.Decisions, time.Since(start))
	if nonWaitingHook.Load() != nil {
		for i, d := range resp.Decisions {
			traceNonWaiting(req.Admissions[i], d, seen)
		}
	}
	return resp, nil
}

// applyError maps a failure to commit into a gRPC status a client can act on.
func (s *Server) applyError(err error) error {
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return status.Error(codes.DeadlineExceeded, "no decision before the deadline; the outcome is unknown — retry with the same request ID")
	case errors.Is(err, cluster.ErrNotLeader):
		_, addr := s.node.Leader()
		return status.Errorf(codes.Unavailable, "leadership changed (leader now %q); the outcome is unknown — retry with the same request ID", addr)
	case errors.Is(err, errStopped):
		return status.Error(codes.Unavailable, "node is shutting down; retry on another node")
	default:
		return status.Errorf(codes.Unavailable, "commit failed, outcome unknown — retry with the same request ID: %v", err)
	}
}

func validateAcquire(req *quotadv1.AcquireRequest) error {
	switch {
	case req.ClientId == "":
		return status.Error(codes.InvalidArgument, "client_id is empty; set a stable ID per client so retries can be deduplicated")
	case len(req.ClientId) > maxStringLen:
		return status.Errorf(codes.InvalidArgument, "client_id is %d bytes; the limit is %d bytes", len(req.ClientId), maxStringLen)
	case len(req.Admissions) == 0:
		return status.Error(codes.InvalidArgument, "no admissions in the request; send at least one")
	case len(req.Admissions) > MaxAdmissionsPerCall:
		return status.Errorf(codes.InvalidArgument, "%d admissions in one call; split into calls of at most %d", len(req.Admissions), MaxAdmissionsPerCall)
	}
	return nil
}

// admissionProblem returns why adm can never be decided, or "".
func admissionProblem(adm *quotadv1.Admission) string {
	switch {
	case adm == nil:
		return "admission is empty"
	case adm.RequestId == 0:
		return "request_id is 0; use a unique non-zero ID per request and reuse it only on retries"
	case adm.Domain == "":
		return "domain is empty; name the limits domain to charge"
	case len(adm.Domain) > maxStringLen:
		return fieldProblem("domain", adm.Domain)
	case len(adm.WorkClass) > maxStringLen:
		return fieldProblem("work_class", adm.WorkClass)
	case adm.Cost > MaxCost:
		return fmt.Sprintf("cost %d is above the maximum %d; a cost is counted in the units of the limits' requests_per_unit: split the work into requests of smaller cost, or count it in a coarser unit (and scale requests_per_unit to match)", adm.Cost, uint64(MaxCost))
	case adm.LeaseTtlMs < 0:
		return fmt.Sprintf("lease_ttl_ms %d is negative; use 0 for the configured TTL or a positive number", adm.LeaseTtlMs)
	case adm.MaxWaitMs < 0:
		return fmt.Sprintf("max_wait_ms %d is negative", adm.MaxWaitMs)
	}
	return entriesProblem("descriptors", adm.Descriptors)
}

func decisionToProto(d fsm.Decision) *quotadv1.Decision {
	pd := &quotadv1.Decision{}
	setDecision(pd, &d)
	return pd
}

// setDecision fills a zero pd from d.
func setDecision(pd *quotadv1.Decision, d *fsm.Decision) {
	pd.Admitted = d.Admitted
	pd.Reason = string(d.Reason)
	pd.Scope = d.Scope
	pd.Limit = d.Limit
	pd.Remaining = d.Remaining
	pd.ResetAfterMs = ceilMs(d.ResetAfter)
	pd.RetryAfterMs = ceilMs(d.RetryAfter)
	pd.LeaseId = d.LeaseID
	pd.LeaseTtlMs = d.LeaseTTL.Milliseconds()
	pd.Message = d.Message
	pd.WindowMs = d.Window.Milliseconds()
}

// ceilMs rounds up, so a client that waits retry_after_ms is never early.
func ceilMs(d time.Duration) int64 {
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}

// Release returns a lease's permits.
func (s *Server) Release(ctx context.Context, req *quotadv1.ReleaseRequest) (*quotadv1.ReleaseResponse, error) {
	if req.LeaseId == 0 {
		return nil, status.Error(codes.InvalidArgument, "lease_id is 0; pass the lease_id from an admitted decision")
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewQuotaClient(conn).Release(forwardCtx(ctx), req)
	}
	r, err := s.prop.propose(ctx, &fsmv1.Op{Op: &fsmv1.Op_Release{Release: &fsmv1.Release{LeaseId: req.LeaseId, Owner: leaseOwner(ctx)}}})
	if err != nil {
		return nil, s.applyError(err)
	}
	if errors.Is(r.Other.Err, quota.ErrNotOwner) {
		return nil, notOwner(ctx, req.LeaseId)
	}
	return &quotadv1.ReleaseResponse{Released: r.Other.Released}, nil
}

// Renew extends a lease.
func (s *Server) Renew(ctx context.Context, req *quotadv1.RenewRequest) (*quotadv1.RenewResponse, error) {
	if req.LeaseId == 0 {
		return nil, status.Error(codes.InvalidArgument, "lease_id is 0; pass the lease_id from an admitted decision")
	}
	if req.LeaseTtlMs < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "lease_ttl_ms %d is negative; use 0 to keep the lease's TTL", req.LeaseTtlMs)
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewQuotaClient(conn).Renew(forwardCtx(ctx), req)
	}
	ttl := time.Duration(req.LeaseTtlMs) * time.Millisecond
	r, err := s.prop.propose(ctx, &fsmv1.Op{Op: &fsmv1.Op_Renew{Renew: &fsmv1.Renew{LeaseId: req.LeaseId, TtlNs: int64(ttl), Owner: leaseOwner(ctx)}}})
	if err != nil {
		return nil, s.applyError(err)
	}
	if err := r.Other.Err; err != nil {
		if errors.Is(err, quota.ErrNotOwner) {
			return nil, notOwner(ctx, req.LeaseId)
		}
		if errors.Is(err, quota.ErrLeaseNotFound) {
			return nil, status.Errorf(codes.NotFound, "lease %d expired or was released; acquire again", req.LeaseId)
		}
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	return &quotadv1.RenewResponse{LeaseTtlMs: r.Other.LeaseTTL.Milliseconds()}, nil
}

// Refund returns the tokens of an admitted request that was not sent.
func (s *Server) Refund(ctx context.Context, req *quotadv1.RefundRequest) (*quotadv1.RefundResponse, error) {
	if req.ClientId == "" || req.RequestId == 0 {
		return nil, status.Errorf(codes.InvalidArgument, "client_id %q and request_id %d must both be set: they name the admitted request to refund", req.ClientId, req.RequestId)
	}
	if err := invalidArg(fieldProblem("client_id", req.ClientId)); err != nil {
		return nil, err
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewQuotaClient(conn).Refund(forwardCtx(ctx), req)
	}
	// The refund looks the request up in the caller's own namespace: another identity's
	// request with the same IDs is not found (outcome not_found).
	owner := IdentityFrom(ctx).Name
	r, err := s.prop.propose(ctx, &fsmv1.Op{Op: &fsmv1.Op_Refund{Refund: &fsmv1.Refund{ClientId: req.ClientId, RequestId: req.RequestId, Owner: owner}}})
	if err != nil {
		return nil, s.applyError(err)
	}
	o := r.Other
	return &quotadv1.RefundResponse{Refunded: o.Refunded, Outcome: string(o.RefundOutcome), BucketsKept: uint32(o.BucketsKept)}, nil
}

// Feedback records a provider's 429/503 for the scope it names. The FSM decides (on every
// replica) what it pauses and adapts; see quota.Engine.Feedback: a 429 without a reason for a
// whole domain is not assumed global and changes nothing (it is counted as evidence only).
//
// The caller needs the worker role for the domain (and, if scoped to a tenant, must name its
// tenant). A Retry-After longer than the domain's max_pause (default quota.DefaultMaxPause) is
// clamped to it by the leader before the feedback enters the log; `quotad pause lift` ends a
// pause early.
func (s *Server) Feedback(ctx context.Context, req *quotadv1.FeedbackRequest) (*quotadv1.FeedbackResponse, error) {
	if req.Domain == "" {
		return nil, status.Error(codes.InvalidArgument, "domain is empty; name the limits domain the provider answered for")
	}
	if req.RetryAfterMs < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "retry_after_ms %d is negative; use 0 when the provider sent no Retry-After", req.RetryAfterMs)
	}
	if req.StatusCode != quota.StatusTooManyRequests && req.StatusCode != quota.StatusServiceUnavailable {
		return nil, status.Errorf(codes.InvalidArgument, "status_code %d is not 429 or 503; report only the provider's throttling answers", req.StatusCode)
	}
	if err := invalidArg(firstProblem(fieldProblem("domain", req.Domain), entriesProblem("descriptors", req.Descriptors), fieldProblem("reason", req.Reason))); err != nil {
		return nil, err
	}
	if msg := scopeProblem(IdentityFrom(ctx), req.Domain, req.Descriptors, true); msg != "" {
		return nil, permissionDenied("feedback: %s", msg)
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewQuotaClient(conn).Feedback(forwardCtx(ctx), req)
	}
	maxPause := s.fsm.Limits().MaxPauseOf(req.Domain)
	d, clamped := maxPause, req.RetryAfterMs > maxPause.Milliseconds()
	if !clamped {
		d = time.Duration(req.RetryAfterMs) * time.Millisecond
	}
	r, err := s.prop.propose(ctx, &fsmv1.Op{Op: &fsmv1.Op_Feedback{Feedback: &fsmv1.Feedback{Domain: req.Domain, Prefix: req.Descriptors,
		StatusCode: req.StatusCode, RetryAfterNs: int64(d), Reason: req.Reason}}})
	if err != nil {
		return nil, s.applyError(err)
	}
	if err := r.Other.Err; err != nil {
		if errors.Is(err, quota.ErrUnknownDomain) {
			return nil, status.Error(codes.NotFound, err.Error())
		}
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	fb := r.Other.Feedback
	s.metrics.observeFeedback(req.Domain, req.StatusCode, fb)
	resp := &quotadv1.FeedbackResponse{PausedForMs: ceilMs(fb.PausedFor), Scope: fb.Scope,
		Attributed: fb.Attributed, Decreased: fb.Decreased, Limit: fb.Limit}
	if clamped && fb.PausedFor > 0 {
		resp.ClampedToMaxPauseMs = maxPause.Milliseconds()
	}
	return resp, nil
}

// Status reads buckets linearizably: leadership is verified with a quorum and the read waits
// for everything committed before it to be applied.
func (s *Server) Status(ctx context.Context, req *quotadv1.StatusRequest) (*quotadv1.StatusResponse, error) {
	if req.Domain == "" {
		return nil, status.Error(codes.InvalidArgument, "domain is empty")
	}
	if err := invalidArg(firstProblem(fieldProblem("domain", req.Domain), entriesProblem("descriptors", req.Descriptors))); err != nil {
		return nil, err
	}
	if msg := scopeProblem(IdentityFrom(ctx), req.Domain, req.Descriptors, false); msg != "" {
		return nil, permissionDenied("status: %s", msg)
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewQuotaClient(conn).Status(forwardCtx(ctx), req)
	}
	if err := s.node.VerifyRead(ctx); err != nil {
		return nil, s.applyError(err)
	}
	path := make([]quota.Entry, len(req.Descriptors))
	for i, e := range req.Descriptors {
		path[i] = quota.Entry{Key: e.Key, Value: e.Value}
	}
	bs, err := s.fsm.Status(req.Domain, path)
	if err != nil {
		return nil, statusReadError(err)
	}
	id, _ := s.node.Leader()
	resp := &quotadv1.StatusResponse{AppliedIndex: s.fsm.AppliedIndex(), LeaderId: id}
	for _, b := range bs {
		resp.Buckets = append(resp.Buckets, &quotadv1.BucketStatus{
			Scope: b.Scope, Key: b.Key, Limit: b.Limit, Burst: b.Burst, Remaining: b.Remaining,
			ResetAfterMs: ceilMs(b.ResetAfter), InFlight: b.InFlight, MaxInFlight: b.MaxInFlight,
			PausedForMs: ceilMs(b.PausedFor), WindowMs: b.Window.Milliseconds(),
			LentLimit: b.LentLimit, LentBurst: b.LentBurst, Ceiling: b.Ceiling,
		})
	}
	return resp, nil
}

func (s *Server) applyLimits(ctx context.Context, limits *quota.Limits) (uint64, error) {
	if limits.UsesMaxKeysPerParent() {
		if err := s.everyNodeApplies(fsm.MaxKeysPerParentVersion, "max_keys_per_parent"); err != nil {
			return 0, err
		}
	}
	data, err := json.Marshal(limits)
	if err != nil {
		return 0, status.Errorf(codes.Internal, "encoding limits: %v", err)
	}
	r, err := s.prop.propose(ctx, &fsmv1.Op{Op: &fsmv1.Op_SetLimits{SetLimits: &fsmv1.SetLimits{LimitsJson: data}}})
	if err != nil {
		return 0, s.applyError(err)
	}
	if err := r.Other.Err; err != nil {
		return 0, status.Error(codes.InvalidArgument, err.Error())
	}
	return r.Other.LimitsVersion, nil
}

// everyNodeApplies refuses (FailedPrecondition) limits using feature unless every node of the
// Raft configuration advertises fsm command version version or newer: an older node would
// ignore the feature and decide differently from the others (fsm.CommandVersion).
func (s *Server) everyNodeApplies(version int, feature string) error {
	for _, m := range s.node.Members() {
		if m.Suffrage == "" || m.CommandVersion >= version {
			continue
		}
		has := fmt.Sprintf("advertises command version %d", m.CommandVersion)
		if m.CommandVersion == 0 {
			has = "advertises no command version (a build before version 6, or not seen in gossip)"
		}
		return status.Errorf(codes.FailedPrecondition, "the limits use %s, which needs fsm command version %d on every node, and node %s %s; "+
			"upgrade it first (docs/operations.md, Upgrades) or remove %s", feature, version, m.ID, has, feature)
	}
	return nil
}

// GetLimits returns the limits in force, linearizably, as YAML that ApplyLimits accepts (to a
// worker, only the domains it may use).
func (s *Server) GetLimits(ctx context.Context, req *quotadv1.GetLimitsRequest) (*quotadv1.GetLimitsResponse, error) {
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewAdminClient(conn).GetLimits(forwardCtx(ctx), req)
	}
	if err := s.node.VerifyRead(ctx); err != nil {
		return nil, s.applyError(err)
	}
	l := visibleLimits(IdentityFrom(ctx), s.fsm.Limits()) // region.go
	return &quotadv1.GetLimitsResponse{Version: l.Version, Yaml: string(config.Format(l))}, nil
}

// Members lists the cluster's servers as this node sees them (answered locally, so it works
// without a leader — that is when an operator needs it most).
func (s *Server) Members(ctx context.Context, _ *quotadv1.MembersRequest) (*quotadv1.MembersResponse, error) {
	resp := &quotadv1.MembersResponse{CommandVersion: int32(s.node.CommandVersion())}
	for _, m := range s.node.Members() {
		pm := &quotadv1.Member{
			Id: m.ID, GrpcAddr: m.GRPCAddr, RaftAddr: m.RaftAddr, Suffrage: m.Suffrage,
			State: m.State, AppliedIndex: m.AppliedIndex, GossipAddr: m.GossipAddr, HttpAddr: m.HTTPAddr,
			CommandVersion: int32(m.CommandVersion),
		}
		if m.State == "leader" {
			resp.Leader = pm
		}
		resp.Members = append(resp.Members, pm)
	}
	s.regionMembers(ctx, resp) // region.go
	return resp, nil
}

// TransferLeadership hands leadership to another voter.
func (s *Server) TransferLeadership(ctx context.Context, req *quotadv1.TransferLeadershipRequest) (*quotadv1.TransferLeadershipResponse, error) {
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewAdminClient(conn).TransferLeadership(forwardCtx(ctx), req)
	}
	if self, _ := s.node.Leader(); req.To != "" && req.To == self && s.node.IsLeader() {
		// Already the leader: nothing to hand over (an operator making sure of it, a script).
		return &quotadv1.TransferLeadershipResponse{LeaderId: req.To, AlreadyLeader: true}, nil
	}
	if err := s.node.TransferLeadership(req.To); err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "transferring leadership to %q: %v", req.To, err)
	}
	id, _ := s.node.Leader()
	return &quotadv1.TransferLeadershipResponse{LeaderId: id}, nil
}

// leaseOwner is the owner a Release or Renew acts as: the caller, or "" (any lease) for an
// admin.
func leaseOwner(ctx context.Context) string {
	id := IdentityFrom(ctx)
	if id.Role == auth.RoleAdmin {
		return ""
	}
	return id.Name
}

func notOwner(ctx context.Context, lease uint64) error {
	return permissionDenied("lease %d belongs to another caller, not %s; only its owner (or an admin) may release or renew it", lease, IdentityFrom(ctx))
}
