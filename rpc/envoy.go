package rpc

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/quota"
)

// Envoy's rate limit service, envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit, on
// the same listener, authentication and leader routing as the native API. A request is one op
// (quota.Engine.RateLimit decides all its descriptors together) in the leader's group commit;
// a follower forwards it to the leader. docs/envoy.md says what is identical to
// envoyproxy/ratelimit and what differs.

// RLS response header modes (RLSOptions.Headers).
const (
	RLSHeadersOff        = ""            // no headers (envoyproxy/ratelimit's default)
	RLSHeadersRateLimit  = "ratelimit"   // RateLimit-Limit, -Remaining, -Reset (+ -Scope)
	RLSHeadersXRateLimit = "x-ratelimit" // X-RateLimit-Limit, -Remaining, -Reset (+ -Scope)
)

// DefaultNearLimitRatio is envoyproxy/ratelimit's NEAR_LIMIT_RATIO default.
const DefaultNearLimitRatio = 0.8

// RLSOptions configure the Envoy rate limit service.
type RLSOptions struct {
	// DenyUnknownDomain answers OVER_LIMIT for a domain the limits do not define. Off (the
	// default), such a request is OK, as envoyproxy/ratelimit answers it.
	DenyUnknownDomain bool
	// Headers chooses the response_headers_to_add: RLSHeadersOff, RLSHeadersRateLimit (the
	// names envoyproxy/ratelimit writes with LIMIT_RESPONSE_HEADERS_ENABLED) or
	// RLSHeadersXRateLimit; both add quotad's <prefix>-Scope, the level that answered.
	Headers string
	// NearLimitRatio is the share of a limit above which hits count as near_limit (0: 0.8).
	NearLimitRatio float64
	// AllowLimitOverride accepts a descriptor's own `limit` (Envoy's per-descriptor override,
	// envoyproxy/ratelimit's meaning). Off (the default) such a request is refused: the
	// override replaces the configured limit, so any caller allowed to call RLS — a worker
	// bound to one tenant included — could raise its own limit, or fill max_keys with buckets
	// that refill once a year. Turn it on only when the RLS callers are trusted gateways.
	AllowLimitOverride bool
}

// Validate reports an option that cannot work.
func (o RLSOptions) Validate() error {
	switch o.Headers {
	case RLSHeadersOff, RLSHeadersRateLimit, RLSHeadersXRateLimit:
	default:
		return fmt.Errorf("rpc: RLS headers %q: use %q, %q or \"\" (none)", o.Headers, RLSHeadersRateLimit, RLSHeadersXRateLimit)
	}
	if o.NearLimitRatio < 0 || o.NearLimitRatio > 1 {
		return fmt.Errorf("rpc: RLS near-limit ratio %v: use 0 < ratio <= 1 (default %v)", o.NearLimitRatio, DefaultNearLimitRatio)
	}
	return nil
}

// SetRLSOptions sets the Envoy RLS options (call before serving).
func (s *Server) SetRLSOptions(o RLSOptions) {
	if o.NearLimitRatio == 0 {
		o.NearLimitRatio = DefaultNearLimitRatio
	}
	s.rls.opts = o
}

// unknownDomainLogEvery is how often a request for one unknown domain is logged again.
const unknownDomainLogEvery = time.Minute

// setLogger sets where the RLS logs what an operator must see (call before serving).
func (s *Server) setLogger(l *slog.Logger) { s.rls.unknown = newKeyLogger(l, unknownDomainLogEvery) }

// observe records a decided request: metrics, and a (rate-limited) warning for a domain the
// limits do not define — with --rls-unknown-domain allow it is answered OK and would
// otherwise pass unseen (a typo in Envoy's domain disables rate limiting).
func (r *rlsServer) observe(match *quota.Matcher, req *rlsv3.RateLimitRequest, d *quota.RLSDecision, code rlsv3.RateLimitResponse_Code, start time.Time) {
	r.s.metrics.observeRLS(match, req, d, code, r.opts.NearLimitRatio, time.Since(start))
	if d.UnknownDomain {
		answer := "OK (--rls-unknown-domain allow): not rate limited"
		if r.opts.DenyUnknownDomain {
			answer = "OVER_LIMIT (--rls-unknown-domain deny)"
		}
		r.unknown.Warn("Envoy RLS request for a domain the limits do not define; check Envoy's rate limit domain or add it to the limits",
			"domain", req.Domain, "answer", answer)
	}
}

