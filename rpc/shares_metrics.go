package rpc

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/quota"
)

// Share metrics (issue 12): grants answered by this leader, by path status, and per lendable
// bucket (read from the FSM at scrape time) the lent rate, burst, holders and central demand.

type shareMetrics struct {
	paths  *prometheus.CounterVec
	grants *prometheus.CounterVec
	fsm    *fsm.FSM
}

var (
	lentRateDesc  = prometheus.NewDesc("quotad_share_lent_rate", "Rate lent to share holders (units per second), per lendable bucket.", []string{"key"}, nil)
	lentBurstDesc = prometheus.NewDesc("quotad_share_lent_burst", "Burst lent to share holders (units), per lendable bucket.", []string{"key"}, nil)
	holdersDesc   = prometheus.NewDesc("quotad_share_holders", "Holders charged at a lendable bucket.", []string{"key"}, nil)
	demandDesc    = prometheus.NewDesc("quotad_share_central_demand", "Central callers' demand (units per second, EWMA) at a lendable bucket.", []string{"key"}, nil)
	reserveDesc   = prometheus.NewDesc("quotad_share_reserve_rate", "Rate a lendable bucket keeps for central callers and newcomers (units per second): never lent.", []string{"key"}, nil)
	expiriesDesc  = prometheus.NewDesc("quotad_share_expiries_total", "Holders whose shares ended without a release (crashed, partitioned or stopped past their lease), as applied by this replica since it started.", nil, nil)
	countDesc     = prometheus.NewDesc("quotad_share_state", "Share state sizes: holders known and buckets with lends.", []string{"what"}, nil)
)

// maxShareSeries caps the per-bucket series one scrape reports (bucket keys carry tenants).
const maxShareSeries = 1000

func (m *shareMetrics) Describe(ch chan<- *prometheus.Desc) {
	ch <- lentRateDesc
	ch <- lentBurstDesc
	ch <- holdersDesc
	ch <- demandDesc
	ch <- reserveDesc
	ch <- expiriesDesc
	ch <- countDesc
}

func (m *shareMetrics) Collect(ch chan<- prometheus.Metric) {
	if m.fsm == nil {
		return
	}
	lends, _ := m.fsm.ShareStatus("")
	for i, l := range lends {
		if i >= maxShareSeries {
			break
		}
		ch <- prometheus.MustNewConstMetric(lentRateDesc, prometheus.GaugeValue, float64(l.LentRate)/quota.MicroPerUnit, l.Key)
		ch <- prometheus.MustNewConstMetric(lentBurstDesc, prometheus.GaugeValue, float64(l.LentBurst)/quota.MicroPerUnit, l.Key)
		ch <- prometheus.MustNewConstMetric(holdersDesc, prometheus.GaugeValue, float64(l.Holders), l.Key)
		ch <- prometheus.MustNewConstMetric(demandDesc, prometheus.GaugeValue, float64(l.CentralDemand)/quota.MicroPerUnit, l.Key)
		ch <- prometheus.MustNewConstMetric(reserveDesc, prometheus.GaugeValue, float64(l.ReserveRate)/quota.MicroPerUnit, l.Key)
	}
	ch <- prometheus.MustNewConstMetric(expiriesDesc, prometheus.CounterValue, float64(m.fsm.ShareExpiries()))
	c := m.fsm.ShareCounts()
	ch <- prometheus.MustNewConstMetric(countDesc, prometheus.GaugeValue, float64(c.Holders), "holders")
	ch <- prometheus.MustNewConstMetric(countDesc, prometheus.GaugeValue, float64(c.LentBuckets), "lent_buckets")
}

// registerShares adds the share metrics for f's state.
func (m *Metrics) registerShares(f *fsm.FSM) {
	if m == nil || m.shares != nil {
		return
	}
	m.shares = &shareMetrics{fsm: f, paths: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "quotad_share_paths_total", Help: "Paths answered by share grants on this leader, by status (lent, central, too_small, invalid).",
	}, []string{"status"}), grants: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "quotad_share_grants_total", Help: "Share requests answered by this leader: first (the holder's first grant at some bucket), renewal, duplicate (a retry answered from the engine).",
	}, []string{"kind"})}
	m.Registry.MustRegister(m.shares, m.shares.paths, m.shares.grants)
}

func (m *Metrics) observeShare(g *quota.ShareGrant) {
	if m == nil || m.shares == nil || g == nil {
		return
	}
	kind := "renewal"
	for _, p := range g.Paths {
		m.shares.paths.WithLabelValues(string(p.Status)).Inc()
		for _, l := range p.Levels {
			if l.First {
				kind = "first"
			}
		}
	}
	if g.Duplicate {
		kind = "duplicate"
	}
	m.shares.grants.WithLabelValues(kind).Inc()
}
