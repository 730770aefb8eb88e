package quota

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// perParentLimits: consumers under a tenant, at most perParent consumer buckets per tenant,
// max_keys 10 for the domain.
func perParentLimits(perParent uint64) *Limits {
	return &Limits{Domains: []Domain{{
		Name:    "t7",
		MaxKeys: 10,
		Descriptors: []Node{{Key: "tenant", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 100},
			Children: []Node{{Key: "consumer", MaxKeysPerParent: perParent, Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1}}}}},
	}}}
}

func consumerReq(tenant, consumer string) Request {
	return Request{Domain: "t7", Descriptors: []Entry{{"tenant", tenant}, {"consumer", consumer}}}
}

// TestMaxKeysPerParent: one tenant inventing consumers fills only its own part
// (max_keys_per_parent); another tenant still gets new buckets; a refusal changes nothing;
// sweeps, snapshots and new limits keep the per-parent counts.
func TestMaxKeysPerParent(t *testing.T) {
	e := mustEngine(t, perParentLimits(3))
	for i := range 3 {
		if d := e.Acquire(0, consumerReq("acme", fmt.Sprint("c", i))); !d.Admitted {
			t.Fatalf("acme consumer %d: %+v", i, d)
		}
	}
	before, stats := e.Hash(), e.Stats()
	d := e.Acquire(0, consumerReq("acme", "c3"))
	if d.Admitted || d.Reason != ReasonTooManyKeys || d.Scope != "consumer" || d.Limit != 3 || d.RetryAfter != time.Second ||
		!strings.Contains(d.Message, `"t7/tenant=acme" holds 3 active "consumer" buckets`) ||
		!strings.Contains(d.Message, "max_keys_per_parent is 3") || !strings.Contains(d.Message, `"t7/tenant=acme/consumer=c3"`) {
		t.Fatalf("acme's fourth consumer: %+v", d)
	}
	if e.Hash() != before || e.Stats() != stats {
		t.Fatal("a too_many_keys denial changed the state")
	}
	// Another tenant is not affected: its consumers have their own part.
	for i := range 3 {
		if d := e.Acquire(0, consumerReq("globex", fmt.Sprint("c", i))); !d.Admitted {
			t.Fatalf("globex consumer %d after acme filled its part: %+v", i, d)
		}
	}
	// An existing consumer of acme is decided as before.
	if d := e.Acquire(0, consumerReq("acme", "c0")); d.Reason != ReasonRateLimited {
		t.Fatalf("acme's existing consumer: %+v", d)
	}
	// The domain's max_keys still holds over everything: 8 stored, a third tenant adds 2.
	if d := e.Acquire(0, consumerReq("initech", "c0")); !d.Admitted {
		t.Fatalf("initech: %+v", d)
	}
	if d := e.Acquire(0, consumerReq("umbrella", "c0")); d.Reason != ReasonTooManyKeys || d.Scope != "tenant" || d.Limit != 10 {
		t.Fatalf("a fourth tenant beyond max_keys 10: %+v", d)
	}

	// A restored replica counts the same.
	snap, err := e.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	r := NewEngine()
	if err := r.UnmarshalBinary(snap); err != nil {
		t.Fatal(err)
	}
	if d := r.Acquire(0, consumerReq("acme", "c3")); d.Reason != ReasonTooManyKeys || d.Scope != "consumer" {
		t.Fatalf("restored engine, acme's fourth consumer: %+v", d)
	}
	// Swept buckets make room in their parent's part.
	for _, x := range []*Engine{e, r} {
		x.Tick(1 * s)
		if d := x.Acquire(1*s, consumerReq("acme", "c3")); !d.Admitted {
			t.Fatalf("after the sweep: %+v", d)
		}
	}
	if e.Hash() != r.Hash() {
		t.Fatal("restored replica diverged")
	}
	// New limits recount: lowering the cap below what a parent holds refuses its new keys only.
	e.Acquire(1*s, consumerReq("acme", "c4"))
	if err := e.SetLimits(1*s, perParentLimits(1)); err != nil {
		t.Fatal(err)
	}
	if d := e.Acquire(1*s, consumerReq("acme", "c5")); d.Reason != ReasonTooManyKeys || d.Limit != 1 {
		t.Fatalf("after lowering max_keys_per_parent: %+v", d)
	}
	if d := e.Acquire(1*s, consumerReq("globex", "c0")); !d.Admitted {
		t.Fatalf("globex's first consumer after the sweep: %+v", d)
	}
	if err := e.SetLimits(1*s, perParentLimits(0)); err != nil { // 0: no per-parent cap
		t.Fatal(err)
	}
	if d := e.Acquire(1*s, consumerReq("acme", "c5")); !d.Admitted {
		t.Fatalf("without max_keys_per_parent: %+v", d)
	}
}

