package rpc

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/quotad/quotad/internal/buildinfo"
)

// buildInfoGauge is quotad_build_info: always 1, labelled with what `quotad version` prints,
// so a dashboard can show which version each node runs (and a rolling upgrade's progress).
func buildInfoGauge() prometheus.Collector {
	bi := buildinfo.Get()
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "quotad_build_info",
		Help:        "Always 1; the labels say which quotad build this node runs.",
		ConstLabels: prometheus.Labels{"version": bi.Version, "commit": bi.Commit, "goversion": bi.GoVersion},
	})
	g.Set(1)
	return g
}
