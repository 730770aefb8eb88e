package quota

import (
	"testing"
	"time"
)

func TestAllocationCountsActiveKeysPerLevel(t *testing.T) {
	e := NewEngine()
	lim := &Limits{Domains: []Domain{{Name: "platform", Rate: &Rate{Unit: time.Minute, RequestsPerUnit: 60000},
		Descriptors: []Node{{Key: "tenant", Rate: &Rate{Unit: time.Minute, RequestsPerUnit: 5000},
			Children: []Node{{Key: "consumer", Rate: &Rate{Unit: time.Minute, RequestsPerUnit: 600}}}},
			{Key: "tenant", Value: "big", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 500}}}}}}
	if err := e.SetLimits(0, lim); err != nil {
		t.Fatal(err)
	}
	now := Time(time.Second)
	for i, tenant := range []string{"a", "b", "c", "big"} {
		d := e.Acquire(now, Request{Domain: "platform", Cost: 1, Descriptors: []Entry{{Key: "tenant", Value: tenant}, {Key: "consumer", Value: "app"}}, Owner: "o", Spread: uint64(i)})
		if !d.Admitted {
			t.Fatalf("%s: %+v", tenant, d)
		}
	}
	got := map[string]LevelAllocation{}
	for _, a := range e.Allocation() {
		got[a.Path] = a
	}
	want := map[string]LevelAllocation{
		"domain":          {Domain: "platform", Path: "domain", RatePerSecond: 1000, ActiveKeys: 1},
		"tenant":          {Domain: "platform", Path: "tenant", PerKey: true, RatePerSecond: 5000.0 / 60, ActiveKeys: 3},
		"tenant/consumer": {Domain: "platform", Path: "tenant/consumer", PerKey: true, RatePerSecond: 10, ActiveKeys: 3},
		"tenant=big":      {Domain: "platform", Path: "tenant=big", RatePerSecond: 500, ActiveKeys: 1},
	}
	if len(got) != len(want) {
		t.Fatalf("levels %v", got)
	}
	for p, w := range want {
		g := got[p]
		if g.Domain != w.Domain || g.PerKey != w.PerKey || g.ActiveKeys != w.ActiveKeys || g.RatePerSecond < w.RatePerSecond*0.999 || g.RatePerSecond > w.RatePerSecond*1.001 {
			t.Errorf("%s: %+v, want %+v", p, g, w)
		}
	}
}
