package rpc_test

import (
	"context"
	"testing"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/rpc/rpctest"
)

// shadowKeysLimits: hourly rates, so a debited bucket is not full again (and swept, making
// room) during the test.
const shadowKeysLimits = `
domain: sk
max_keys: 2
descriptors:
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 100}
    descriptors:
      - key: consumer
        shadow_mode: true
        rate_limit: {unit: hour, requests_per_unit: 10}
`

// TestShadowMaxKeysAcquireMatchesRLS: with the domain's max_keys full, an Acquire whose only
// new bucket is at a shadow_mode level is admitted, as Envoy RLS answers the same descriptor
// OK (shadow); a new bucket at an enforcing level is still refused too_many_keys.
func TestShadowMaxKeysAcquireMatchesRLS(t *testing.T) {
	c := rpctest.Start(t, 1, shadowKeysLimits)
	ctx := context.Background()
	conn := dial(t, c.Addrs()[0])
	q := quotadv1.NewQuotaClient(conn)
	consumer := func(id uint64, tenant, v string) *quotadv1.Admission {
		return &quotadv1.Admission{RequestId: id, Domain: "sk",
			Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tenant}, {Key: "consumer", Value: v}}}
	}
	if d, err := acquireOne(ctx, q, "x", consumer(1, "acme", "c0")); err != nil || !d.Admitted {
		t.Fatalf("first consumer: %+v %v", d, err)
	}
	// The domain holds 2 buckets, its max_keys.
	r, err := rlsv3.NewRateLimitServiceClient(conn).ShouldRateLimit(ctx, rlsReq("sk", []string{"tenant", "acme", "consumer", "c1"}))
	wantRLS(t, r, err, rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OK)
	if d, err := acquireOne(ctx, q, "x", consumer(2, "acme", "c2")); err != nil || !d.Admitted || d.Reason != "ok" {
		t.Fatalf("a new shadow bucket in a full domain over Acquire: %+v %v, want admitted as RLS answers it", d, err)
	}
	if d, err := acquireOne(ctx, q, "x", consumer(3, "globex", "c0")); err != nil || d.Reason != "too_many_keys" || d.Scope != "tenant" {
		t.Fatalf("a new enforcing bucket in a full domain: %+v %v, want too_many_keys at tenant", d, err)
	}
}
