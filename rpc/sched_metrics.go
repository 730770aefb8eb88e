package rpc

import (
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/quotad/quotad/quota"
)

// fairMetrics are the fair scheduler's Prometheus metrics. Tenants appear only as tiers
// (limits-file names, bounded), never as raw IDs. A nil *fairMetrics records nothing.
type fairMetrics struct {
	admittedCost *prometheus.CounterVec
	admittedN    *prometheus.CounterVec
	denials      *prometheus.CounterVec
	waitTime     *prometheus.HistogramVec
	waiting      *prometheus.GaugeVec
	oldest       *prometheus.GaugeVec
	largest      *prometheus.GaugeVec
	unused       *prometheus.GaugeVec
	domains      map[string]bool // domains with queue gauges set, to zero them when idle
}

func newFairMetrics(m *Metrics) *fairMetrics {
	if m == nil {
		return nil
	}
	fm := &fairMetrics{
		admittedCost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotad_fair_admitted_cost_total", Help: "Cost units admitted to scheduled (waiting) admissions, by domain, work class and tenant tier.",
		}, []string{"domain", "class", "tier"}),
		admittedN: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotad_fair_admitted_total", Help: "Scheduled admissions admitted, by domain and attempt (first or retry); retry share = retry / total.",
		}, []string{"domain", "attempt"}),
		denials: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotad_fair_denials_total", Help: "Denials on the scheduler's path by domain, reason and scope (scope waiters:<level> = yielded to waiting admissions).",
		}, []string{"domain", "reason", "scope"}),
		waitTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "quotad_fair_wait_seconds", Help: "Time scheduled admissions waited on the leader until decided, by domain, class, tier and outcome.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}, []string{"domain", "class", "tier", "admitted"}),
		waiting: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "quotad_fair_waiting", Help: "Admissions waiting on the leader, by domain and contended scope.",
		}, []string{"domain", "scope"}),
		oldest: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "quotad_fair_oldest_wait_seconds", Help: "Age of the oldest waiting admission, by domain and contended scope.",
		}, []string{"domain", "scope"}),
		largest: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "quotad_fair_largest_tenant_share", Help: "Largest single tenant's share of the admitted cost on a contended bucket over the last 10-20 s (under congestion).",
		}, []string{"domain", "scope"}),
		unused: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "quotad_fair_unused_tokens", Help: "Whole tokens left in a contended bucket while admissions wait on it (work not eligible elsewhere; ~0 when work-conserving).",
		}, []string{"domain", "scope"}),
		domains: map[string]bool{},
	}
	m.Registry.MustRegister(fm.admittedCost, fm.admittedN, fm.denials, fm.waitTime, fm.waiting, fm.oldest, fm.largest, fm.unused)
	return fm
}

func (m *fairMetrics) admitted(w *waiter) {
	if m == nil {
		return
	}
	m.admittedCost.WithLabelValues(w.adm.Domain, w.classLabel, w.tier).Add(float64(w.cost))
	attempt := "first"
	if w.adm.Attempt > 1 {
		attempt = "retry"
	}
	m.admittedN.WithLabelValues(w.adm.Domain, attempt).Inc()
}

func (m *fairMetrics) denied(domain, reason, scope string) {
	if m == nil {
		return
	}
	m.denials.WithLabelValues(domain, reason, scope).Inc()
}

func (m *fairMetrics) waited(w *waiter, admitted bool, d time.Duration) {
	if m == nil {
		return
	}
	a := "false"
	if admitted {
		a = "true"
	}
	m.waitTime.WithLabelValues(w.adm.Domain, w.classLabel, w.tier, a).Observe(d.Seconds())
}

// queue sets the gauges of one contended bucket after a pump pass.
func (m *fairMetrics) queue(q *fairQueue, now time.Time, u *shareWindow) {
	if m == nil {
		return
	}
	m.domains[q.domain+"\x00"+q.scope] = true
	m.waiting.WithLabelValues(q.domain, q.scope).Set(float64(q.q.Len()))
	if t, ok := q.q.Oldest(); ok {
		m.oldest.WithLabelValues(q.domain, q.scope).Set(now.Sub(t).Seconds())
	} else {
		m.oldest.WithLabelValues(q.domain, q.scope).Set(0)
	}
	if u != nil {
		m.largest.WithLabelValues(q.domain, q.scope).Set(u.largestShare(now))
	}
	if !q.spare {
		m.unused.WithLabelValues(q.domain, q.scope).Set(0)
	}
}

func (m *fairMetrics) spareTokens(q *fairQueue, tokens uint64) {
	if m != nil {
		m.unused.WithLabelValues(q.domain, q.scope).Set(float64(tokens))
	}
}