// TestMaxKeysPerParentInvalid: a bad max_keys_per_parent names the field, the value and the
// descriptor, and installs nothing.
func TestMaxKeysPerParentInvalid(t *testing.T) {
	e := mustEngine(t, perParentLimits(3))
	v := e.Stats().LimitsVersion
	exact := perParentLimits(0)
	exact.Domains[0].Descriptors[0].Children[0].Value = "bob"
	exact.Domains[0].Descriptors[0].Children[0].MaxKeysPerParent = 5
	noRate := perParentLimits(5)
	noRate.Domains[0].Descriptors[0].Children[0].Rate = nil
	for name, tc := range map[string]struct {
		l    *Limits
		want string
	}{
		"too large": {perParentLimits(MaxMaxKeys + 1), fmt.Sprintf("descriptor tenant/consumer: max_keys_per_parent must be at most %d (got %d)", MaxMaxKeys, MaxMaxKeys+1)},
		"exact":     {exact, `descriptor tenant/consumer=bob: max_keys_per_parent 5 on a level that is one bucket (value "bob")`},
		"no rate":   {noRate, "descriptor tenant/consumer: max_keys_per_parent 5 on a level without a rate_limit"},
	} {
		err := e.SetLimits(0, tc.l)
		if !errors.Is(err, ErrInvalidLimits) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", name, err, tc.want)
		}
	}
	if e.Stats().LimitsVersion != v {
		t.Fatal("invalid limits were installed")
	}
}

// TestMaxKeysPerParentRLS: Envoy's RLS stores buckets under the same cap: a tenant's fourth
// consumer is over limit (too many keys), another tenant's first is not.
func TestMaxKeysPerParentRLS(t *testing.T) {
	e := mustEngine(t, perParentLimits(3))
	for i := range 3 {
		if d := e.RateLimit(0, rls("t7", ent("tenant", "acme", "consumer", fmt.Sprint("c", i)))); d.Code != RLSOK {
			t.Fatalf("acme consumer %d: %+v", i, d)
		}
	}
	before := e.Hash()
	d := e.RateLimit(0, rls("t7", ent("tenant", "acme", "consumer", "c3")))
	if d.Code != RLSOverLimit || !d.Statuses[0].TooManyKeys {
		t.Fatalf("acme's fourth consumer over RLS: %+v", d)
	}
	if e.Hash() != before {
		t.Fatal("a refused RLS request changed the state")
	}
	if d := e.RateLimit(0, rls("t7", ent("tenant", "globex", "consumer", "c0"))); d.Code != RLSOK {
		t.Fatalf("globex's first consumer over RLS: %+v", d)
	}
}

// TestMaxKeysPerParentShadow: a shadow_mode level over its max_keys_per_parent admits (as
// Envoy RLS answers it OK) and lists its scope in ShadowDenials, without storing the bucket
// beyond the cap or debiting anything at that level; the other levels are charged as usual.
func TestMaxKeysPerParentShadow(t *testing.T) {
	l := perParentLimits(2)
	l.Domains[0].Descriptors[0].Children[0].ShadowMode = true
	e := mustEngine(t, l)
	for i := range 2 {
		if d := e.Acquire(0, consumerReq("acme", fmt.Sprint("c", i))); !d.Admitted || len(d.ShadowDenials) != 0 {
			t.Fatalf("acme consumer %d: %+v", i, d)
		}
	}
	keys := e.Stats().Buckets
	d := e.Acquire(0, consumerReq("acme", "c2"))
	if !d.Admitted || d.Reason != ReasonOK || len(d.ShadowDenials) != 1 || d.ShadowDenials[0] != "consumer" {
		t.Fatalf("acme's third consumer on a shadow level with max_keys_per_parent 2: %+v, want admitted with ShadowDenials [consumer]", d)
	}
	if len(d.Charges) != 1 || d.Charges[0] != "t7/tenant=acme" {
		t.Fatalf("charges %q, want only the tenant's bucket", d.Charges)
	}
	if got := e.Stats().Buckets; got != keys {
		t.Fatalf("stored buckets %d after the shadow admission, want %d (no bucket beyond the cap)", got, keys)
	}
	// Repeated inventions store nothing either.
	for i := 3; i < 20; i++ {
		if d := e.Acquire(0, consumerReq("acme", fmt.Sprint("c", i))); !d.Admitted {
			t.Fatalf("acme consumer %d: %+v", i, d)
		}
	}
	if got := e.Stats().Buckets; got != keys {
		t.Fatalf("stored buckets %d after 17 more inventions, want %d", got, keys)
	}
}

