package rpc

import (
	"math"
	"sync"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/quotad/quotad/quota"
)

// Per-rule statistics of the Envoy RLS, with envoyproxy/ratelimit's names and meaning: its
// statsd counter ratelimit.service.rate_limit.<domain>.<key>.<stat> is quotad's
// quotad_rate_limit_<stat>_total{domain="<domain>",key="<key>"}, where key is the rule's
// key as envoy builds it (the configured path, "tenant.user" or "path_files/*";
// detailed_metric and value_to_metric put the request's values in). The domain ceiling (a
// quotad extension) counts under key "" (the domain itself).
//
// Label cardinality is bounded: per domain at most MaxRLSStatKeys distinct keys get series of
// their own; the hits of later keys count under key "_other" (quotad_rate_limit_keys_dropped_total
// says how many keys were folded). detailed_metric on a per-user rule would otherwise give every
// user a series forever.

// MaxRLSStatKeys caps the distinct rule keys with series of their own, per domain.
const MaxRLSStatKeys = 1000

// rlsOtherKey is the key the hits of keys beyond MaxRLSStatKeys count under.
const rlsOtherKey = "_other"

type rlsMetrics struct {
	totalHits, overLimit, nearLimit, withinLimit, shadowMode *prometheus.CounterVec
	requests                                                 *prometheus.CounterVec
	okReqs, overReqs, unknownReqs                            prometheus.Counter // requests' series
	latency                                                  prometheus.Histogram
	dropped                                                  *prometheus.CounterVec
	// A follower's forwarding: calls and the ForwardRateLimit RPCs that carried them; calls
	// not forwarded or not decided (forwardDropped, by reason); batches sent again to a new
	// leader (forwardRerouted, in calls).
	forwarded, forwardBatches prometheus.Counter
	forwardDropped            *prometheus.CounterVec
	forwardRerouted           prometheus.Counter

	mu   sync.Mutex
	keys map[string]map[string]*ruleCounters // domain → key → its series
}

// ruleCounters are one (domain, key)'s series, looked up once.
type ruleCounters struct{ total, over, near, within, shadow prometheus.Counter }

func newRLSMetrics(reg *prometheus.Registry) *rlsMetrics {
	counter := func(stat, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "quotad_rate_limit_" + stat + "_total", Help: help},
			[]string{"domain", "key"})
	}
	m := &rlsMetrics{
		totalHits:   counter("total_hits", "Envoy RLS: hits checked against the rule (envoyproxy/ratelimit's total_hits)."),
		overLimit:   counter("over_limit", "Envoy RLS: hits over the rule's limit (over_limit)."),
		nearLimit:   counter("near_limit", "Envoy RLS: hits above the near-limit ratio of the rule's limit, not over it (near_limit)."),
		withinLimit: counter("within_limit", "Envoy RLS: hits within the rule's limit (within_limit)."),
		shadowMode:  counter("shadow_mode", "Envoy RLS: hits over a shadow_mode rule's limit, answered OK (shadow_mode)."),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "quotad_rls_requests_total",
			Help: "Envoy RLS ShouldRateLimit requests decided on this leader, by overall code (ok, over_limit), or unknown_domain: a domain the limits do not define (answered per --rls-unknown-domain)."}, []string{"code"}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "quotad_rls_decision_seconds",
			Help: "Time from receiving a ShouldRateLimit call on the leader to its answer.", Buckets: prometheus.ExponentialBuckets(0.0002, 2, 16)}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "quotad_rate_limit_keys_dropped_total",
			Help: "Envoy RLS rule keys counted under key \"_other\" because the domain already had MaxRLSStatKeys keys."}, []string{"domain"}),
		forwarded: prometheus.NewCounter(prometheus.CounterOpts{Name: "quotad_rls_forwarded_total",
			Help: "Envoy RLS ShouldRateLimit calls this node forwarded to the leader (as a follower)."}),
		forwardBatches: prometheus.NewCounter(prometheus.CounterOpts{Name: "quotad_rls_forward_batches_total",
			Help: "ForwardRateLimit RPCs that carried them (several calls each under load)."}),
		forwardDropped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "quotad_rls_forward_dropped_total",
			Help: "Forwarded Envoy RLS calls answered without a decision, nothing charged: queue_full (a follower's queue to the leader was full), caller_gone (the caller gave up before its batch left), expired (on the leader: the caller's deadline passed before the call was decided)."}, []string{"reason"}),
		forwardRerouted: prometheus.NewCounter(prometheus.CounterOpts{Name: "quotad_rls_forward_rerouted_total",
			Help: "Forwarded Envoy RLS calls sent again, to the new leader, after the peer they went to said it no longer leads (nothing decided)."}),
		keys: make(map[string]map[string]*ruleCounters),
	}
	reg.MustRegister(m.totalHits, m.overLimit, m.nearLimit, m.withinLimit, m.shadowMode, m.requests, m.latency, m.dropped,
		m.forwarded, m.forwardBatches, m.forwardDropped, m.forwardRerouted)
	for _, r := range []string{"queue_full", "caller_gone", "expired"} {
		m.forwardDropped.WithLabelValues(r)
	}
	m.okReqs, m.overReqs = m.requests.WithLabelValues("ok"), m.requests.WithLabelValues("over_limit")
	m.unknownReqs = m.requests.WithLabelValues("unknown_domain")
	return m
}