// rlsServer implements rlsv3.RateLimitServiceServer for a Server.
type rlsServer struct {
	rlsv3.UnimplementedRateLimitServiceServer
	s    *Server
	opts RLSOptions
	// authn authenticates the token callers of forwarded calls (nil: the server runs without
	// the agent's authentication, and a forwarded call acts as the forwarding caller).
	authn *authenticator

	lanesMu  sync.Mutex
	lanes    map[*grpc.ClientConn]*forwardLane // a follower's batching, per leader connection
	lastLane *forwardLane                      // the lane of the leader calls went to last
	// unknown logs requests for domains the limits do not define (nil: not logged).
	unknown *keyLogger
	// batchBytes bounds the encoded requests of one forwarded batch: half the node's
	// --max-request-bytes (0: of DefaultMaxRequestBytes), so a batch is never refused whole
	// by the leader's message cap; a request above a quarter of it goes alone.
	batchBytes int
}

// forwardBatchBytes is rlsServer.batchBytes with its default.
func (r *rlsServer) forwardBatchBytes() int {
	if r.batchBytes > 0 {
		return r.batchBytes
	}
	return DefaultMaxRequestBytes / 2
}

// ShouldRateLimit decides one Envoy request.
func (r *rlsServer) ShouldRateLimit(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	s := r.s
	// A follower forwards at once: the leader validates and authorizes the request (as the
	// caller, whose identity rides along); doing it here too only repeated the work. Calls
	// forwarded at the same time share one RPC (envoy_forward.go).
	conn, err := s.route(ctx)
	if err != nil {
		return nil, err
	}
	if conn != nil {
		return r.forward(ctx, conn, req)
	}
	start := time.Now()
	op, err := r.authorize(IdentityFrom(ctx), req)
	if err != nil {
		return nil, err
	}
	if resp, handled, err := r.regional(ctx, req, op, start); handled {
		return resp, err
	}
	data, err := encodeRLS(op)
	if err != nil {
		return nil, err
	}
	c, err := s.prop.submit(ctx, [][]byte{data})
	if err == nil {
		err = s.prop.wait(ctx, c)
	}
	if err != nil {
		return nil, s.applyError(err)
	}
	return r.finish(req, c.results[0], start)
}

// authorize validates an Envoy request, authorizes id for it, and returns its log op.
func (r *rlsServer) authorize(id auth.Identity, req *rlsv3.RateLimitRequest) (*fsmv1.RateLimit, error) {
	op, err := rlsOp(req)
	if err != nil {
		return nil, err
	}
	if err := r.overrideProblem(op); err != nil {
		return nil, err
	}
	for i, d := range op.Descriptors {
		if msg := scopeProblem(id, req.Domain, d.Entries, true); msg != "" {
			return nil, permissionDenied("descriptors[%d]: %s", i, msg)
		}
		if msg := r.s.tenantPathProblem(id, req.Domain, d.Entries); msg != "" {
			return nil, permissionDenied("descriptors[%d]: %s", i, msg)
		}
	}
	return op, nil
}

// regional decides a request on a regional cluster's leader whose scope: global rules come
// from the leader's shares (region_rls.go); handled is false elsewhere, and for requests the
// regional FSM alone decides.
func (r *rlsServer) regional(ctx context.Context, req *rlsv3.RateLimitRequest, op *fsmv1.RateLimit, start time.Time) (*rlsv3.RateLimitResponse, bool, error) {
	if r.s.region == nil {
		return nil, false, nil
	}
	return r.regionShouldRateLimit(ctx, req, op, start)
}

// encodeRLS encodes an authorized request's log op.
func encodeRLS(op *fsmv1.RateLimit) ([]byte, error) {
	data, err := fsm.EncodeOp(&fsmv1.Op{Op: &fsmv1.Op_RateLimit{RateLimit: op}})
	if err != nil {
		return nil, status.Errorf(codes.Internal, "encoding the op: %v", err)
	}
	return data, nil
}

// finish turns a committed request's result into Envoy's answer and counts it (start: when
// the leader received the request).
func (r *rlsServer) finish(req *rlsv3.RateLimitRequest, pr proposalResult, start time.Time) (*rlsv3.RateLimitResponse, error) {
	if pr.err != nil {
		return nil, r.s.applyError(pr.err)
	}
	d := pr.res.Other.RateLimit
	if d.Code == quota.RLSUnknown { // the engine's own check; rlsOp should have caught it
		return nil, status.Errorf(codes.InvalidArgument, "%s", d.Message)
	}
	resp := r.response(&d)
	r.observe(pr.res.Other.Matcher, req, &d, resp.OverallCode, start)
	return resp, nil
}

// overrideProblem refuses a descriptor's own limit unless RLSOptions.AllowLimitOverride.
func (r *rlsServer) overrideProblem(op *fsmv1.RateLimit) error {
	if r.opts.AllowLimitOverride {
		return nil
	}
	for i, d := range op.Descriptors {
		if d.HasLimit {
			return permissionDenied("descriptors[%d].limit: per-descriptor limit overrides are off on this cluster (an override replaces the configured limit, so any RLS caller could set its own); remove the limit from Envoy's rate_limits action, or start every agent with --rls-limit-overrides if only trusted gateways call the rate limit service (docs/envoy.md)", i)
		}
	}
	return nil
}