// idle zeroes the queue gauges once nothing waits.
func (m *fairMetrics) idle() {
	if m == nil {
		return
	}
	for k := range m.domains {
		d, s, _ := cut0(k)
		m.waiting.WithLabelValues(d, s).Set(0)
		m.oldest.WithLabelValues(d, s).Set(0)
		m.unused.WithLabelValues(d, s).Set(0)
		delete(m.domains, k)
	}
}

func cut0(s string) (string, string, bool) {
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return s[:i], s[i+1:], true
		}
	}
	return s, "", false
}

// shareWindow tracks who got a bucket's capacity lately: two rotating windows, so a reading
// covers between one and two window lengths. Windows start on multiples of length (wall
// clock), whenever the shareWindow was made, so an idle one and a new one read the same from
// then on: that is what lets fair.pruneUsage drop idle ones unseen.
type shareWindow struct {
	domain    string
	scope     string
	length    time.Duration
	started   time.Time
	cur, prev map[string]*flowUsage
}

type flowUsage struct {
	Tier    string
	Cost    uint64
	N       uint64
	WaitSum time.Duration
	WaitMax time.Duration
}

func newShareWindow(length time.Duration, now time.Time) *shareWindow {
	return &shareWindow{length: length, started: now.Truncate(length), cur: map[string]*flowUsage{}, prev: map[string]*flowUsage{}}
}

func (s *shareWindow) rotate(now time.Time) {
	n := int64(now.Sub(s.started) / s.length) // windows ended since the current one started
	switch {
	case n == 1:
		s.prev, s.cur = s.cur, map[string]*flowUsage{}
	case n > 1: // idle for more than a window: both empty
		s.prev, s.cur = map[string]*flowUsage{}, map[string]*flowUsage{}
	}
	if n > 0 {
		s.started = s.started.Add(time.Duration(n) * s.length)
	}
}

// idle reports whether nothing was admitted in the current and previous windows.
func (s *shareWindow) idle(now time.Time) bool {
	s.rotate(now)
	return len(s.cur) == 0 && len(s.prev) == 0
}

func (s *shareWindow) add(now time.Time, flow, tier string, cost uint64, wait time.Duration) {
	s.rotate(now)
	u := s.cur[flow]
	if u == nil {
		u = &flowUsage{Tier: tier}
		s.cur[flow] = u
	}
	u.Cost += cost
	u.N++
	u.WaitSum += wait
	u.WaitMax = max(u.WaitMax, wait)
}

// flows merges both windows.
func (s *shareWindow) flows(now time.Time) (map[string]flowUsage, uint64) {
	s.rotate(now)
	out := map[string]flowUsage{}
	var total uint64
	for _, m := range []map[string]*flowUsage{s.prev, s.cur} {
		for f, u := range m {
			o := out[f]
			o.Tier = u.Tier
			o.Cost += u.Cost
			o.N += u.N
			o.WaitSum += u.WaitSum
			o.WaitMax = max(o.WaitMax, u.WaitMax)
			out[f] = o
			total += u.Cost
		}
	}
	return out, total
}

func (s *shareWindow) largestShare(now time.Time) float64 {
	fl, total := s.flows(now)
	if total == 0 {
		return 0
	}
	var big uint64
	for _, u := range fl {
		big = max(big, u.Cost)
	}
	return float64(big) / float64(total)
}

// concurrencyCollector reports every domain-level concurrency limit's occupancy at scrape time.
type concurrencyCollector struct {
	f    *fair
	desc *prometheus.Desc
}

func (c concurrencyCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c concurrencyCollector) Collect(ch chan<- prometheus.Metric) {
	lim := c.f.s.fsm.Limits()
	names := make([]string, 0, len(lim.Domains))
	for _, d := range lim.Domains {
		if d.Concurrency != nil {
			names = append(names, d.Name)
		}
	}
	slices.Sort(names)
	for _, name := range names {
		st, err := c.f.s.fsm.Status(name, []quota.Entry(nil))
		if err != nil || len(st) == 0 || st[0].MaxInFlight == 0 {
			continue
		}
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue,
			float64(st[0].InFlight)/float64(st[0].MaxInFlight), name)
	}
}

func (f *fair) registerCollectors(m *Metrics) {
	if m == nil {
		return
	}
	m.Registry.MustRegister(concurrencyCollector{f: f, desc: prometheus.NewDesc(
		"quotad_fair_concurrency_occupancy", "In-flight permits / max_in_flight of each domain-level concurrency limit.",
		[]string{"domain"}, nil)})
}