// counters returns the series of key in domain, folding keys beyond the cap into "_other".
func (m *rlsMetrics) counters(domain string, kb []byte) *ruleCounters {
	m.mu.Lock()
	defer m.mu.Unlock()
	ks := m.keys[domain]
	if ks == nil {
		ks = make(map[string]*ruleCounters)
		m.keys[domain] = ks
	}
	if c, ok := ks[string(kb)]; ok { // no allocation for a key seen before
		return c
	}
	key := string(kb)
	if len(ks) >= MaxRLSStatKeys {
		m.dropped.WithLabelValues(domain).Inc()
		key = rlsOtherKey
		if c, ok := ks[key]; ok {
			return c
		}
	}
	c := &ruleCounters{total: m.totalHits.WithLabelValues(domain, key), over: m.overLimit.WithLabelValues(domain, key),
		near: m.nearLimit.WithLabelValues(domain, key), within: m.withinLimit.WithLabelValues(domain, key),
		shadow: m.shadowMode.WithLabelValues(domain, key)}
	ks[key] = c
	return c
}

// rlsCounts are one status's contributions to the counters, computed as envoyproxy/ratelimit
// computes them from the limit and the usage before and after the hits.
type rlsCounts struct{ total, over, near, within, shadow uint64 }

func countRLS(st *quota.RLSStatus, ratio float64) rlsCounts {
	h := st.Hits
	limit := st.Capacity
	before := st.UsedBefore
	after := before + h
	near := uint64(math.Floor(float64(limit) * ratio))
	c := rlsCounts{total: h}
	if st.Code == quota.RLSOverLimit || st.Shadow || st.QuotaMode {
		overHits := h
		if before < limit {
			overHits = after - limit
			c.near = limit - max(near, before)
		}
		if st.Shadow {
			c.shadow = overHits
		}
		c.over = overHits
		return c
	}
	if after > near {
		if before >= near {
			c.near = h
		} else {
			c.near = after - near
		}
	}
	c.within = h
	return c
}

// observeForward counts a ForwardRateLimit RPC of calls calls.
func (m *Metrics) observeForward(calls int) {
	if m == nil || m.rls == nil {
		return
	}
	m.rls.forwardBatches.Inc()
	m.rls.forwarded.Add(float64(calls))
}

// observeForwardDropped counts n forwarded calls answered without a decision, for reason.
func (m *Metrics) observeForwardDropped(reason string, n int) {
	if m == nil || m.rls == nil {
		return
	}
	m.rls.forwardDropped.WithLabelValues(reason).Add(float64(n))
}

// observeForwardRerouted counts n calls sent again to a new leader.
func (m *Metrics) observeForwardRerouted(n int) {
	if m == nil || m.rls == nil {
		return
	}
	m.rls.forwardRerouted.Add(float64(n))
}

// observeRLS records a decided request: per-rule counters (keys from the matcher of the
// limits the decision was made under, which the FSM hands back with it), the overall code and
// the latency.
func (m *Metrics) observeRLS(match *quota.Matcher, req *rlsv3.RateLimitRequest, d *quota.RLSDecision,
	code rlsv3.RateLimitResponse_Code, ratio float64, took time.Duration) {
	if m == nil || m.rls == nil {
		return
	}
	r := m.rls
	switch {
	case d.UnknownDomain:
		r.unknownReqs.Inc()
	case code == rlsv3.RateLimitResponse_OVER_LIMIT:
		r.overReqs.Inc()
	default:
		r.okReqs.Inc()
	}
	r.latency.Observe(took.Seconds())
	if d.UnknownDomain {
		return
	}
	if c := d.Ceiling; c != nil {
		r.add(req.Domain, nil, countRLS(c, ratio))
		if c.Code == quota.RLSOverLimit {
			return // no descriptor was checked
		}
	}
	var entries [8]quota.Entry
	var kb [128]byte
	for i := range d.Statuses {
		st := &d.Statuses[i]
		if !st.Limited {
			continue
		}
		if req.Descriptors[i].GetLimit() != nil {
			// envoyproxy/ratelimit's key for an override: the request's keys and values.
			r.add(req.Domain, overrideStatKey(kb[:0], req.Descriptors[i]), countRLS(st, ratio))
			continue
		}
		es := entries[:0]
		for _, e := range req.Descriptors[i].GetEntries() {
			es = append(es, quota.Entry{Key: e.GetKey(), Value: e.GetValue()})
		}
		key := match.AppendRuleKey(kb[:0], req.Domain, es)
		if len(key) == 0 {
			continue // cannot happen: the decision applied a rule
		}
		r.add(req.Domain, key[len(req.Domain)+1:], countRLS(st, ratio))
	}
}

// overrideStatKey is envoyproxy/ratelimit's statistics key of a descriptor with its own limit
// (its config's descriptorKey, without the domain): key_value of every entry joined by '.'.
func overrideStatKey(b []byte, d *ratelimitv3.RateLimitDescriptor) []byte {
	for i, e := range d.GetEntries() {
		if i > 0 {
			b = append(b, '.')
		}
		b = append(b, e.GetKey()...)
		if e.GetValue() != "" {
			b = append(b, '_')
			b = append(b, e.GetValue()...)
		}
	}
	return b
}

func (r *rlsMetrics) add(domain string, key []byte, c rlsCounts) {
	k := r.counters(domain, key)
	k.total.Add(float64(c.total))
	k.over.Add(float64(c.over))
	k.near.Add(float64(c.near))
	k.within.Add(float64(c.within))
	k.shadow.Add(float64(c.shadow))
}
