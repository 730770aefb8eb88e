// Package quota is the pure core of quotad: token buckets, the limits hierarchy, concurrency
// leases and pauses, decided deterministically.
//
// Everything here is a function of its inputs. The package never reads a clock (time is always
// the argument now, nanoseconds on the replicated FSM clock), starts no goroutine, does no IO,
// and never lets map iteration order reach an output. It imports nothing of quotad's. The fsm
// package drives an Engine from the Raft log; every replica that applies the same commands ends
// in the same state with the same Hash.
package quota

import "time"

// Time is a point on the replicated FSM clock, in nanoseconds. It only ever moves forward.
type Time int64

// Add returns t+d.
func (t Time) Add(d time.Duration) Time { return t + Time(d) }

// Sub returns the duration t-u.
func (t Time) Sub(u Time) time.Duration { return time.Duration(t - u) }

// Reason says why a decision came out as it did. Its string values are part of the public API.
type Reason string

const (
	ReasonOK                   Reason = "ok"
	ReasonRateLimited          Reason = "rate_limited"
	ReasonConcurrencyLimited   Reason = "concurrency_limited"
	ReasonPaused               Reason = "paused"
	ReasonUnknownDomain        Reason = "unknown_domain"
	ReasonInvalid              Reason = "invalid"
	ReasonRetryBudgetExhausted Reason = "retry_budget_exhausted"
	// ReasonTooManyKeys: the admission would store a new bucket in a domain that already holds
	// max_keys of them (Domain.MaxKeys). A caller inventing descriptor values (tenants) cannot
	// grow the state without bound.
	ReasonTooManyKeys Reason = "too_many_keys"
	// ReasonRequestIDConflict is decided by the fsm, never by the Engine: a request ID was
	// reused for a different request. The first request's decision is not returned.
	ReasonRequestIDConflict Reason = "request_id_conflict"
	// ReasonTooManyWaiters is decided by the leader's fair scheduler, never by the Engine: the
	// caller (or the domain) already has as many admissions waiting as it may.
	ReasonTooManyWaiters Reason = "too_many_waiters"
)

// Caps on what one request may carry. The rpc layer refuses larger requests before they reach
// the log; the Engine checks them again (an invalid decision), so what a replica decides never
// depends on which layer caught it.
const (
	// MaxFieldBytes caps every string a caller chooses: domain, descriptor keys and values,
	// work class, feedback reason.
	MaxFieldBytes = 256
	// MaxDescriptors caps the descriptor entries of one request.
	MaxDescriptors = 16
)

// DefaultMaxKeys is the max_keys of a domain that does not set one.
const DefaultMaxKeys = 100_000

// ScopeDomain is the Scope of a decision made by a domain's own (ceiling) limit.
const ScopeDomain = "domain"

// ScopeOverride is the scope of a decision by an Envoy descriptor's own limit (RLSLimit).
const ScopeOverride = "override"

// Limits is the whole replicated limits configuration. It is plain data: the config package
// builds it from YAML, the fsm package replicates it, an Engine enforces it. Treat a *Limits
// handed to an Engine as immutable.
type Limits struct {
	// Version increases by one with every applied change; the engine sets it.
	Version uint64 `json:"version"`
	// Domains sorted by Name, names unique.
	Domains []Domain `json:"domains"`
}

