package rpc

import (
	"fmt"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/quota"
)

// Caps bound what one caller can make a node hold. Each refusal names the value and the cap.
//
// Per request (checked here, before anything reaches the log, and again by the FSM and the
// engine for what a leader proposes): a gRPC message of at most MaxRequestBytes, strings of at
// most quota.MaxFieldBytes, at most MaxDescriptors entries and MaxAdmissionsPerCall admissions.
// Per caller on the leader: waiting admissions per client_id, per authenticated identity and
// domain, and per domain (WaiterCaps).
// In the replicated state: buckets per domain (the limits' max_keys, quota.ReasonTooManyKeys)
// and lease TTLs (clamped to the configured lease_ttl by the engine).

// DefaultMaxRequestBytes is the largest gRPC message a node accepts by default (etcd's
// --max-request-bytes is 1.5 MiB; an Acquire of 10000 small admissions is ~700 KB).
const DefaultMaxRequestBytes = 1 << 20

// Default waiter caps.
const (
	DefaultMaxWaitersPerClient = 1000
	DefaultMaxWaitersPerDomain = 10000
)

// WaiterCaps cap the admissions waiting on the leader (max_wait_ms > 0), each of which holds
// a goroutine and a queue entry until it is decided. An admission takes a slot only when it
// is about to queue: one its buckets can pay at once (nobody queued on its path) is decided
// without a slot, so a full domain never refuses a caller who would not have waited. 0 means
// the default. Not reloadable (flags read at start).
type WaiterCaps struct {
	// PerClient caps the waiting admissions of one client_id of one identity
	// (--max-waiters-per-client).
	PerClient int
	// PerIdentity caps the waiting admissions of one authenticated identity (a token or a
	// client certificate) in one domain, whatever client_ids it sends
	// (--max-waiters-per-identity). The default, DefaultPerIdentity, is a quarter of
	// PerDomain: one credential cannot fill a domain's slots by rotating client_id. An agent
	// run with --insecure has no identities (every caller is "insecure"), so there only
	// PerClient and PerDomain apply.
	PerIdentity int
	// PerDomain caps the waiting admissions in one domain (--max-waiters-per-domain).
	PerDomain int
	// PerStream caps the undecided admissions of one AcquireStream, waiting or still being
	// decided, or decided with their answer not yet queued for sending (a client that does
	// not read) (--max-stream-admissions, default DefaultMaxStreamAdmissions); one beyond is
	// denied too_many_waiters (scope "stream"). The caps above apply to a stream's admissions
	// as to unary ones.
	PerStream int
}

// DefaultPerIdentity is the default per-identity waiter cap for a per-domain cap: a quarter
// of it (at least 1), so filling a domain's waiting slots takes at least four credentials.
func DefaultPerIdentity(perDomain int) int { return max(1, (perDomain+3)/4) }

func (c WaiterCaps) withDefaults() WaiterCaps {
	if c.PerClient <= 0 {
		c.PerClient = DefaultMaxWaitersPerClient
	}
	if c.PerDomain <= 0 {
		c.PerDomain = DefaultMaxWaitersPerDomain
	}
	if c.PerIdentity <= 0 {
		c.PerIdentity = DefaultPerIdentity(c.PerDomain)
	}
	if c.PerStream <= 0 {
		c.PerStream = DefaultMaxStreamAdmissions
	}
	return c
}

// SetWaiterCaps sets the waiter caps (0 fields: the defaults). Call before serving.
func (s *Server) SetWaiterCaps(c WaiterCaps) {
	s.fair.slots.mu.Lock()
	s.fair.slots.caps = c.withDefaults()
	s.fair.slots.mu.Unlock()
}

// waiterSlots counts the admissions waiting on this leader by client (an identity's
// client_id), by identity in a domain, and by domain. Its maps hold only callers with waiters
// now, so they are bounded by the caps.
type waiterSlots struct {
	mu         sync.Mutex
	caps       WaiterCaps
	byClient   map[string]int
	byIdentity map[string]int
	byDomain   map[string]int
}

// waiterSlot names whose slot one waiting admission holds (see waiterSlots.take).
type waiterSlot struct {
	// identity is the authenticated caller ("" when the agent has no identities: --insecure).
	identity, clientID, domain string
}

func (k waiterSlot) clientKey() string   { return k.identity + "\x00" + k.clientID }
func (k waiterSlot) identityKey() string { return k.identity + "\x00" + k.domain }

// take reserves a waiting slot for one admission, or returns why not.
func (w *waiterSlots) take(k waiterSlot) (problem string, scope string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if problem, scope = w.fullLocked(k); problem != "" {
		return problem, scope
	}
	w.byClient[k.clientKey()]++
	if k.identity != "" {
		w.byIdentity[k.identityKey()]++
	}
	w.byDomain[k.domain]++
	return "", ""
}

