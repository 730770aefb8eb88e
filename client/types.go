package client

import (
	"fmt"
	"math"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// Entry is one level of a descriptor path, e.g. {Key: "tenant", Value: "acme"}.
type Entry struct {
	// Key names the level, e.g. "tenant".
	Key string
	// Value selects the bucket at that level, e.g. "acme".
	Value string
}

// Descriptors builds a descriptor path from alternating keys and values:
// Descriptors("endpoint", "orders", "tenant", "acme"). It panics on an odd number of
// arguments, which is a programming error.
func Descriptors(keyValues ...string) []Entry {
	if len(keyValues)%2 != 0 {
		panic(fmt.Sprintf("client.Descriptors: odd number of arguments (%d)", len(keyValues)))
	}
	out := make([]Entry, 0, len(keyValues)/2)
	for i := 0; i < len(keyValues); i += 2 {
		out = append(out, Entry{Key: keyValues[i], Value: keyValues[i+1]})
	}
	return out
}

// Request asks for Cost units from every bucket on the descriptor path of Domain and a
// concurrency permit from every level on the path that caps concurrency, all or nothing.
// The zero value is invalid (Domain is required).
type Request struct {
	// Domain is the quota domain, e.g. "provider-x" or "platform". Required.
	Domain string
	// Descriptors is the path from the outermost level, e.g. endpoint, tenant, consumer.
	Descriptors []Entry
	// Cost in the buckets' units; 0 means 1.
	Cost uint64
	// LeaseTTL for concurrency permits; 0 uses the limit's configured TTL.
	LeaseTTL time.Duration
	// Attempt is 1 (or 0) for a first try of the caller's work and n > 1 for its n-th retry
	// (after a provider error, say). Retries draw on the domain's retry budget. It is not
	// about transport retries, which the client does itself with the same request ID.
	Attempt uint32
	// WorkClass names the request's work class, e.g. "interactive" or "backfill".
	WorkClass string
	// MaxWait > 0 lets the leader queue the admission up to this long (fair scheduler).
	// Such admissions are sent in their own RPC, never batched with non-waiting ones.
	MaxWait time.Duration
}

// validate checks what the client can check without the limits, so that one caller's
// malformed admission cannot get a whole batch rejected.
func (r *Request) validate() error {
	if r.Domain == "" {
		return fmt.Errorf("%w: Request.Domain is empty", ErrInvalid)
	}
	for i, e := range r.Descriptors {
		if e.Key == "" {
			return fmt.Errorf("%w: Request.Descriptors[%d] has an empty key (value %q)", ErrInvalid, i, e.Value)
		}
	}
	if r.LeaseTTL < 0 {
		return fmt.Errorf("%w: Request.LeaseTTL %v is negative", ErrInvalid, r.LeaseTTL)
	}
	if r.MaxWait < 0 {
		return fmt.Errorf("%w: Request.MaxWait %v is negative", ErrInvalid, r.MaxWait)
	}
	return nil
}

func (r *Request) admission(id uint64) *quotadv1.Admission {
	a := &quotadv1.Admission{
		RequestId:  id,
		Domain:     r.Domain,
		Cost:       r.Cost,
		LeaseTtlMs: durationMillisCeil(r.LeaseTTL),
		Attempt:    r.Attempt,
		WorkClass:  r.WorkClass,
		MaxWaitMs:  r.MaxWait.Milliseconds(),
	}
	if a.Attempt == 0 {
		a.Attempt = 1
	}
	if len(r.Descriptors) > 0 {
		a.Descriptors = make([]*quotadv1.Entry, len(r.Descriptors))
		for i, e := range r.Descriptors {
			a.Descriptors[i] = &quotadv1.Entry{Key: e.Key, Value: e.Value}
		}
	}
	return a
}

// Reason says why a decision came out as it did. The values are the cluster's API strings.
type Reason string

// The reasons a cluster gives. A client may see reasons it does not know; treat them as
// denials.
const (
	ReasonOK                   Reason = "ok"
	ReasonRateLimited          Reason = "rate_limited"
	ReasonConcurrencyLimited   Reason = "concurrency_limited"
	ReasonPaused               Reason = "paused"
	ReasonUnknownDomain        Reason = "unknown_domain"
	ReasonInvalid              Reason = "invalid"
	ReasonRetryBudgetExhausted Reason = "retry_budget_exhausted"
	// ReasonTooManyKeys: the domain already holds its max_keys buckets and this request would
	// add one (a new tenant value, say), or the level named by Scope holds its
	// max_keys_per_parent buckets under this request's parent (a tenant's consumers, say).
	// RetryAfter says when idle ones will have made room.
	ReasonTooManyKeys Reason = "too_many_keys"
	// ReasonTooManyWaiters: this client_id, this credential in the domain, or the domain (Scope
	// client, identity or domain) already has as many admissions waiting on the leader as it
	// may, and this one would have had to wait; retry after RetryAfter or send without MaxWait.
	ReasonTooManyWaiters Reason = "too_many_waiters"
	// ReasonRequestIDConflict: the request ID was already used for a different request. Allow
	// returns it as an error matching ErrInvalid (the client library never reuses an ID).
	ReasonRequestIDConflict Reason = "request_id_conflict"
)

// Decision is the cluster's answer to one admission. Durations are relative to At, the
// client's local time when the answer arrived; RetryAt and ResetAt turn them into
// absolute times for durable rescheduling.
type Decision struct {
	// Admitted is true when every bucket on the path was debited (and permits taken).
	Admitted bool
	// Reason is ReasonOK when admitted, otherwise why not.
	Reason Reason
	// Scope is the level that refused ("domain" or a descriptor key such as "tenant"), or
	// when admitted the level whose bucket is tightest. Empty when no limit applied.
	Scope string
	// Limit is that level's requests per window (or max in flight for concurrency_limited).
	Limit uint64
	// Remaining whole units in that bucket after this decision.
	Remaining uint64
	// Window is that level's unit of time (RateLimit-Policy w=).
	Window time.Duration
	// ResetAfter is the time until that bucket is full again.
	ResetAfter time.Duration
	// RetryAfter is, for a denial, the earliest wait after which the same request can
	// succeed.
	RetryAfter time.Duration
	// LeaseID is non-zero when concurrency permits were taken.
	LeaseID uint64
	// LeaseTTL is the permits' TTL when LeaseID is set.
	LeaseTTL time.Duration
	// Message explains invalid and unknown_domain decisions.
	Message string
	// RequestID is the ID the admission was decided under (needed by Refund).
	RequestID uint64
	// At is the local time the decision arrived.
	At time.Time

	// sent is the local time the admission's first attempt left: the cluster started counting
	// a lease's TTL after it, never before (leases are anchored here, not at At).
	sent time.Time
}

// RetryAt is the earliest local time at which a retry of a denied request can succeed.
func (d Decision) RetryAt() time.Time { return d.At.Add(d.RetryAfter) }

// ResetAt is the local time at which the deciding bucket is full again.
func (d Decision) ResetAt() time.Time { return d.At.Add(d.ResetAfter) }

func decisionFromProto(p *quotadv1.Decision, requestID uint64, at time.Time) Decision {
	return Decision{
		Admitted:   p.GetAdmitted(),
		Reason:     Reason(p.GetReason()),
		Scope:      p.GetScope(),
		Limit:      p.GetLimit(),
		Remaining:  p.GetRemaining(),
		Window:     millis(p.GetWindowMs()),
		ResetAfter: millis(p.GetResetAfterMs()),
		RetryAfter: millis(p.GetRetryAfterMs()),
		LeaseID:    p.GetLeaseId(),
		LeaseTTL:   millis(p.GetLeaseTtlMs()),
		Message:    p.GetMessage(),
		RequestID:  requestID,
		At:         at,
	}
}

// BucketStatus is one bucket on a descriptor path as Status reads it.
type BucketStatus struct {
	// Scope is "domain" or the level's descriptor key.
	Scope string
	// Key is the bucket's full key, e.g. "platform/tenant=acme".
	Key string
	// Limit is the level's requests per Window (0: no rate limit).
	Limit uint64
	// Burst is the bucket's capacity.
	Burst uint64
	// Remaining whole units now.
	Remaining uint64
	// ResetAfter is the time until the bucket is full again.
	ResetAfter time.Duration
	// InFlight is the number of concurrency permits held at this level.
	InFlight uint64
	// MaxInFlight is the level's concurrency cap (0: none).
	MaxInFlight uint64
	// PausedFor is how long the level stays paused by provider feedback (0: not paused).
	PausedFor time.Duration
	// Window is the level's unit of time.
	Window time.Duration
	// LentLimit and LentBurst are the part of the level's rate (per Window) and capacity
	// lent to share holders (Limiters); Limit, Burst and Remaining are then the central part
	// only, and the configured limit is Limit + LentLimit.
	LentLimit, LentBurst uint64
	// Ceiling is an adaptive level's configured requests_per_unit (Limit is the effective
	// one); 0 for a fixed level.
	Ceiling uint64
}

// Status is the answer of Client.Status: the buckets on a path, read linearizably.
type Status struct {
	// Buckets from the domain ceiling down the matched path.
	Buckets []BucketStatus
	// AppliedIndex is the Raft index the read reflects.
	AppliedIndex uint64
	// LeaderID is the ID of the leader that served the read.
	LeaderID string
}

// Feedback reports a provider's throttling answer so that the cluster pauses the quota
// domain (or the level of it) that the provider named.
type Feedback struct {
	// Domain is the quota domain the throttled request was admitted in. Required.
	Domain string
	// Descriptors names the level the provider limited; empty means the whole domain.
	Descriptors []Entry
	// StatusCode is the provider's HTTP status (429, 503).
	StatusCode int
	// RetryAfter is the provider's Retry-After, 0 if it sent none.
	RetryAfter time.Duration
	// Reason is the provider's limiter-reason header value, empty if it sent none.
	Reason string
}

// FeedbackResult is the cluster's answer to Feedback.
type FeedbackResult struct {
	// PausedFor is how long the named scope is now paused (0: the feedback paused nothing).
	PausedFor time.Duration
	// Scope is the paused level ("domain" or a descriptor key).
	Scope string
	// Attributed: the cluster counted the report against Scope. A 429 without a reason for a
	// whole domain is not assumed global: it is not attributed and pauses nothing.
	Attributed bool
	// Decreased: Scope's adaptive rate was lowered (confirmed rate limiting).
	Decreased bool
	// Limit is Scope's effective requests_per_unit when it is adaptive, else 0.
	Limit uint64
}

// RefundOutcome says what became of a Refund. The values are the cluster's API strings.
type RefundOutcome string

// The outcomes a cluster gives. A cluster from before session 11 gives none (""): its
// Refunded was the least any charged bucket took back.
const (
	// RefundRefunded: the admission was found and not refunded before. Every bucket it charged
	// that no later admission has debited took the units back, as many as its capacity holds
	// (none when it had refilled meanwhile, like a fast domain ceiling): as if the admission
	// had not been made there. RefundResult.BucketsKept counts the others.
	RefundRefunded RefundOutcome = "refunded"
	// RefundNotFound: the cluster has no admission under that request ID for this client and
	// credential: never made, or too old for it to remember.
	RefundNotFound RefundOutcome = "not_found"
	// RefundNotAdmitted: the request was denied, so nothing was taken. Refund answers it
	// without a call for a Decision that says so.
	RefundNotAdmitted RefundOutcome = "not_admitted"
	// RefundAlreadyRefunded: an earlier Refund of the admission did the work (perhaps an
	// earlier try of this one whose answer was lost: Refund retries a failover).
	RefundAlreadyRefunded RefundOutcome = "already_refunded"
	// RefundNothingToRefund: the admission was found but took no rate tokens (a
	// concurrency-only domain: it holds permits, which its Lease releases). Refunded is 0.
	// Clusters before s11-refund2 answered such an admission RefundRefunded with its cost
	// (and a second Refund RefundAlreadyRefunded), though no bucket took anything back.
	RefundNothingToRefund RefundOutcome = "nothing_to_refund"
)

// RefundResult is the cluster's answer to Refund.
type RefundResult struct {
	Outcome RefundOutcome
	// Refunded is the admission's cost when Outcome is RefundRefunded, else 0.
	Refunded uint64
	// BucketsKept counts, for RefundRefunded, the charged buckets that keep the units because
	// a later admission debited them since (giving them back could admit more than the
	// limit). A busy shared level (a domain ceiling many tenants use) usually keeps them.
	BucketsKept int
}

func entriesToProto(es []Entry) []*quotadv1.Entry {
	if len(es) == 0 {
		return nil
	}
	out := make([]*quotadv1.Entry, len(es))
	for i, e := range es {
		out[i] = &quotadv1.Entry{Key: e.Key, Value: e.Value}
	}
	return out
}

// durationMillisCeil rounds d up to whole milliseconds so a positive duration never becomes 0.
func durationMillisCeil(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	ms := int64(d / time.Millisecond)
	if d%time.Millisecond != 0 {
		ms++
	}
	return ms
}

// millis converts a duration in milliseconds from the cluster, saturating instead of
// overflowing (a cluster may say "never" with a huge value) and treating negatives as 0.
func millis(ms int64) time.Duration {
	switch {
	case ms <= 0:
		return 0
	case ms > math.MaxInt64/int64(time.Millisecond):
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(ms) * time.Millisecond
}
