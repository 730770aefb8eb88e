package rpc

import (
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/quotad/quotad/quota"
)

// Per-domain keys beyond MaxRLSStatKeys share the "_other" series: detailed_metric on a
// per-user rule cannot grow the metrics without bound.
func TestRLSStatKeysAreBounded(t *testing.T) {
	m := newRLSMetrics(prometheus.NewRegistry())
	for i := range MaxRLSStatKeys + 500 {
		m.add("d", fmt.Appendf(nil, "user_%d", i), rlsCounts{total: 1})
	}
	m.add("e", []byte("k"), rlsCounts{total: 1})
	reg := prometheus.NewRegistry()
	reg.MustRegister(m.totalHits)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if n := len(families[0].Metric); n != MaxRLSStatKeys+2 {
		t.Errorf("%d total_hits series, want %d (the cap, _other, and domain e's key)", n, MaxRLSStatKeys+2)
	}
	if got := value(m.totalHits.WithLabelValues("d", rlsOtherKey)); got != 500 {
		t.Errorf("_other counted %v hits, want 500", got)
	}
	if got := value(m.dropped.WithLabelValues("d")); got != 500 {
		t.Errorf("keys_dropped %v, want 500", got)
	}
}

// countRLS follows envoyproxy/ratelimit's arithmetic (limiter/base_limiter.go) for a limit of
// 10 and near ratio 0.8 (near threshold 8).
func TestCountRLSLikeEnvoy(t *testing.T) {
	st := func(code quota.RLSCode, before, hits uint64) *quota.RLSStatus {
		return &quota.RLSStatus{Code: code, Capacity: 10, UsedBefore: before, Hits: hits}
	}
	for _, tt := range []struct {
		st   *quota.RLSStatus
		want rlsCounts
	}{
		{st(quota.RLSOK, 0, 1), rlsCounts{total: 1, within: 1}},
		{st(quota.RLSOK, 7, 2), rlsCounts{total: 2, within: 2, near: 1}},      // 8 -> 9: one near
		{st(quota.RLSOK, 9, 1), rlsCounts{total: 1, within: 1, near: 1}},      // all near
		{st(quota.RLSOverLimit, 10, 3), rlsCounts{total: 3, over: 3}},         // all over
		{st(quota.RLSOverLimit, 7, 5), rlsCounts{total: 5, over: 2, near: 2}}, // 8..10 near, 2 over
		{&quota.RLSStatus{Code: quota.RLSOK, Shadow: true, Capacity: 10, UsedBefore: 10, Hits: 1}, rlsCounts{total: 1, over: 1, shadow: 1}},
	} {
		if got := countRLS(tt.st, 0.8); got != tt.want {
			t.Errorf("%+v: %+v, want %+v", *tt.st, got, tt.want)
		}
	}
}

func value(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}