// TestMaxKeysShadow: with the domain's max_keys full, a new bucket of a shadow_mode level is
// not stored and the request is admitted with the level in ShadowDenials (as Envoy RLS
// answers the same descriptor OK, shadow); a new bucket of an enforcing level is still
// refused (too_many_keys). Log entries older than command version 7 (no ShadowMaxKeys) are
// decided as they were: max_keys refuses whatever the mode.
func TestMaxKeysShadow(t *testing.T) {
	l := &Limits{Domains: []Domain{{
		Name:    "t8",
		MaxKeys: 2,
		Descriptors: []Node{{Key: "tenant", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 100},
			Children: []Node{{Key: "consumer", ShadowMode: true, Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1}}}}},
	}}}
	req := func(tenant, consumer string) Request {
		return Request{Domain: "t8", Descriptors: []Entry{{"tenant", tenant}, {"consumer", consumer}}, ShadowMaxKeys: true}
	}
	e := mustEngine(t, l)
	if d := e.Acquire(0, req("acme", "c0")); !d.Admitted || len(d.ShadowDenials) != 0 || len(d.Charges) != 2 {
		t.Fatalf("acme c0: %+v", d)
	}
	if got := e.Stats().Buckets; got != 2 {
		t.Fatalf("%d buckets stored, want 2", got)
	}
	d := e.Acquire(0, req("acme", "c1"))
	if !d.Admitted || d.Reason != ReasonOK || len(d.ShadowDenials) != 1 || d.ShadowDenials[0] != "consumer" ||
		len(d.Charges) != 1 || d.Charges[0] != "t8/tenant=acme" {
		t.Fatalf("a new shadow bucket in a full domain: %+v, want admitted, charged at the tenant only, ShadowDenials [consumer]", d)
	}
	if got := e.Stats().Buckets; got != 2 {
		t.Fatalf("%d buckets stored after the shadow admission, want 2 (max_keys)", got)
	}
	// The same descriptor through Envoy RLS: OK as shadow, nothing stored.
	rd := e.RateLimit(0, rls("t8", ent("tenant", "acme", "consumer", "c2")))
	if rd.Code != RLSOK || !rd.Statuses[0].Shadow {
		t.Fatalf("the same over RLS: %+v, want OK as shadow", rd)
	}
	// An enforcing level's new bucket is still refused by max_keys.
	before := e.Hash()
	d = e.Acquire(0, req("globex", "c0"))
	if d.Admitted || d.Reason != ReasonTooManyKeys || d.Scope != "tenant" || d.Limit != 2 ||
		!strings.Contains(d.Message, `max_keys is 2`) {
		t.Fatalf("a new enforcing bucket in a full domain: %+v, want too_many_keys at tenant", d)
	}
	if e.Hash() != before {
		t.Fatal("a too_many_keys denial changed the state")
	}
	// Room for one more: the enforcing level takes it, the shadow level is skipped.
	l.Domains[0].MaxKeys = 3
	if err := e.SetLimits(0, l); err != nil {
		t.Fatal(err)
	}
	d = e.Acquire(0, req("globex", "c0"))
	if !d.Admitted || len(d.ShadowDenials) != 1 || len(d.Charges) != 1 || d.Charges[0] != "t8/tenant=globex" {
		t.Fatalf("one slot left, enforcing and shadow bucket new: %+v, want the tenant's bucket stored, the consumer shadowed", d)
	}
	// Room for both: the shadow level's bucket is stored and charged as usual.
	l.Domains[0].MaxKeys = 5
	if err := e.SetLimits(0, l); err != nil {
		t.Fatal(err)
	}
	if d = e.Acquire(0, req("initech", "c0")); !d.Admitted || len(d.ShadowDenials) != 0 || len(d.Charges) != 2 {
		t.Fatalf("room for both new buckets: %+v, want both stored and charged", d)
	}

	// An older entry (no ShadowMaxKeys) is decided as before.
	l.Domains[0].MaxKeys = 2
	old := mustEngine(t, l)
	for _, x := range []Request{req("acme", "c0"), req("acme", "c1"), req("acme", "c2")} {
		x.ShadowMaxKeys = false
		d = old.Acquire(0, x)
	}
	if d.Admitted || d.Reason != ReasonTooManyKeys || d.Scope != "consumer" {
		t.Fatalf("without ShadowMaxKeys, a new shadow bucket over max_keys: %+v, want too_many_keys (as older builds)", d)
	}
}
