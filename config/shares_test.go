package config

import (
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/quota"
)

func TestParseShares(t *testing.T) {
	src := `
domain: api
rate_limit: {unit: second, requests_per_unit: 1000, burst: 2000}
shares: {}
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100}
    shares: {lease: 6s, reserve_percent: 20, fallback_rate: 10}
`
	l, err := Parse("limits.yaml", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	d := l.Domains[0]
	if d.Shares == nil || *d.Shares != (quota.Shares{}) {
		t.Fatalf("domain shares %+v, want the defaults", d.Shares)
	}
	s := d.Descriptors[0].Shares
	if s == nil || s.Lease != 6*time.Second || s.ReservePercent != 20 || s.FallbackRate != 10 {
		t.Fatalf("tenant shares %+v", s)
	}
	again, err := Parse("formatted", Format(l))
	if err != nil {
		t.Fatalf("formatted limits do not parse: %v\n%s", err, Format(l))
	}
	if *again.Domains[0].Descriptors[0].Shares != *s || again.Domains[0].Shares == nil {
		t.Fatalf("round trip lost shares:\n%s", Format(l))
	}
}

func TestParseSharesErrors(t *testing.T) {
	for _, c := range []struct{ src, want string }{
		{"domain: a\nshares: {}\n", "shares: needs a rate_limit"},
		{"domain: a\nrate_limit: {unit: second, requests_per_unit: 10}\nshares: {lease: 100ms}\n", "shares.lease: 100ms is out of range"},
		{"domain: a\nrate_limit: {unit: second, requests_per_unit: 10}\nshares: {reserve_percent: 80}\n", "shares.reserve_percent: 80 is too large"},
		{"domain: a\nrate_limit: {unit: second, requests_per_unit: 10}\nshares: {fallback_rate: 11}\n", "shares.fallback_rate: 11 is too large"},
		{"domain: a\nrate_limit: {unit: second, requests_per_unit: 10}\nshares: {leases: 1s}\n", "leases"},
	} {
		_, err := Parse("limits.yaml", []byte(c.src))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: error %v, want one containing %q", c.src, err, c.want)
		}
	}
}