// Domain is one quota domain (envoyproxy/ratelimit's "domain"): typically one provider
// application or one platform.
type Domain struct {
	Name string `json:"name"`
	// Rate is the domain's global ceiling, charged by every request in the domain. Nil: none.
	Rate *Rate `json:"rate,omitempty"`
	// Concurrency caps in-flight requests across the domain. Nil: none.
	Concurrency *Concurrency `json:"concurrency,omitempty"`
	// Descriptors are the first level of the descriptor tree.
	Descriptors []Node `json:"descriptors,omitempty"`
	// WorkClasses name the domain's work classes (e.g. interactive, incremental, repair,
	// backfill) in priority order, each with a reserved share of contended capacity that others
	// borrow while it is idle (fair scheduler). Empty: one implicit class.
	WorkClasses []WorkClass `json:"work_classes,omitempty"`
	// RetryBudget caps retries (Request.Attempt > 1) relative to first attempts. Nil: no cap.
	RetryBudget *RetryBudget `json:"retry_budget,omitempty"`
	// Adaptive makes the domain ceiling's rate adapt to provider feedback (AIMD) between a
	// floor and the configured rate, which is the human-set maximum. Nil: fixed.
	Adaptive *Adaptive `json:"adaptive,omitempty"`
	// ResumeJitter spreads the end of a pause: a request refused as paused is told to retry
	// after the pause ends plus a per-request share of this window (derived from
	// Request.Spread), so workers that did not wait do not all return at once. 0 means
	// DefaultResumeJitter.
	ResumeJitter time.Duration `json:"resume_jitter,omitempty"`
	// MaxPause caps how long one provider feedback may pause a scope of the domain: a longer
	// Retry-After is clamped to it (by the leader, before the feedback enters the log). 0
	// means DefaultMaxPause.
	MaxPause time.Duration `json:"max_pause,omitempty"`
	// MaxKeys caps the buckets the domain stores at once (buckets that are not full; a full
	// bucket is not stored, it equals an absent one). An admission that would store one more
	// is refused with ReasonTooManyKeys. 0 means DefaultMaxKeys.
	MaxKeys uint64 `json:"max_keys,omitempty"`
	// StrictKeys refuses (ReasonInvalid, naming the key) a request with a descriptor key the
	// domain does not define at that point of its tree, instead of ignoring it and everything
	// after it: a typo (endpont=charges) would otherwise skip that level's limit silently.
	StrictKeys bool `json:"strict_keys,omitempty"`
	// Shares makes the domain ceiling lendable to share holders (see Shares). Nil: it does not
	// lend, and no path through it is decided locally.
	Shares *Shares `json:"shares,omitempty"`
}

// DefaultResumeJitter is the resume jitter window of a domain that does not set one.
const DefaultResumeJitter = time.Second

// DefaultMaxPause is the pause cap of a domain that does not set max_pause; MaxMaxPause is the
// largest max_pause a domain may set.
const (
	DefaultMaxPause = 5 * time.Minute
	MaxMaxPause     = 24 * time.Hour
)

// HasDomain reports whether l defines domain (a nil l defines none).
func (l *Limits) HasDomain(domain string) bool {
	if l == nil {
		return false
	}
	for i := range l.Domains {
		if l.Domains[i].Name == domain {
			return true
		}
	}
	return false
}

// MaxPauseOf returns the pause cap of domain (DefaultMaxPause if it sets none or is unknown).
func (l *Limits) MaxPauseOf(domain string) time.Duration {
	if l != nil {
		for i := range l.Domains {
			if d := &l.Domains[i]; d.Name == domain && d.MaxPause > 0 {
				return d.MaxPause
			}
		}
	}
	return DefaultMaxPause
}

// WorkClass is one class of work with a reserved share of contended capacity.
type WorkClass struct {
	Name string `json:"name"`
	// ReservePercent of contended capacity is kept for this class while it has waiting work;
	// idle reserve is borrowed by other classes (work-conserving). Sum over classes ≤ 100.
	ReservePercent uint32 `json:"reserve_percent,omitempty"`
}

// RetryBudget lets retries spend at most RatioPercent of first attempts' admissions, plus a
// floor of MinPerSecond so a quiet domain can still retry.
//
// It is a per-domain bucket of retry tokens: every admitted first attempt (Attempt <= 1) adds
// RatioPercent/100 of a token, time adds MinPerSecond tokens a second, and every admitted retry
// (Attempt > 1) takes one token, whatever its cost. The bucket holds at most
// Capacity() tokens and starts full. Over any interval T the retries admitted are
// therefore at most capacity + RatioPercent/100·first_attempts(T) + MinPerSecond·T.
type RetryBudget struct {
	RatioPercent uint32 `json:"ratio_percent"`
	MinPerSecond uint64 `json:"min_per_second,omitempty"`
}

