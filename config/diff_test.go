package config

import (
	"reflect"
	"strings"
	"testing"

	"github.com/quotad/quotad/quota"
)

func parseString(t *testing.T, s string) *quota.Limits {
	t.Helper()
	l, err := Parse("test.yaml", []byte(s))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestDiff(t *testing.T) {
	old := parseString(t, `
domain: provider
rate_limit: {unit: second, requests_per_unit: 100}
descriptors:
  - key: endpoint
    value: charges
    rate_limit: {unit: second, requests_per_unit: 20, burst: 10}
    descriptors:
      - key: tenant
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: endpoint
    value: refunds
    rate_limit: {unit: second, requests_per_unit: 5}
    descriptors:
      - key: tenant
  - key: endpoint
    rate_limit: {unit: second, requests_per_unit: 50}
---
domain: legacy
`)
	new := parseString(t, `
domain: provider
rate_limit: {unit: second, requests_per_unit: 100, burst: 200}
concurrency: {max_in_flight: 50}
descriptors:
  - key: endpoint
    rate_limit: {unit: second, requests_per_unit: 50}
  - key: endpoint
    value: charges
    rate_limit: {unit: minute, requests_per_unit: 20, burst: 10}
    shadow_mode: true
    weight: 3
    descriptors:
      - key: tenant
        rate_limit: {unit: second, requests_per_unit: 10}
        concurrency: {max_in_flight: 2, lease_ttl: 1m}
      - key: consumer
        rate_limit: {unit: minute, requests_per_unit: 600}
        descriptors:
          - key: job
            unlimited: true
---
domain: platform
rate_limit: {unit: minute, requests_per_unit: 6000}
descriptors:
  - key: tenant
    descriptors:
      - key: consumer
`)
	want := []string{
		"- domain legacy",
		"+ domain platform (ceiling 6000/minute burst 6000, 2 descriptor levels)",
		"~ provider: ceiling 100/second burst 100 -> 100/second burst 200",
		"~ provider: concurrency none -> 50 in flight, lease 30s",
		"- provider/endpoint=refunds",
		"- provider/endpoint=refunds/tenant",
		"~ provider/endpoint=charges: rate 20/second burst 10 -> 20/minute burst 10",
		"~ provider/endpoint=charges: shadow_mode false -> true",
		"~ provider/endpoint=charges: weight 1 -> 3",
		"~ provider/endpoint=charges/tenant: concurrency none -> 2 in flight, lease 1m",
		"+ provider/endpoint=charges/consumer (rate 600/minute burst 600)",
		"+ provider/endpoint=charges/consumer/job (unlimited)",
	}
	got := Diff(old, new)
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Diff:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if d := Diff(new, new); len(d) != 0 {
		t.Errorf("Diff(l, l) = %v, want nothing", d)
	}
	if d := Diff(nil, nil); len(d) != 0 {
		t.Errorf("Diff(nil, nil) = %v", d)
	}
	if d := Diff(nil, old); !reflect.DeepEqual(d, []string{"+ domain legacy", "+ domain provider (ceiling 100/second burst 100, 5 descriptor levels)"}) {
		t.Errorf("Diff(nil, old) = %q", d)
	}
	// Only a level's identity (key, value) matters, not its position among its siblings.
	reordered := parseString(t, `
domain: a
descriptors: [{key: x, rate_limit: {unit: second, requests_per_unit: 1}}, {key: y}]
---
domain: b
`)
	swapped := parseString(t, `
domain: b
---
domain: a
descriptors: [{key: y}, {key: x, rate_limit: {unit: second, requests_per_unit: 1}}]
`)
	if d := Diff(reordered, swapped); len(d) != 0 {
		t.Errorf("reordering is not a change, got %v", d)
	}
}

func TestDiffNameReplaces(t *testing.T) {
	old := parseString(t, "domain: d\ndescriptors: [{key: k, name: a}]\n")
	new := parseString(t, "domain: d\ndescriptors: [{key: k, name: b, replaces: [{name: c}], unlimited: true}]\n")
	want := []string{
		`~ d/k: unlimited false -> true`,
		`~ d/k: name "a" -> "b"`,
		`~ d/k: replaces [] -> [c]`,
	}
	if got := Diff(old, new); !reflect.DeepEqual(got, want) {
		t.Errorf("Diff = %q, want %q", got, want)
	}
}

func TestDiffPolicy(t *testing.T) {
	old := parseString(t, `
domain: provider
rate_limit: {unit: second, requests_per_unit: 100}
descriptors:
  - key: endpoint
    rate_limit: {unit: second, requests_per_unit: 10}
`)
	new := parseString(t, `
domain: provider
rate_limit: {unit: second, requests_per_unit: 100}
adaptive: {floor: 20}
retry_budget: {ratio_percent: 10}
work_classes: [{name: interactive, reserve_percent: 10}, {name: backfill}]
resume_jitter: 3s
max_pause: 2m
max_keys: 500
descriptors:
  - key: endpoint
    rate_limit: {unit: second, requests_per_unit: 10}
    adaptive: {floor: 1, decrease_percent: 50, increase: 1, stable_window: 1s}
`)
	want := []string{
		"~ provider: adaptive none -> floor 20, keep 70% on 429, +1 every 5s",
		"~ provider: retry_budget none -> 10% of first attempts, min 0/s",
		"~ provider: work_classes [] -> [interactive 10%, backfill 0%]",
		"~ provider: resume_jitter default -> 3s",
		"~ provider: max_pause default -> 2m",
		"~ provider: max_keys default (100000) -> 500",
		"~ provider/endpoint: adaptive none -> floor 1, keep 50% on 429, +1 every 1s",
	}
	if got := Diff(old, new); !reflect.DeepEqual(got, want) {
		t.Errorf("Diff:\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if got := Diff(new, new); len(got) != 0 {
		t.Errorf("no change reported as %v", got)
	}
}

// A shares block or a scope added, changed or removed is a change: `limits apply --dry-run`
// used to print "no changes" for them (and apply "applied ...: no changes") while the cluster
// started or stopped lending, or moved a level between regional and global.
func TestDiffSharesAndScope(t *testing.T) {
	old := parseString(t, `
domain: api
rate_limit: {unit: second, requests_per_unit: 1000}
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100}
    shares: {lease: 15s}
  - key: route
    value: a
    rate_limit: {unit: second, requests_per_unit: 100, scope: global}
    shares: {}
`)
	new := parseString(t, `
domain: api
rate_limit: {unit: second, requests_per_unit: 1000}
shares: {}
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100}
    shares: {lease: 6s, reserve_percent: 20, fallback_rate: 5}
  - key: route
    value: a
    rate_limit: {unit: second, requests_per_unit: 100, scope: regional}
    shares: {}
  - key: user
    rate_limit: {unit: second, requests_per_unit: 10}
    shares: {}
`)
	want := []string{
		"~ api: shares none -> lease 15s, reserve 10%, fail closed",
		"~ api/tenant: shares lease 15s, reserve 10%, fail closed -> lease 6s, reserve 20%, fallback_rate 5",
		"~ api/route=a: rate 100/second burst 100 scope global -> 100/second burst 100",
		"+ api/user (rate 10/second burst 10, shares lease 15s, reserve 10%, fail closed)",
	}
	if got := Diff(old, new); !reflect.DeepEqual(got, want) {
		t.Errorf("Diff:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	// shares: {} and the defaults spelled out are the same block.
	spelled := parseString(t, "domain: d\nrate_limit: {unit: second, requests_per_unit: 1}\nshares: {lease: 15s, reserve_percent: 10}\n")
	empty := parseString(t, "domain: d\nrate_limit: {unit: second, requests_per_unit: 1}\nshares: {}\n")
	if d := Diff(empty, spelled); len(d) != 0 {
		t.Errorf("defaults spelled out are not a change, got %q", d)
	}
}
