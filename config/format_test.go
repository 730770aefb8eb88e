package config

import (
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/quota"
)

// checkRoundTrip asserts Parse(Format(l)) == l.
func checkRoundTrip(t *testing.T, l *quota.Limits) {
	t.Helper()
	out := Format(l)
	back, err := Parse("formatted.yaml", out)
	if err != nil {
		t.Fatalf("Parse(Format(l)) failed: %v\n%s", err, out)
	}
	if !reflect.DeepEqual(back, l) {
		t.Fatalf("round trip changed the limits:\nbefore %+v\nafter  %+v\n%s", l, back, out)
	}
}

func TestFormatRoundTrip(t *testing.T) {
	files, _ := filepath.Glob("testdata/valid/*.yaml")
	files = append(files, "../examples/limits.yaml")
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			checkRoundTrip(t, mustParseFile(t, f))
		})
	}
}

func TestFormatOutput(t *testing.T) {
	l := &quota.Limits{Version: 7, Domains: []quota.Domain{{
		Name:        "openai",
		Rate:        &quota.Rate{Unit: time.Second, RequestsPerUnit: 100, Burst: 200},
		Concurrency: &quota.Concurrency{MaxInFlight: 50, LeaseTTL: 90 * time.Second},
		Descriptors: []quota.Node{
			{
				Key: "endpoint", Value: "chat",
				Rate:       &quota.Rate{Unit: 5 * time.Minute, RequestsPerUnit: 600},
				Name:       "chat-limit",
				Replaces:   []string{"other"},
				ShadowMode: true,
				Weight:     2,
				Children:   []quota.Node{{Key: "tenant", Value: "200", Unlimited: true}},
			},
			{Key: "endpoint", Name: "other", Concurrency: &quota.Concurrency{MaxInFlight: 1, LeaseTTL: time.Hour}},
		},
	}, {Name: "platform"}}}
	want := `# quotad limits version 7
domain: openai
rate_limit: {unit: second, requests_per_unit: 100, burst: 200}
concurrency: {max_in_flight: 50, lease_ttl: 1m30s}
descriptors:
  - key: endpoint
    value: chat
    rate_limit: {unit: minute, unit_multiplier: 5, requests_per_unit: 600, name: chat-limit, replaces: [{name: other}]}
    shadow_mode: true
    weight: 2
    descriptors:
      - key: tenant
        value: "200"
        rate_limit: {unlimited: true}
  - key: endpoint
    name: other
    concurrency: {max_in_flight: 1, lease_ttl: 1h}
---
domain: platform
`
	if got := string(Format(l)); got != want {
		t.Errorf("Format:\n%s\nwant:\n%s", got, want)
	}
}

func TestFormatQuotesAwkwardStrings(t *testing.T) {
	for _, s := range []string{
		"200", "1.5", "true", "no", "null", "~", "-", "- a", "a: b", "a #b", "#c", "[x]", "{x}", "*a", "&a",
		"!t", "@x", "`x", "'q'", "\"q\"", " lead", "trail ", "line\nbreak", "tab\tx", "\x00nul", "\u2028",
		"ünï", "日本", "<<", "0x10", "1_000", ".inf", "2001-12-14", "%x", "|", ">", "a,b", "?", ":",
	} {
		l := &quota.Limits{Domains: []quota.Domain{{
			Name:        s,
			Descriptors: []quota.Node{{Key: s, Value: s + "v", Name: s, Replaces: []string{s + "r"}}},
		}}}
		checkRoundTrip(t, l)
	}
}

func TestFormatEmpty(t *testing.T) {
	for _, l := range []*quota.Limits{nil, {}} {
		got, err := Parse("empty", Format(l))
		if err != nil || !reflect.DeepEqual(got, &quota.Limits{}) {
			t.Errorf("Format(%v) does not read back as no limits: %+v, %v", l, got, err)
		}
	}
}

func TestUnitName(t *testing.T) {
	tests := []struct {
		d    time.Duration
		name string
		mult uint64
	}{
		{time.Second, "second", 1},
		{90 * time.Second, "second", 90},
		{2 * time.Hour, "hour", 2},
		{48 * time.Hour, "day", 2},
		{14 * 24 * time.Hour, "week", 2},
		{60 * 24 * time.Hour, "month", 2},
		{730 * 24 * time.Hour, "year", 2},
		{1500 * time.Millisecond, "1.5s", 1},
	}
	for _, tt := range tests {
		if name, mult := unitName(tt.d); name != tt.name || mult != tt.mult {
			t.Errorf("unitName(%v) = %s×%d, want %s×%d", tt.d, name, mult, tt.name, tt.mult)
		}
	}
	if !strings.Contains(string(Format(&quota.Limits{Domains: []quota.Domain{{Name: "x", Rate: &quota.Rate{Unit: time.Millisecond, RequestsPerUnit: 1}}}})), "unit: 1ms") {
		t.Error("a sub-second unit is not written as a duration")
	}
}

// TestFormatLeavesDefaultBurstOut: a burst the file left out is left out of the formatted
// limits (what `quotad limits get` prints), so editing only requests_per_unit in that output
// and applying it again gives the new rate's default burst, not the old one; a burst written
// in the file is written back, even when it equals requests_per_unit, and stays as written.
// Either way the output reads back as the same limits.
func TestFormatLeavesDefaultBurstOut(t *testing.T) {
	in := `domain: d
rate_limit: {unit: second, requests_per_unit: 100, burst: 100}
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: user
    rate_limit: {unit: second, requests_per_unit: 5, burst: 50}
`
	l, err := Parse("in.yaml", []byte(in))
	if err != nil {
		t.Fatal(err)
	}
	out := string(Format(l))
	if !strings.Contains(out, "rate_limit: {unit: minute, requests_per_unit: 10}\n") {
		t.Fatalf("the defaulted burst is written out:\n%s", out)
	}
	if !strings.Contains(out, "requests_per_unit: 100, burst: 100}") || !strings.Contains(out, "requests_per_unit: 5, burst: 50}") {
		t.Fatalf("an explicit burst is left out:\n%s", out)
	}
	back, err := Parse("get.yaml", []byte(out))
	if err != nil || !reflect.DeepEqual(back, l) {
		t.Fatalf("the output reads back as %+v (%v), want %+v", back, err, l)
	}
	// The user doubles every rate in the output and applies it.
	edited := strings.NewReplacer("requests_per_unit: 100,", "requests_per_unit: 200,",
		"requests_per_unit: 10}", "requests_per_unit: 20}", "requests_per_unit: 5,", "requests_per_unit: 10,").Replace(out)
	e, err := Parse("edited.yaml", []byte(edited))
	if err != nil {
		t.Fatal(err)
	}
	if got := e.Domains[0].Descriptors[0].Rate.Capacity(); got != 20 {
		t.Errorf("tenant's burst after editing its rate to 20/minute: %d, want 20 (the default follows the rate)", got)
	}
	if got := e.Domains[0].Rate.Capacity(); got != 100 {
		t.Errorf("the ceiling's explicit burst after editing its rate: %d, want 100 as written", got)
	}
	if got := e.Domains[0].Descriptors[1].Rate.Capacity(); got != 50 {
		t.Errorf("user's explicit burst after editing its rate: %d, want 50 as written", got)
	}
}
