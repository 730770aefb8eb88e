package rpc

import (
	"math"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// Metrics are one node's Prometheus metrics. A nil *Metrics records nothing.
type Metrics struct {
	Registry *prometheus.Registry

	decisions     *prometheus.CounterVec
	decisionTime  prometheus.Histogram
	commitTime    prometheus.Histogram
	entryOps      prometheus.Histogram
	commitErrors  prometheus.Counter
	leaderChanges prometheus.Counter
	feedback      *prometheus.CounterVec
	streamMsgs    *prometheus.CounterVec // AcquireStream messages, by direction (stream.go)
	streamRecv    prometheus.Counter     // its direction="received" series
	streamSent    prometheus.Counter     // its direction="sent" series
	streamRefused *prometheus.CounterVec // AcquireStreams refused or ended by a cap, by reason
	rls           *rlsMetrics            // Envoy RLS (envoy_metrics.go)
	shares        *shareMetrics          // registerShares
}

// NewMetrics registers quotad's metrics on a fresh registry (never the global one, so several
// nodes can live in one test process).
func NewMetrics() *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotad_decisions_total", Help: "Admission decisions made on this leader, by reason.",
		}, []string{"reason"}),
		decisionTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "quotad_decision_seconds", Help: "Time from receiving an Acquire call to its decisions.",
			Buckets: prometheus.ExponentialBuckets(0.0002, 2, 16),
		}),
		commitTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "quotad_raft_commit_seconds", Help: "Time to commit and apply one log entry (group commit).",
			// Buckets √2 apart (0.2 ms to 9 s): a quantile interpolated in a bucket is off by at
			// most 41 % of its lower bound (100 % with power-of-two buckets); the fair
			// scheduler's latency bar (bench/fair rate_sweep) is stated in its p99.
			Buckets: prometheus.ExponentialBuckets(0.0002, math.Sqrt2, 32),
		}),
		entryOps: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "quotad_entry_ops", Help: "Operations per committed log entry (group commit batch size).",
			Buckets: prometheus.ExponentialBuckets(1, 2, 12),
		}),
		commitErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "quotad_commit_errors_total", Help: "Log entries that failed to commit (outcome unknown to callers).",
		}),
		leaderChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "quotad_leader_changes_total", Help: "Times this node observed a leadership change.",
		}),
	}
	m.feedback = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "quotad_provider_feedback_total",
		Help: "Provider 429/503 reports applied on this leader, by domain, status and outcome " +
			"(paused, decreased, attributed: counted against the named scope; evidence: a 429 without a reason for a whole domain, which changes nothing).",
	}, []string{"domain", "status", "outcome"})
	m.Registry.MustRegister(m.feedback)
	m.streamMsgs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "quotad_acquire_stream_messages_total",
		Help: "AcquireStream messages on this node: received (admissions and cancels from clients) and sent (answers, several per message when ready at once).",
	}, []string{"direction"})
	m.Registry.MustRegister(m.streamMsgs)
	// Both series exist from the start (rate() over a fresh node works; the metrics doc test
	// sees them), and counting one is an atomic add, not a label lookup per message.
	m.streamRecv, m.streamSent = m.streamMsgs.WithLabelValues("received"), m.streamMsgs.WithLabelValues("sent")
	m.streamRefused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "quotad_acquire_streams_capped_total",
		Help: "AcquireStreams this leader refused or ended for a cap: identity (--max-streams-per-identity: the caller went unary) or send_timeout (its client did not read its answers for --stream-send-timeout).",
	}, []string{"reason"})
	m.Registry.MustRegister(m.streamRefused)
	m.streamRefused.WithLabelValues(streamCapIdentity)
	m.streamRefused.WithLabelValues(streamCapSendTimeout)
	m.rls = newRLSMetrics(m.Registry)
	m.Registry.MustRegister(m.decisions, m.decisionTime, m.commitTime, m.entryOps, m.commitErrors,
		m.leaderChanges, buildInfoGauge(), collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Reasons of quotad_acquire_streams_capped_total.
const (
	streamCapIdentity    = "identity"
	streamCapSendTimeout = "send_timeout"
)

// streamCapped counts an AcquireStream refused or ended for a cap (reason).
func (m *Metrics) streamCapped(reason string) {
	if m != nil {
		m.streamRefused.WithLabelValues(reason).Inc()
	}
}

// streamMessage counts one AcquireStream message in direction ("received" or "sent").
func (m *Metrics) streamMessage(direction string) {
	if m != nil {
		if direction == "sent" {
			m.streamSent.Inc()
		} else {
			m.streamRecv.Inc()
		}
	}
}

func (m *Metrics) observeDecision(reason string, took time.Duration) {
	if m == nil {
		return
	}
	m.decisions.WithLabelValues(reason).Inc()
	m.decisionTime.Observe(took.Seconds())
}

// observeDecisions is observeDecision for each of a call's decisions, which all took took.
// The counter is looked up once per run of equal reasons (a call's decisions mostly share
// one), not once per decision: that lookup hashes the label and takes a lock.
func (m *Metrics) observeDecisions(ds []*quotadv1.Decision, took time.Duration) {
	if m == nil {
		return
	}
	for i := 0; i < len(ds); {
		j := i + 1
		for j < len(ds) && ds[j].Reason == ds[i].Reason {
			j++
		}
		m.decisions.WithLabelValues(ds[i].Reason).Add(float64(j - i))
		i = j
	}
	secs := took.Seconds()
	for range ds {
		m.decisionTime.Observe(secs)
	}
}

func (m *Metrics) observeCommit(ops int, took time.Duration, err error) {
	if m == nil {
		return
	}
	if err != nil {
		m.commitErrors.Inc()
		return
	}
	m.commitTime.Observe(took.Seconds())
	m.entryOps.Observe(float64(ops))
}

// LeaderChanged counts an observed leadership change.
func (m *Metrics) LeaderChanged() {
	if m != nil {
		m.leaderChanges.Inc()
	}
}