// Capacity is the most retry tokens the budget holds: ten seconds of its floor, and at least
// 10, so a burst of retries after a hiccup is not cut to one.
func (b *RetryBudget) Capacity() uint64 { return max(10, 10*b.MinPerSecond) }

// Adaptive is additive-increase/multiplicative-decrease control of a rate limit. The configured
// Rate.RequestsPerUnit is the ceiling; the effective rate never leaves [Floor, ceiling].
type Adaptive struct {
	// Floor is the lowest effective requests_per_unit.
	Floor uint64 `json:"floor"`
	// DecreasePercent is the multiplicative factor applied on confirmed rate limiting, in
	// percent of the current rate (e.g. 70 keeps 70 %).
	DecreasePercent uint32 `json:"decrease_percent"`
	// Increase is added to the effective requests_per_unit after every StableWindow without a
	// confirmed rate limit.
	Increase     uint64        `json:"increase"`
	StableWindow time.Duration `json:"stable_window"`
}

// Node is one level of the descriptor tree. A request's descriptor entry (key, value) matches the
// child with the same key and value, else the first child (in order) with the same key and a
// wildcard Value ("prefix*") that the value starts with, else the child with the same key and an
// empty Value (see Matcher). A Node with an empty or wildcard Value gives every distinct value
// its own buckets (per-tenant buckets), unless ShareThreshold.
type Node struct {
	Key   string `json:"key"`
	Value string `json:"value,omitempty"`
	// Rate limits this level. Nil: the level only groups its children. A Rate with
	// RequestsPerUnit 0 blocks: every request with a cost is refused at this level.
	Rate *Rate `json:"rate,omitempty"`
	// Unlimited: this level never denies (and is not stored); its children still apply.
	Unlimited bool `json:"unlimited,omitempty"`
	// ShadowMode: denials at this level are computed and reported but the request is admitted
	// as far as this level is concerned (nothing is debited here when it would deny).
	ShadowMode bool `json:"shadow_mode,omitempty"`
	// Concurrency caps in-flight requests at this level (per distinct value). Nil: none.
	Concurrency *Concurrency `json:"concurrency,omitempty"`
	// Weight is the level's share weight for the fair scheduler (0 means 1).
	Weight uint32 `json:"weight,omitempty"`
	// Adaptive makes this level's rate adapt to provider feedback (AIMD). Nil: fixed.
	Adaptive *Adaptive `json:"adaptive,omitempty"`
	// Replaces names other limits this one replaces (Envoy RLS semantics only; the native
	// API charges the whole path and ignores it).
	Replaces []string `json:"replaces,omitempty"`
	// Name identifies the limit for Replaces.
	Name string `json:"name,omitempty"`
	// ShareThreshold (wildcard Values only): every value the wildcard matches shares one
	// bucket, named by the pattern, instead of one bucket per value.
	ShareThreshold bool `json:"share_threshold,omitempty"`
	// QuotaMode (Envoy RLS only): a descriptor over this limit is answered OK, and the
	// violation is reported (statistics, dynamic metadata), as envoyproxy/ratelimit does.
	QuotaMode bool `json:"quota_mode,omitempty"`
	// DetailedMetric and ValueToMetric choose the statistics key of this limit (the request's
	// values instead of the configured ones); they change no decision.
	DetailedMetric bool `json:"detailed_metric,omitempty"`
	ValueToMetric  bool `json:"value_to_metric,omitempty"`
	// Shares makes this level lendable to share holders (see Shares). Nil: it does not lend.
	Shares *Shares `json:"shares,omitempty"`
	// MaxKeysPerParent caps the buckets this level stores under one path of its parent (e.g.
	// the consumers of one tenant): a new bucket beyond it is refused with ReasonTooManyKeys,
	// so callers who can invent values below their parent (a tenant-scoped worker, its
	// consumers) fill only their own part of the domain's MaxKeys. 0: no cap but MaxKeys.
	// Only on a level that stores one bucket per distinct value: no Value (or a wildcard
	// without ShareThreshold) and a Rate. Needs fsm command version 6 on every node.
	MaxKeysPerParent uint64 `json:"max_keys_per_parent,omitempty"`
	Children         []Node `json:"descriptors,omitempty"`
}

