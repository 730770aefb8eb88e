package rpc

import (
	"fmt"
	"strings"
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
// Per caller on the leader: waiting admissions per client_id and per domain (WaiterCaps).
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
// a goroutine and a queue entry until it is decided. 0 means the default.
type WaiterCaps struct {
	// PerClient caps the waiting admissions of one client_id (--max-waiters-per-client).
	PerClient int
	// PerDomain caps the waiting admissions in one domain (--max-waiters-per-domain).
	PerDomain int
}

func (c WaiterCaps) withDefaults() WaiterCaps {
	if c.PerClient <= 0 {
		c.PerClient = DefaultMaxWaitersPerClient
	}
	if c.PerDomain <= 0 {
		c.PerDomain = DefaultMaxWaitersPerDomain
	}
	return c
}

// SetWaiterCaps sets the waiter caps (0 fields: the defaults). Call before serving.
func (s *Server) SetWaiterCaps(c WaiterCaps) {
	s.fair.slots.mu.Lock()
	s.fair.slots.caps = c.withDefaults()
	s.fair.slots.mu.Unlock()
}

// waiterSlots counts the admissions waiting on this leader by client (a caller identity's
// client_id: clientKey) and domain. Its maps
// hold only callers with waiters now, so they are bounded by the caps.
type waiterSlots struct {
	mu       sync.Mutex
	caps     WaiterCaps
	byClient map[string]int
	byDomain map[string]int
}

// take reserves a waiting slot for one admission of client in domain, or returns why not.
func (w *waiterSlots) take(client, domain string) (problem string, scope string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.byClient == nil {
		w.byClient, w.byDomain = make(map[string]int), make(map[string]int)
		w.caps = w.caps.withDefaults()
	}
	if n := w.byClient[client]; n >= w.caps.PerClient {
		_, clientID, _ := strings.Cut(client, "\x00")
		return fmt.Sprintf("client_id %.64q already has %d admissions waiting on the leader, its limit (--max-waiters-per-client %d); "+
			"wait for some to be decided, or send without max_wait_ms", clientID, n, w.caps.PerClient), "client"
	}
	if n := w.byDomain[domain]; n >= w.caps.PerDomain {
		return fmt.Sprintf("domain %.64q already has %d admissions waiting on the leader, its limit (--max-waiters-per-domain %d); "+
			"retry later, or send without max_wait_ms", domain, n, w.caps.PerDomain), ScopeDomainWaiters
	}
	w.byClient[client]++
	w.byDomain[domain]++
	return "", ""
}

// clientKey is the waiter-count key of a client: client IDs are the caller's choice, so they
// count per authenticated identity (one identity cannot exhaust another's slots).
func clientKey(owner, clientID string) string { return owner + "\x00" + clientID }

// ScopeDomainWaiters is the scope of a too_many_waiters denial by the per-domain cap ("client"
// for the per-client one).
const ScopeDomainWaiters = "domain"

// put returns a slot taken by take.
func (w *waiterSlots) put(client, domain string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.byClient[client]--; w.byClient[client] <= 0 {
		delete(w.byClient, client)
	}
	if w.byDomain[domain]--; w.byDomain[domain] <= 0 {
		delete(w.byDomain, domain)
	}
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
