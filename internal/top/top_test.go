package top

import (
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/config"
	"github.com/quotad/quotad/rpc"
)

func TestOversubscriptionWarnsAboveRatio(t *testing.T) {
	l, err := config.Parse("t", []byte(`domain: p
rate_limit: {unit: second, requests_per_unit: 100}
descriptors:
  - key: tenant
    value: a
    rate_limit: {unit: second, requests_per_unit: 90}
  - key: tenant
    value: b
    rate_limit: {unit: minute, requests_per_unit: 4200}
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 1000}
`))
	if err != nil {
		t.Fatal(err)
	}
	// 90 + 70 = 160/s against 100/s; the per-value level is not summed.
	if got := CheckOversubscription(l, 1.5); len(got) != 1 || got[0].Ratio < 1.59 || got[0].Ratio > 1.61 {
		t.Fatalf("at 1.5x: %+v", got)
	}
	if got := CheckOversubscription(l, 2); len(got) != 0 {
		t.Fatalf("at 2x: %+v", got)
	}
	var b strings.Builder
	Render(&b, rpc.FairView{Node: "n1", Buckets: []rpc.FairBucketView{{Key: "p", Scope: "domain",
		Flows: []rpc.FairFlowView{{Flow: "tenant=a", Tier: "default", Weight: 1, Share: 0.5}}}}}, l, 1.5, time.Unix(0, 0))
	if !strings.Contains(b.String(), "tenant=a") || !strings.Contains(b.String(), "WARNING p domain") {
		t.Fatalf("frame:\n%s", b.String())
	}
}