// Rate is a token bucket: Burst units of capacity, refilled at RequestsPerUnit per Unit.
type Rate struct {
	Unit            time.Duration `json:"unit"`
	RequestsPerUnit uint64        `json:"requests_per_unit"`
	// Burst is the bucket's capacity; 0 means RequestsPerUnit (one unit's worth).
	Burst uint64 `json:"burst,omitempty"`
	// Scope is ScopeGlobal (the limit holds across regional clusters) or ScopeRegional; ""
	// means ScopeRegional. A cluster that is not regional enforces both alike.
	Scope string `json:"scope,omitempty"`
}

// Capacity returns the bucket capacity in units.
func (r *Rate) Capacity() uint64 {
	if r.Burst == 0 {
		return r.RequestsPerUnit
	}
	return r.Burst
}

// Concurrency is a semaphore of MaxInFlight permits held by leases that expire after LeaseTTL
// unless renewed.
type Concurrency struct {
	MaxInFlight uint64        `json:"max_in_flight"`
	LeaseTTL    time.Duration `json:"lease_ttl"`
}

// Entry is one (key, value) of a request's descriptor path.
type Entry struct {
	Key   string
	Value string
}

// Request asks for Cost units from every bucket on the descriptor path of Domain, and a
// concurrency permit from every level on the path that caps concurrency.
type Request struct {
	Domain      string
	Descriptors []Entry
	// Cost in units; 0 is treated as 1.
	Cost uint64
	// LeaseTTL for concurrency permits; 0 uses each level's configured TTL (the smallest). A
	// longer TTL than that is clamped to it: a caller cannot hold a permit longer than the
	// limits allow without renewing (Decision.LeaseTTL says what was granted).
	LeaseTTL time.Duration
	// Attempt is 1 for a first try, >1 for a retry of the caller's work.
	Attempt uint32
	// WorkClass names the request's work class for the fair scheduler ("" = default).
	WorkClass string
	// Spread is an arbitrary per-request value (the fsm uses a hash of the client and request
	// IDs) that places the request within its domain's resume jitter window when it is refused
	// as paused. Requests with different Spread values come back at different times.
	Spread uint64
	// Owner is the authenticated caller (its identity name). A lease the request takes
	// belongs to it: ReleaseBy and RenewBy by another owner are refused. "" owns nothing.
	Owner string
	// ScheduleWithin > 0 allows a scheduled grant: a request that every other check admits
	// but whose rate-limited buckets cannot pay at now, and can within ScheduleWithin, is
	// admitted as of the earliest moment they can (now+Decision.RetryAfter): the buckets are
	// debited as of then (refill credited up to that moment, never beyond), its lease starts
	// then, and the caller must not learn of the admission before it. This is how the
	// leader's fair scheduler puts a batch of grants at the bucket's pace into one log entry.
	ScheduleWithin time.Duration
	// ConcurrencyRetryAfter makes a concurrency_limited denial carry RetryAfter = the time
	// until the earliest expiry of a lease holding a permit of the refusing level (without it,
	// RetryAfter is 0, as decisions of older log entries were made).
	ConcurrencyRetryAfter bool
	// ShadowMaxKeys applies shadow_mode to the domain's max_keys as to every other limit
	// (command version 7): a new bucket of a shadow_mode level that the domain has no room
	// for is not stored and its scope is listed in ShadowDenials, and the request is
	// admitted if the other levels admit it, as Envoy RLS answers it (OK, shadow). Without
	// it, max_keys refuses whatever the modes of the levels, as decisions of older log
	// entries were made.
	ShadowMaxKeys bool
}