// rlsOp validates an Envoy request and turns it into its log op. Errors are InvalidArgument
// (Envoy's own service answers an empty domain or descriptor list with an error, too).
func rlsOp(req *rlsv3.RateLimitRequest) (*fsmv1.RateLimit, error) {
	switch {
	case req.GetDomain() == "":
		return nil, status.Error(codes.InvalidArgument, "domain is empty; set the rate limit domain (rate_limit_service's domain in Envoy's filter)")
	case len(req.Domain) > maxStringLen:
		return nil, status.Errorf(codes.InvalidArgument, "%s", fieldProblem("domain", req.Domain))
	case len(req.Descriptors) == 0:
		return nil, status.Error(codes.InvalidArgument, "no descriptors; send at least one (Envoy's rate_limits actions produce them)")
	case len(req.Descriptors) > quota.MaxRLSDescriptors:
		return nil, status.Errorf(codes.InvalidArgument, "%d descriptors; at most %d are allowed per request", len(req.Descriptors), quota.MaxRLSDescriptors)
	}
	op := &fsmv1.RateLimit{Domain: req.Domain, Hits: uint64(req.HitsAddend), Descriptors: make([]*fsmv1.RateLimitDescriptor, len(req.Descriptors))}
	// One allocation for all descriptors and one for all entries, not one each.
	ods := make([]fsmv1.RateLimitDescriptor, len(req.Descriptors))
	n := 0
	for _, d := range req.Descriptors {
		n += len(d.GetEntries())
	}
	all := make([]quotadv1.Entry, n)
	for i, d := range req.Descriptors {
		field := rlsFields[i] // i < MaxRLSDescriptors: checked above
		if len(d.GetEntries()) == 0 {
			return nil, status.Errorf(codes.InvalidArgument, "%s has no entries; every descriptor needs at least one", field)
		}
		if d.GetIsNegativeHits() {
			// envoyproxy/ratelimit (the version make test-envoy builds) ignores the flag and
			// charges the hits; quotad refuses rather than charge what the caller returns.
			return nil, status.Errorf(codes.InvalidArgument, "%s.is_negative_hits: returning hits is not supported (envoyproxy/ratelimit ignores the flag and charges them); send it without is_negative_hits (docs/envoy.md)", field)
		}
		entries := make([]*quotadv1.Entry, len(d.Entries))
		for j, e := range d.Entries {
			all[0].Key, all[0].Value = e.GetKey(), e.GetValue()
			entries[j], all = &all[0], all[1:]
		}
		if msg := entriesProblem(rlsEntryFields[i], entries); msg != "" {
			return nil, status.Errorf(codes.InvalidArgument, "%s", msg)
		}
		od := &ods[i]
		od.Entries = entries
		if h := d.GetHitsAddend(); h != nil {
			if h.Value > MaxCost {
				return nil, status.Errorf(codes.InvalidArgument, "%s.hits_addend %d is above the maximum %d", field, h.Value, uint64(MaxCost))
			}
			od.HasHits, od.Hits = true, h.Value
		}
		if l := d.GetLimit(); l != nil {
			// envoy.type.v3.RateLimitUnit numbers its units as the response does, without WEEK.
			unit := time.Duration(0)
			if _, defined := typev3.RateLimitUnit_name[int32(l.Unit)]; defined {
				unit = rlsUnitDuration(rlsv3.RateLimitResponse_RateLimit_Unit(l.Unit))
			}
			if unit == 0 {
				return nil, status.Errorf(codes.InvalidArgument, "%s.limit.unit %v: use SECOND, MINUTE, HOUR, DAY, MONTH or YEAR", field, l.Unit)
			}
			od.HasLimit, od.LimitRequestsPerUnit, od.LimitUnitSeconds = true, l.RequestsPerUnit, uint64(unit/time.Second)
		}
		op.Descriptors[i] = od
	}
	return op, nil
}

// rlsFields are the field names of the first descriptors, made once (rlsOp names every
// descriptor it validates).
var rlsFields = func() (f [quota.MaxRLSDescriptors]string) {
	for i := range f {
		f[i] = "descriptors[" + strconv.Itoa(i) + "]"
	}
	return f
}()

// rlsEntryFields are rlsFields + ".entries".
var rlsEntryFields = func() (f [quota.MaxRLSDescriptors]string) {
	for i := range f {
		f[i] = rlsFields[i] + ".entries"
	}
	return f
}()

