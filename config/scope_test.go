package config

import (
	"strings"
	"testing"

	"github.com/quotad/quotad/quota"
)

func TestParseScope(t *testing.T) {
	src := `
domain: api
rate_limit: {unit: second, requests_per_unit: 1000, scope: global}
shares: {fallback_rate: 100}
descriptors:
  - key: route
    value: orders
    rate_limit: {unit: second, requests_per_unit: 300, scope: global}
    shares: {}
    descriptors:
      - key: tenant
        rate_limit: {unit: second, requests_per_unit: 100}
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 50, scope: regional}
`
	l, err := Parse("limits.yaml", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	d := l.Domains[0]
	if !d.Rate.IsGlobal() || !d.Descriptors[0].Rate.IsGlobal() || d.Descriptors[0].Children[0].Rate.IsGlobal() || d.Descriptors[1].Rate.IsGlobal() {
		t.Fatalf("scopes: domain %q, route %q, route/tenant %q, tenant %q", d.Rate.Scope, d.Descriptors[0].Rate.Scope, d.Descriptors[0].Children[0].Rate.Scope, d.Descriptors[1].Rate.Scope)
	}
	gp := l.GlobalPaths()
	if len(gp) != 2 || gp[0].Domain != "api" || len(gp[0].Entries) != 0 || len(gp[1].Entries) != 1 || gp[1].Entries[0] != (quota.Entry{Key: "route", Value: "orders"}) {
		t.Fatalf("global paths %+v", gp)
	}
	again, err := Parse("formatted", Format(l))
	if err != nil {
		t.Fatalf("formatted limits do not parse: %v\n%s", err, Format(l))
	}
	if again.Domains[0].Rate.Scope != quota.ScopeGlobal || again.Domains[0].Descriptors[1].Rate.Scope != quota.ScopeRegional {
		t.Fatalf("round trip lost scopes:\n%s", Format(l))
	}
}

func TestParseScopeErrors(t *testing.T) {
	for _, c := range []struct{ name, src, want string }{
		{"unknown", `
domain: api
rate_limit: {unit: second, requests_per_unit: 10, scope: planet}
`, `rate_limit.scope: "planet" is not a scope; use global`},
		{"no shares", `
domain: api
rate_limit: {unit: second, requests_per_unit: 10, scope: global}
`, "scope global needs a shares block"},
		{"per value", `
domain: api
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 10, scope: global}
    shares: {}
`, "scope global needs a fixed path"},
		{"under a per-value level", `
domain: api
descriptors:
  - key: tenant
    descriptors:
      - key: route
        value: orders
        rate_limit: {unit: second, requests_per_unit: 10, scope: global}
        shares: {}
`, "scope global needs a fixed path"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse("limits.yaml", []byte(c.src))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want one containing %q", err, c.want)
			}
		})
	}
}

// TestScopeErrorLine: a scope: global level without shares is reported at its own scope line
// and key path, not at the domain's line (user trial: "limits.yaml:1: rate_limit.scope" for a
// descriptor on line 6).
func TestScopeErrorLine(t *testing.T) {
	src := `domain: api
rate_limit: {unit: second, requests_per_unit: 100}
descriptors:
  - key: route
    value: orders
    rate_limit: {unit: second, requests_per_unit: 10, scope: global}
`
	_, err := Parse("limits.yaml", []byte(src))
	want := `limits.yaml:6: descriptors[0].rate_limit.scope: domain "api": descriptor route=orders: rate_limit.scope global needs a shares block`
	if err == nil || !strings.HasPrefix(err.Error(), want) {
		t.Fatalf("error %v, want one starting %q", err, want)
	}
	// The domain level's own scope keeps pointing at its line.
	_, err = Parse("limits.yaml", []byte("\ndomain: api\nrate_limit: {unit: second, requests_per_unit: 10, scope: global}\n"))
	if want := `limits.yaml:3: rate_limit.scope: domain "api": rate_limit.scope global needs a shares block`; err == nil || !strings.HasPrefix(err.Error(), want) {
		t.Fatalf("error %v, want one starting %q", err, want)
	}
}
