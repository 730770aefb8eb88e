package rpc

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/quotad/quotad/fsm"
)

// allocationCollector exports, per rate-limited level of the limits, its configured rate, the
// keys it holds and their sum: the "sum of allocated quotas against capacity" an operator
// alerts on (docs/metrics.md). Labels are the configured domain and level path (operator
// defined, bounded), never a caller's value.
type allocationCollector struct {
	fsm                     *fsm.FSM
	rate, active, allocated *prometheus.Desc
}

func newAllocationCollector(f *fsm.FSM) *allocationCollector {
	l := []string{"domain", "level"}
	return &allocationCollector{fsm: f,
		rate: prometheus.NewDesc("quotad_limit_rate_per_second",
			"Configured refill rate of one bucket of the level, in cost units per second (level \"domain\": the domain's ceiling, i.e. the capacity it protects).", l, nil),
		active: prometheus.NewDesc("quotad_limit_active_keys",
			"Buckets the level holds now (not full: keys that spent within about one refill of their burst).", l, nil),
		allocated: prometheus.NewDesc("quotad_limit_allocated_per_second",
			"Quota the level hands out, in cost units per second: its rate times its active keys (times 1 for a level with a fixed value). Compare with the domain's ceiling or the provider's capacity.", l, nil),
	}
}

func (c *allocationCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.rate
	ch <- c.active
	ch <- c.allocated
}

func (c *allocationCollector) Collect(ch chan<- prometheus.Metric) {
	for _, a := range c.fsm.Allocation() {
		keys := float64(a.ActiveKeys)
		if !a.PerKey {
			keys = 1 // a fixed level's quota is allocated whether or not it is in use
		}
		ch <- prometheus.MustNewConstMetric(c.rate, prometheus.GaugeValue, a.RatePerSecond, a.Domain, a.Path)
		ch <- prometheus.MustNewConstMetric(c.active, prometheus.GaugeValue, float64(a.ActiveKeys), a.Domain, a.Path)
		ch <- prometheus.MustNewConstMetric(c.allocated, prometheus.GaugeValue, a.RatePerSecond*keys, a.Domain, a.Path)
	}
}