// check says why take would refuse k now, or "" (and reserves nothing).
func (w *waiterSlots) check(k waiterSlot) (problem string, scope string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.fullLocked(k)
}

// fullLocked says which cap k's slot would exceed, or "". w.mu held.
func (w *waiterSlots) fullLocked(k waiterSlot) (problem string, scope string) {
	if w.byClient == nil {
		w.byClient, w.byIdentity, w.byDomain = make(map[string]int), make(map[string]int), make(map[string]int)
		w.caps = w.caps.withDefaults()
	}
	ck, ik := k.clientKey(), k.identityKey()
	if n := w.byClient[ck]; n >= w.caps.PerClient {
		return fmt.Sprintf("client_id %.64q already has %d admissions waiting on the leader, its limit (--max-waiters-per-client %d); "+
			"wait for some to be decided, or send without max_wait_ms", k.clientID, n, w.caps.PerClient), ScopeClientWaiters
	}
	if n := w.byIdentity[ik]; k.identity != "" && n >= w.caps.PerIdentity {
		return fmt.Sprintf("identity %.64q already has %d admissions waiting on the leader in domain %.64q, its limit (--max-waiters-per-identity %d), "+
			"whatever its client_ids; wait for some to be decided, or send without max_wait_ms", k.identity, n, k.domain, w.caps.PerIdentity), ScopeIdentityWaiters
	}
	if n := w.byDomain[k.domain]; n >= w.caps.PerDomain {
		return fmt.Sprintf("domain %.64q already has %d admissions waiting on the leader, its limit (--max-waiters-per-domain %d); "+
			"retry later, or send without max_wait_ms", k.domain, n, w.caps.PerDomain), ScopeDomainWaiters
	}
	return "", ""
}

// Scopes of a too_many_waiters denial: which cap refused it.
const (
	ScopeClientWaiters   = "client"
	ScopeIdentityWaiters = "identity"
	ScopeDomainWaiters   = "domain"
)

// put returns a slot taken by take.
func (w *waiterSlots) put(k waiterSlot) {
	w.mu.Lock()
	defer w.mu.Unlock()
	dec := func(m map[string]int, key string) {
		if m[key]--; m[key] <= 0 {
			delete(m, key)
		}
	}
	dec(w.byClient, k.clientKey())
	if k.identity != "" {
		dec(w.byIdentity, k.identityKey())
	}
	dec(w.byDomain, k.domain)
}

// waiterRetryAfterMs is the retry_after of a too_many_waiters denial: soon, since a waiter is
// decided within its max_wait.
const waiterRetryAfterMs = 100

// tooManyWaiters is the denial of a waiting admission beyond a waiter cap; it is counted in
// quotad_fair_denials_total{reason="too_many_waiters"}.
func (f *fair) tooManyWaiters(domain, msg, scope string) *quotadv1.Decision {
	label := "unknown"
	f.mu.Lock()
	for _, d := range f.limitsLocked().Domains {
		if d.Name == domain {
			label = domain // a configured name: bounded label values
		}
	}
	f.mu.Unlock()
	f.metrics.denied(label, string(quota.ReasonTooManyWaiters), scope)
	return &quotadv1.Decision{Reason: string(quota.ReasonTooManyWaiters), Scope: scope, RetryAfterMs: waiterRetryAfterMs, Message: msg}
}

// fieldProblem says why a caller's string field is too long, or "".
func fieldProblem(field string, v string) string {
	if len(v) > quota.MaxFieldBytes {
		return fmt.Sprintf("%s is %d bytes; the limit is %d bytes", field, len(v), quota.MaxFieldBytes)
	}
	return ""
}

// entriesProblem says why a descriptor list is unacceptable (too many entries, an empty or
// too long key, a too long value), or "". field names the list in messages.
func entriesProblem(field string, es []*quotadv1.Entry) string {
	if len(es) > MaxDescriptors {
		return fmt.Sprintf("%s has %d entries; at most %d are allowed", field, len(es), MaxDescriptors)
	}
	for i, e := range es {
		if e.GetKey() == "" {
			return fmt.Sprintf("%s[%d] has an empty key; every entry needs key=value", field, i)
		}
		// Field names are formatted only for a problem: this runs for every admission.
		if len(e.Key) > quota.MaxFieldBytes {
			return fieldProblem(fmt.Sprintf("%s[%d].key", field, i), e.Key)
		}
		if len(e.Value) > quota.MaxFieldBytes {
			return fieldProblem(fmt.Sprintf("%s[%d].value (key %.40q)", field, i, e.Key), e.Value)
		}
	}
	return ""
}

// firstProblem returns the first non-empty problem.
func firstProblem(problems ...string) string {
	for _, p := range problems {
		if p != "" {
			return p
		}
	}
	return ""
}

// invalidArg is an InvalidArgument status with msg, or nil for "".
func invalidArg(msg string) error {
	if msg == "" {
		return nil
	}
	return status.Error(codes.InvalidArgument, msg)
}