// Decision is the outcome of one Request.
type Decision struct {
	Admitted bool
	Reason   Reason
	// Scope is the level that refused ("domain" or a descriptor key), or when admitted the level
	// whose bucket is tightest. Empty when no limit applied.
	Scope string
	// Limit is that level's RequestsPerUnit (or MaxInFlight for concurrency_limited).
	Limit uint64
	// Remaining whole units in that bucket after this decision.
	Remaining uint64
	// Window is that level's Unit.
	Window time.Duration
	// ResetAfter is the time until that bucket is full again.
	ResetAfter time.Duration
	// RetryAfter is, for a denial, the earliest wait after which the same request can succeed.
	// For an admission it is 0, or for a scheduled grant (Request.ScheduleWithin) the delay
	// after now at which the admission takes effect.
	RetryAfter time.Duration
	// LeaseID is non-zero when concurrency permits were taken; LeaseTTL is their TTL.
	LeaseID  uint64
	LeaseTTL time.Duration
	// Message explains invalid and unknown_domain decisions.
	Message string
	// Charges lists the keys of the buckets that were debited Cost units, for Refund. The
	// strings never change. They share the engine's memory for keys (no copy per admission),
	// so one kept long after its command was applied can keep the engine's memory for a few
	// thousand released keys alive: copy them to keep them.
	Charges []string
	// Cost actually debited from each charged bucket.
	Cost uint64
	// DebitSeq identifies this admission's debits for Refund (0 when nothing was debited).
	DebitSeq uint64
	// ShadowDenials lists the scopes of shadow-mode levels that would have refused this request
	// (they were skipped: no debit, no permit). Nil when none.
	ShadowDenials []string
}

// Feedback is a provider's throttling answer (HTTP 429 or 503) reported for the scope the
// provider limited: a domain (provider application) or a descriptor prefix in it (an endpoint,
// a tenant's credential).
type Feedback struct {
	Domain string
	// Prefix names the scope the provider limited; empty is the whole domain.
	Prefix []Entry
	// StatusCode is the provider's HTTP status: 429 or 503.
	StatusCode uint32
	// RetryAfter is the provider's Retry-After; 0 if it sent none.
	RetryAfter time.Duration
	// Reason is the provider's limiter-reason header; empty if it sent none.
	Reason string
}

// RefundResult says what Engine.Refund did at the buckets an admission charged: Restored +
// Kept is the number of charged buckets (0 and 0 when there was nothing to give back: no
// charges, cost 0 or no debit).
type RefundResult struct {
	// Restored counts the buckets that are back where they would be without the admission:
	// it was still their last debit and they took back what their capacity holds (nothing
	// if they had refilled), or they were gone (dropped full).
	Restored int
	// Kept counts the buckets that keep the units: another admission debited them since
	// (or the admission was already refunded).
	Kept int
}

// FeedbackResult says what a Feedback did.
type FeedbackResult struct {
	// Scope is the named level: "domain" or the prefix's last key.
	Scope string
	// Attributed: the feedback was taken as evidence about Scope (it carried a reason, or named
	// a scope narrower than the whole domain). Unattributed feedback changes nothing.
	Attributed bool
	// PausedFor is how long Scope is now paused (0: not paused).
	PausedFor time.Duration
	// Decreased: the adaptive rate at Scope was multiplied down by this feedback.
	Decreased bool
	// Limit is the effective requests_per_unit at Scope afterwards when Scope is adaptive, else 0.
	Limit uint64
}

// AdaptiveStatus is the effective rate of one adaptive bucket that is below its ceiling.
type AdaptiveStatus struct {
	Domain string
	Key    string // bucket key
	Scope  string
	// Limit is the effective requests_per_unit (rounded down), Ceiling the configured one.
	Limit   uint64
	Ceiling uint64
	Window  time.Duration
}

// BucketStatus is a read-only view of one level on a descriptor path.
type BucketStatus struct {
	Scope       string
	Key         string
	Limit       uint64
	Burst       uint64
	Remaining   uint64
	Window      time.Duration
	ResetAfter  time.Duration
	InFlight    uint64
	MaxInFlight uint64
	PausedFor   time.Duration
	// Ceiling is the configured requests_per_unit of an adaptive level (Limit is then the
	// effective one); 0 for a fixed level.
	Ceiling uint64
	// RetryTokens is, on the domain level of a domain with a retry budget, the whole retry
	// tokens left.
	RetryTokens uint64
	// LentLimit and LentBurst are the part of the rate (per Window) and capacity lent to
	// share holders; Limit, Burst and Remaining are then the central part only.
	LentLimit, LentBurst uint64
}