// response builds Envoy's answer from the engine's.
func (r *rlsServer) response(d *quota.RLSDecision) *rlsv3.RateLimitResponse {
	resp := &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_Code(d.Code),
		Statuses: make([]*rlsv3.RateLimitResponse_DescriptorStatus, len(d.Statuses))}
	// One allocation per kind for all statuses, not one per status.
	pss := make([]rlsv3.RateLimitResponse_DescriptorStatus, len(d.Statuses))
	var lims []rlsv3.RateLimitResponse_RateLimit
	var durs []durationpb.Duration
	deny := d.UnknownDomain && r.opts.DenyUnknownDomain
	if deny {
		resp.OverallCode = rlsv3.RateLimitResponse_OVER_LIMIT
	}
	// The descriptor the headers describe: as envoyproxy/ratelimit picks it, the (last) one
	// over its limit, else the limited one with the fewest remaining.
	pick, pickRem := -1, uint64(math.MaxUint64)
	for i := range d.Statuses {
		st := &d.Statuses[i]
		ps := &pss[i]
		ps.Code = rlsv3.RateLimitResponse_Code(st.Code)
		switch {
		case deny:
			ps.Code = rlsv3.RateLimitResponse_OVER_LIMIT
		case st.Unlimited:
			ps.LimitRemaining = math.MaxUint32
		case st.Limited:
			if lims == nil {
				lims = make([]rlsv3.RateLimitResponse_RateLimit, len(d.Statuses))
				durs = make([]durationpb.Duration, len(d.Statuses))
			}
			lim, dur := &lims[i], &durs[i]
			lim.Name, lim.RequestsPerUnit, lim.Unit = st.Name, uint32(min(st.Limit, math.MaxUint32)), unitOf(st.Window)
			reset := ceilSecond(st.ResetAfter)
			dur.Seconds, dur.Nanos = int64(reset/time.Second), int32(reset%time.Second)
			ps.CurrentLimit, ps.DurationUntilReset = lim, dur
			ps.LimitRemaining = uint32(min(st.Remaining, math.MaxUint32))
			if st.Code == quota.RLSOverLimit {
				pick, pickRem = i, 0
			} else if pickRem > 0 && st.Remaining < pickRem {
				pick, pickRem = i, st.Remaining
			}
		}
		resp.Statuses[i] = ps
	}
	if r.opts.Headers != RLSHeadersOff && pick >= 0 {
		prefix := "RateLimit"
		if r.opts.Headers == RLSHeadersXRateLimit {
			prefix = "X-RateLimit"
		}
		st, ps := &d.Statuses[pick], resp.Statuses[pick]
		resp.ResponseHeadersToAdd = []*corev3.HeaderValue{
			{Key: prefix + "-Limit", Value: strconv.FormatUint(uint64(ps.CurrentLimit.RequestsPerUnit), 10)},
			{Key: prefix + "-Remaining", Value: strconv.FormatUint(uint64(ps.LimitRemaining), 10)},
			{Key: prefix + "-Reset", Value: strconv.FormatInt(ps.DurationUntilReset.GetSeconds(), 10)},
			{Key: prefix + "-Scope", Value: st.Scope},
		}
	}
	return resp
}

// unitOf is Envoy's unit for a window; a window that is not one of them (quotad's
// unit_multiplier) is UNKNOWN.
func unitOf(w time.Duration) rlsv3.RateLimitResponse_RateLimit_Unit {
	switch w {
	case time.Second:
		return rlsv3.RateLimitResponse_RateLimit_SECOND
	case time.Minute:
		return rlsv3.RateLimitResponse_RateLimit_MINUTE
	case time.Hour:
		return rlsv3.RateLimitResponse_RateLimit_HOUR
	case 24 * time.Hour:
		return rlsv3.RateLimitResponse_RateLimit_DAY
	case 7 * 24 * time.Hour:
		return rlsv3.RateLimitResponse_RateLimit_WEEK
	case 30 * 24 * time.Hour:
		return rlsv3.RateLimitResponse_RateLimit_MONTH
	case 365 * 24 * time.Hour:
		return rlsv3.RateLimitResponse_RateLimit_YEAR
	}
	return rlsv3.RateLimitResponse_RateLimit_UNKNOWN
}

// rlsUnitDuration is unitOf's inverse (0 for UNKNOWN or a value Envoy does not define).
func rlsUnitDuration(u rlsv3.RateLimitResponse_RateLimit_Unit) time.Duration {
	for _, d := range []time.Duration{time.Second, time.Minute, time.Hour, 24 * time.Hour, 7 * 24 * time.Hour, 30 * 24 * time.Hour, 365 * 24 * time.Hour} {
		if unitOf(d) == u {
			return d
		}
	}
	return 0
}

// ceilSecond rounds up to whole seconds, as envoyproxy/ratelimit reports resets (a client
// that waits that long is never early).
func ceilSecond(d time.Duration) time.Duration {
	return (d + time.Second - 1) / time.Second * time.Second
}
