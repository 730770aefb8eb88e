package config

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/quota"
)

func mustParseFile(t *testing.T, path string) *quota.Limits {
	t.Helper()
	l, err := LoadFile(path)
	if err != nil {
		t.Fatalf("LoadFile(%s): %v", path, err)
	}
	return l
}

func perSecond(n uint64) *quota.Rate {
	return &quota.Rate{Unit: time.Second, RequestsPerUnit: n} // burst left out: stored as 0
}

func TestParseValid(t *testing.T) {
	minute := func(n uint64) *quota.Rate { return &quota.Rate{Unit: time.Minute, RequestsPerUnit: n} }
	tests := []struct {
		file string
		want *quota.Limits
	}{
		{"seed002_platform.yaml", &quota.Limits{Domains: []quota.Domain{{
			Name: "platform",
			Descriptors: []quota.Node{{
				Key:      "tenant",
				Rate:     minute(5000),
				Children: []quota.Node{{Key: "consumer", Rate: minute(600)}},
			}},
		}}}},
		{"seed000_provider.yaml", &quota.Limits{Domains: []quota.Domain{{
			Name:        "provider",
			Rate:        perSecond(100),
			Concurrency: &quota.Concurrency{MaxInFlight: 64, LeaseTTL: 30 * time.Second},
			Descriptors: []quota.Node{
				{
					Key: "endpoint", Value: "charges",
					Rate:        &quota.Rate{Unit: time.Second, RequestsPerUnit: 20, Burst: 10},
					Concurrency: &quota.Concurrency{MaxInFlight: 8, LeaseTTL: time.Minute},
					Children: []quota.Node{{
						Key:         "tenant",
						Rate:        perSecond(5),
						Concurrency: &quota.Concurrency{MaxInFlight: 2, LeaseTTL: DefaultLeaseTTL},
					}},
				},
				{
					Key:  "endpoint",
					Rate: &quota.Rate{Unit: time.Second, RequestsPerUnit: 50, Burst: 100},
					Children: []quota.Node{
						{Key: "tenant", Weight: 1, Rate: perSecond(10)},
						{Key: "tenant", Value: "big-customer", Weight: 4, Rate: perSecond(40)},
					},
				},
			},
		}}}},
		{"multi_doc.yaml", &quota.Limits{Domains: []quota.Domain{
			{Name: "alpha", Descriptors: []quota.Node{{Key: "user", Rate: perSecond(10)}}},
			{Name: "zeta", Rate: perSecond(10), Descriptors: []quota.Node{{
				Key: "user", Rate: &quota.Rate{Unit: time.Second, RequestsPerUnit: 10, Burst: 20},
			}}},
		}}},
		{"descriptor_name_replaces.yaml", &quota.Limits{Domains: []quota.Domain{{
			Name:        "openai",
			Rate:        &quota.Rate{Unit: time.Second, RequestsPerUnit: 100, Burst: 200},
			Concurrency: &quota.Concurrency{MaxInFlight: 50, LeaseTTL: 30 * time.Second},
			Descriptors: []quota.Node{
				{
					Key: "endpoint", Value: "chat",
					Rate:        &quota.Rate{Unit: time.Minute, RequestsPerUnit: 600, Burst: 50},
					Name:        "chat-limit",
					Replaces:    []string{"other-limit"},
					Weight:      2,
					Concurrency: &quota.Concurrency{MaxInFlight: 10, LeaseTTL: 30 * time.Second},
					Children:    []quota.Node{{Key: "tenant", Rate: minute(60)}},
				},
				{Key: "endpoint", Name: "other-limit"},
			},
		}}}},
		{"fair_sharing.yaml", &quota.Limits{Domains: []quota.Domain{{
			Name:         "provider",
			Rate:         perSecond(100),
			Adaptive:     &quota.Adaptive{Floor: 20, DecreasePercent: 70, Increase: 2, StableWindow: 5 * time.Second},
			RetryBudget:  &quota.RetryBudget{RatioPercent: 10, MinPerSecond: 1},
			ResumeJitter: 2 * time.Second,
			WorkClasses:  []quota.WorkClass{{Name: "interactive", ReservePercent: 10}, {Name: "repair", ReservePercent: 5}, {Name: "backfill"}},
			Descriptors: []quota.Node{
				{Key: "endpoint", Value: "charges", Rate: perSecond(20),
					Adaptive: &quota.Adaptive{Floor: 2, DecreasePercent: DefaultDecreasePercent, Increase: DefaultIncrease, StableWindow: DefaultStableWindow}},
				{Key: "endpoint"},
			},
		}}}},
		{"empty.yaml", &quota.Limits{}},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			got := mustParseFile(t, filepath.Join("testdata/valid", tt.file))
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got  %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestParseEnvoyFeatures(t *testing.T) {
	l := mustParseFile(t, "testdata/valid/envoy_basic.yaml")
	if len(l.Domains) != 1 || l.Domains[0].Name != "test-domain" {
		t.Fatalf("domains: %+v", l.Domains)
	}
	ds := l.Domains[0].Descriptors
	byKey := func(key, value string) quota.Node {
		t.Helper()
		for _, d := range ds {
			if d.Key == key && d.Value == value {
				return d
			}
		}
		t.Fatalf("no descriptor %s=%s", key, value)
		return quota.Node{}
	}
	if got := ds[0].Children[1].Rate; !reflect.DeepEqual(got, perSecond(10)) {
		t.Errorf("unit SECOND (case-insensitive): got %+v", got)
	}
	if got := byKey("key2", "").Rate; got.Unit != 5*time.Minute || got.RequestsPerUnit != 20 || got.Burst != 0 {
		t.Errorf("unit_multiplier: got %+v", got)
	}
	if got := byKey("key2", ""); got.Name != "default-key2" {
		t.Errorf("name inside rate_limit: got %q", got.Name)
	}
	v2 := byKey("key2", "value2")
	if !v2.ShadowMode || !reflect.DeepEqual(v2.Replaces, []string{"default-key2"}) || v2.Rate.Unit != time.Hour {
		t.Errorf("key2=value2: %+v", v2)
	}
	if v3 := byKey("key2", "value3"); v3.Rate != nil || v3.Unlimited {
		t.Errorf("a level without rate_limit only groups: %+v", v3)
	}
	if k := byKey("key3", ""); !k.Unlimited || k.Rate != nil {
		t.Errorf("rate_limit.unlimited: %+v", k)
	}
	if k := byKey("key4", ""); !k.Unlimited || k.Rate != nil {
		t.Errorf("descriptor-level unlimited: %+v", k)
	}
	for key, unit := range map[string]time.Duration{"key5": 7 * 24 * time.Hour, "key6": 30 * 24 * time.Hour, "key7": 365 * 24 * time.Hour} {
		if got := byKey(key, "").Rate.Unit; got != unit {
			t.Errorf("%s: unit %v, want %v", key, got, unit)
		}
	}
	if k := byKey("key8", "200"); k.Rate.Unit != 24*time.Hour {
		t.Errorf("numeric value: %+v", k)
	}
}

// TestParseEnvoyCases: one fixture per envoyproxy/ratelimit feature quotad accepts with its
// meaning (the differential test in e2e/ loads the same files with envoy's own loader).
func TestParseEnvoyCases(t *testing.T) {
	rate := func(unit time.Duration, n uint64) *quota.Rate {
		return &quota.Rate{Unit: unit, RequestsPerUnit: n}
	}
	blocked := &quota.Rate{Unit: time.Second}
	dom := func(ds ...quota.Node) *quota.Limits {
		return &quota.Limits{Domains: []quota.Domain{{Name: "test-domain", Descriptors: ds}}}
	}
	tests := []struct {
		file string
		want *quota.Limits
	}{
		{"envoy_block_zero.yaml", dom(quota.Node{Key: "key1", Rate: blocked})},
		{"envoy_block_absent.yaml", dom(quota.Node{Key: "key1", Rate: blocked})},
		{"envoy_wildcard.yaml", dom(
			quota.Node{Key: "path", Value: "/api/*", Rate: rate(time.Second, 5)},
			quota.Node{Key: "path", Value: "/api/health", Rate: rate(time.Second, 100)},
			quota.Node{Key: "path", Value: "*", Rate: rate(time.Second, 1)},
			quota.Node{Key: "path", Value: "a*b", Rate: rate(time.Second, 2)})},
		{"envoy_share_threshold.yaml", dom(quota.Node{Key: "files", Value: "files/*", ShareThreshold: true, Rate: rate(time.Hour, 10)})},
		{"envoy_metrics.yaml", dom(quota.Node{Key: "route", ValueToMetric: true, Children: []quota.Node{
			{Key: "user", DetailedMetric: true, Rate: rate(time.Minute, 60)}}})},
		{"envoy_quota_mode.yaml", dom(quota.Node{Key: "tenant", QuotaMode: true, Rate: rate(24*time.Hour, 10000)})},
		{"envoy_unlimited_rpu.yaml", dom(quota.Node{Key: "internal", Unlimited: true})},
		{"envoy_yaml11_bools.yaml", dom(quota.Node{Key: "key1", ShadowMode: true, Rate: rate(time.Second, 1)})},
		{"envoy_domain_rate_limit.yaml", &quota.Limits{Domains: []quota.Domain{{Name: "test-domain",
			Rate: rate(time.Second, 1000), Descriptors: []quota.Node{{Key: "key1", Rate: rate(time.Second, 10)}}}}}},
		{"quotad_unit_multiplier.yaml", dom(quota.Node{Key: "key1", Rate: rate(5*time.Minute, 20)})},
		{"quotad_max_keys_per_parent.yaml", &quota.Limits{Domains: []quota.Domain{{Name: "test-domain", MaxKeys: 1000,
			Descriptors: []quota.Node{{Key: "tenant", Children: []quota.Node{{Key: "consumer", Rate: rate(time.Second, 5), MaxKeysPerParent: 50}}}}}}}},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			got := mustParseFile(t, filepath.Join("testdata/valid", tt.file))
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got  %+v\nwant %+v", got, tt.want)
			}
			if _, err := quota.NewMatcher(got); err != nil {
				t.Errorf("the engine refuses what the parser accepted: %v", err)
			}
			again, err := Parse("formatted", Format(got))
			if err != nil || !reflect.DeepEqual(again, got) {
				t.Errorf("Format round trip: %v\n%s", err, Format(got))
			}
		})
	}
}

// TestParseInvalid checks one fixture per kind of error: the message names the file, line and
// key path, quotes the value, and says what to do. Each fixture must produce exactly the
// listed errors, in line order; " … " separates parts of one expected message.
func TestParseInvalid(t *testing.T) {
	tests := []struct {
		file string
		want []string
	}{
		{"unknown_key.yaml", []string{`unknown_key.yaml:4: descriptors[0].rate_limt: unknown key "rate_limt"; did you mean "rate_limit"? allowed here: key, value,`}},
		{"unknown_key_nested.yaml", []string{`unknown_key_nested.yaml:9: descriptors[0].descriptors[1].rate_limit.requests_per_units: unknown key "requests_per_units"; did you mean "requests_per_unit"?`}},
		{"domain_unlimited.yaml", []string{
			`domain_unlimited.yaml:2: rate_limit.unlimited: unknown key "unlimited"; allowed here: unit, requests_per_unit, unit_multiplier, burst`,
			`domain_unlimited.yaml:2: rate_limit: needs unit and requests_per_unit`,
		}},
		{"missing_domain.yaml", []string{`missing_domain.yaml:1: domain: missing; start the document with the domain it limits, e.g. domain: provider`}},
		{"empty_domain.yaml", []string{`empty_domain.yaml:1: domain: "" is empty; name the domain`}},
		{"duplicate_domain.yaml", []string{`duplicate_domain.yaml:8: domain: "test-domain" is already defined at duplicate_domain.yaml:1; each domain may appear once`}},
		{"not_a_mapping.yaml", []string{`not_a_mapping.yaml:1: a limits document must be a mapping that starts with domain: NAME, not a list`}},
		{"syntax_error.yaml", []string{`syntax_error.yaml:3: invalid YAML: did not find expected ',' or '}'; fix the syntax`}},
		{"missing_key.yaml", []string{`missing_key.yaml:3: descriptors[0].key: missing; every descriptor needs a key, e.g. key: tenant`}},
		{"empty_key.yaml", []string{`empty_key.yaml:5: descriptors[0].descriptors[0].key: "" is empty; every descriptor needs a key`}},
		{"duplicate_descriptor.yaml", []string{`duplicate_descriptor.yaml:8: descriptors[2]: key "endpoint" with value "chat" is already defined at line 3 under the same parent; merge the two entries or remove one`}},
		{"duplicate_yaml_key.yaml", []string{`duplicate_yaml_key.yaml:5: descriptors[0].key: key "key" is given twice in this mapping (first at line 3); keep one`}},
		{"non_map_list.yaml", []string{
			`non_map_list.yaml:3: descriptors[0]: expected a descriptor mapping (key: ..., rate_limit: ...), got "a"`,
			`non_map_list.yaml:4: descriptors[1]: expected a descriptor mapping`,
		}},
		{"descriptors_not_list.yaml", []string{`descriptors_not_list.yaml:3: descriptors: expected a list of descriptors (lines starting with "- key:"), got a mapping`}},
		{"non_string_key.yaml", []string{`non_string_key.yaml:4: descriptors[0]: a key must be a plain name, not a list`}},
		{"too_deep.yaml", []string{`too_deep.yaml:67: descriptors[0].descriptors[0]. … .descriptors: descriptors are nested more than 32 levels deep; flatten the tree`}},
		{"bad_unit.yaml", []string{`bad_unit.yaml:5: descriptors[0].rate_limit.unit: "minutes" is not a unit; use second, minute, hour, day, week, month or year`}},
		{"missing_unit.yaml", []string{`missing_unit.yaml:5: descriptors[0].rate_limit.unit: missing; add unit: second, minute,`}},
		{"empty_rate_limit.yaml", []string{`empty_rate_limit.yaml:4: descriptors[0].rate_limit: needs unit and requests_per_unit, e.g. {unit: second, requests_per_unit: 10} (or unlimited: true)`}},
		{"rate_limit_not_mapping.yaml", []string{`rate_limit_not_mapping.yaml:2: rate_limit: expected a mapping like {unit: second, requests_per_unit: 10}, got "100/s"`}},
		{"negative_requests_per_unit.yaml", []string{`negative_requests_per_unit.yaml:2: rate_limit.requests_per_unit: -5 is negative; use a whole number of at least 1`}},
		{"string_number.yaml", []string{`string_number.yaml:6: descriptors[0].rate_limit.requests_per_unit: "100" is a string; write the number without quotes`}},
		{"float_number.yaml", []string{`float_number.yaml:4: descriptors[0].rate_limit.requests_per_unit: 2.5 is not a whole number`}},
		{"too_large.yaml", []string{`too_large.yaml:4: descriptors[0].rate_limit.requests_per_unit: 99999999999999999999 is too large; use at most 1000000000000`}},
		{"mapping_for_number.yaml", []string{`mapping_for_number.yaml:4: descriptors[0].weight: expected a whole number, got a mapping`}},
		{"negative_burst.yaml", []string{`negative_burst.yaml:4: descriptors[0].rate_limit.burst: -1 is negative; use a whole number of at least 1`}},
		{"zero_burst.yaml", []string{`zero_burst.yaml:4: descriptors[0].rate_limit.burst: 0 is not allowed; use at least 1; omit burst for one unit's worth`}},
		{"zero_unit_multiplier.yaml", []string{`zero_unit_multiplier.yaml:7: descriptors[0].rate_limit.unit_multiplier: 0 is not allowed; use at least 1`}},
		{"unlimited_with_unit.yaml", []string{`unlimited_with_unit.yaml:6: descriptors[0].rate_limit.unit: cannot be combined with unlimited: true (line 5); remove unit or set unlimited: false`}},
		{"unlimited_with_rate_limit.yaml", []string{`unlimited_with_rate_limit.yaml:5: descriptors[0].unlimited: true cannot be combined with a rate_limit (line 4); remove one`}},
		{"unlimited_twice.yaml", []string{`unlimited_twice.yaml:5: descriptors[0].unlimited: is set both here and in rate_limit (line 4); keep one`}},
		{"name_twice.yaml", []string{`name_twice.yaml:4: descriptors[0].name: is set both here and in rate_limit (line 5); keep one`}},
		{"replaces_empty.yaml", []string{`replaces_empty.yaml:8: descriptors[0].rate_limit.replaces[0].name: "" is empty; name the limit this one replaces`}},
		{"replaces_self.yaml", []string{`replaces_self.yaml:9: descriptors[0].descriptors[0].rate_limit.replaces: names this limit's own name "self"; a limit cannot replace itself`}},
		{"replaces_not_list.yaml", []string{`replaces_not_list.yaml:4: descriptors[0].replaces: expected a list like [{name: other-limit}], got "other-limit"`}},
		{"bad_bool.yaml", []string{`bad_bool.yaml:4: descriptors[0].shadow_mode: "yes" is not a boolean; use true or false`}},
		{"zero_weight.yaml", []string{`zero_weight.yaml:4: descriptors[0].weight: 0 is not allowed; use at least 1`}},
		{"zero_max_in_flight.yaml", []string{`zero_max_in_flight.yaml:4: descriptors[0].concurrency.max_in_flight: 0 is not allowed; use at least 1`}},
		{"missing_max_in_flight.yaml", []string{`missing_max_in_flight.yaml:3: concurrency.max_in_flight: missing; add max_in_flight: N`}},
		{"bad_lease_ttl.yaml", []string{`bad_lease_ttl.yaml:4: descriptors[0].concurrency.lease_ttl: "thirty" is not a duration; use a Go duration such as "30s" or "2m"`}},
		{"bare_number_lease_ttl.yaml", []string{`bare_number_lease_ttl.yaml:2: concurrency.lease_ttl: "30" is not a duration (a bare number has no unit)`}},
		{"nonpositive_lease_ttl.yaml", []string{`nonpositive_lease_ttl.yaml:2: concurrency.lease_ttl: "0s" is not positive; use a duration above zero`}},
		{"work_classes_over_100.yaml", []string{`work_classes_over_100.yaml:2: work_classes: the reserves add up to 110%; they must total at most 100%`}},
		{"work_class_twice.yaml", []string{`work_class_twice.yaml:4: work_classes[1].name: "interactive" is already defined at line 3; each work class may appear once`}},
		{"work_class_missing_name.yaml", []string{`work_class_missing_name.yaml:3: work_classes[0].name: missing; name the class`}},
		{"work_class_reserve_too_large.yaml", []string{`work_class_reserve_too_large.yaml:3: work_classes[0].reserve_percent: 101 is too large; use at most 100`}},
		{"retry_budget_nothing.yaml", []string{`retry_budget_nothing.yaml:2: retry_budget: ratio_percent 0 and no min_per_second admit no retry at all`}},
		{"retry_budget_missing_ratio.yaml", []string{`retry_budget_missing_ratio.yaml:2: retry_budget.ratio_percent: missing; add ratio_percent: N`}},
		{"retry_budget_ratio_too_large.yaml", []string{`retry_budget_ratio_too_large.yaml:2: retry_budget.ratio_percent: 150 is too large; use at most 100`}},
		{"adaptive_without_rate.yaml", []string{`adaptive_without_rate.yaml:4: descriptors[0].adaptive: needs a rate_limit on the same level`}},
		{"adaptive_floor_above_rate.yaml", []string{`adaptive_floor_above_rate.yaml:3: adaptive.floor: 200 is above this level's requests_per_unit 100, which is the ceiling`}},
		{"adaptive_missing_floor.yaml", []string{`adaptive_missing_floor.yaml:3: adaptive.floor: missing; add floor: N`}},
		{"adaptive_decrease_100.yaml", []string{`adaptive_decrease_100.yaml:3: adaptive.decrease_percent: 100 is too large; use at most 99`}},
		{"adaptive_increase_above_rate.yaml", []string{`adaptive_increase_above_rate.yaml:5: descriptors[0].adaptive.increase: 20 is above this level's requests_per_unit 10`}},
		{"adaptive_bad_window.yaml", []string{`adaptive_bad_window.yaml:3: adaptive.stable_window: "5" is not a duration (a bare number has no unit)`}},
		{"resume_jitter_too_long.yaml", []string{`resume_jitter_too_long.yaml:2: resume_jitter: "2h" is longer than 1h0m0s`}},
		{"max_pause_too_long.yaml", []string{`max_pause_too_long.yaml:2: max_pause: "48h" is longer than 24h0m0s`}},
		{"envoy_metadata.yaml", []string{`envoy_metadata.yaml:5: descriptors[0].metadata: unknown key "metadata"`}},
		{"share_threshold_not_wildcard.yaml", []string{`share_threshold_not_wildcard.yaml:5: descriptors[0].share_threshold: needs a wildcard value (ending in *, e.g. value: files/*), not "files"`}},
		{"zero_rpu_burst.yaml", []string{`zero_rpu_burst.yaml:4: descriptors[0].rate_limit.burst: cannot be combined with requests_per_unit 0, which blocks every request`}},
		{"max_keys_zero.yaml", []string{`max_keys_zero.yaml:2: max_keys: 0 is not allowed; use at least 1; it caps the buckets the domain holds at once (default 100000)`}},
		{"max_keys_too_large.yaml", []string{`max_keys_too_large.yaml:2: max_keys: 2000000000 is too large; use at most 1073741824`}},
		{"max_keys_per_parent_exact.yaml", []string{`max_keys_per_parent_exact.yaml:5: descriptors[0].max_keys_per_parent: is set on a level with value "acme", which is one bucket`}},
		{"max_keys_per_parent_no_rate.yaml", []string{`max_keys_per_parent_no_rate.yaml:6: descriptors[0].descriptors[0].max_keys_per_parent: needs a rate_limit on its level`}},
		{"max_keys_per_parent_zero.yaml", []string{`max_keys_per_parent_zero.yaml:5: descriptors[0].max_keys_per_parent: 0 is not allowed; use at least 1; it caps this level's buckets under one value of its parent`}},
		{"many_errors.yaml", []string{
			`many_errors.yaml:5: descriptors[0].rate_limit.unit: "seconds" is not a unit`,
			`many_errors.yaml:7: descriptors[1].rate_limit.burst: cannot be combined with requests_per_unit 0`,
			`many_errors.yaml:9: descriptors[1].descriptors[0].key: "" is empty`,
			`many_errors.yaml:11: descriptors[1].descriptors[1].concurency: unknown key "concurency"; did you mean "concurrency"?`,
		}},
	}
	covered := make(map[string]bool)
	for _, tt := range tests {
		covered[tt.file] = true
		t.Run(tt.file, func(t *testing.T) {
			data, err := os.ReadFile(filepath.Join("testdata/invalid", tt.file))
			if err != nil {
				t.Fatal(err)
			}
			l, err := Parse(tt.file, data)
			if err == nil {
				t.Fatalf("Parse succeeded: %+v", l)
			}
			if l != nil {
				t.Errorf("Parse returned limits with an error")
			}
			errs := splitErrors(err)
			if len(errs) != len(tt.want) {
				t.Fatalf("got %d errors, want %d:\n%v", len(errs), len(tt.want), err)
			}
			for i, want := range tt.want {
				var ce *Error
				if !errors.As(errs[i], &ce) {
					t.Errorf("error %d is %T, not *Error", i, errs[i])
				}
				for _, part := range strings.Split(want, " … ") {
					if !strings.Contains(errs[i].Error(), part) {
						t.Errorf("error %d:\n got  %s\n want it to contain %s", i, errs[i], part)
					}
				}
			}
		})
	}
	files, _ := filepath.Glob("testdata/invalid/*.yaml")
	for _, f := range files {
		if !covered[filepath.Base(f)] {
			t.Errorf("fixture %s has no entry in the table", f)
		}
	}
}

func splitErrors(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

func TestLoadFiles(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	a := write("a.yaml", "domain: b\n---\ndomain: a\n")
	c := write("c.yml", "# comment\ndomain: c\n")
	write("notes.txt", "domain: ignored\n")

	l, err := LoadFiles(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, d := range l.Domains {
		names = append(names, d.Name)
	}
	if !reflect.DeepEqual(names, []string{"a", "b", "c"}) {
		t.Errorf("domains %v, want sorted a b c", names)
	}

	dup := write("dup.yaml", "\n\ndomain: a\n")
	_, err = LoadFiles(a, c, dup)
	if err == nil || !strings.Contains(err.Error(), dup+`:3: domain: "a" is already defined at `+a+":3;") {
		t.Errorf("duplicate across files: %v", err)
	}

	_, err = LoadFile(filepath.Join(dir, "missing.yaml"))
	if err == nil || !strings.Contains(err.Error(), "missing.yaml") {
		t.Errorf("missing file: %v", err)
	}
}

func TestMerge(t *testing.T) {
	a := &quota.Limits{Domains: []quota.Domain{{Name: "z"}, {Name: "x"}}}
	b := &quota.Limits{Domains: []quota.Domain{{Name: "y"}}}
	got, err := Merge(a, nil, b)
	if err != nil {
		t.Fatal(err)
	}
	want := &quota.Limits{Domains: []quota.Domain{{Name: "x"}, {Name: "y"}, {Name: "z"}}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Merge = %+v", got)
	}
	_, err = Merge(a, b, &quota.Limits{Domains: []quota.Domain{{Name: "x"}}})
	if err == nil || err.Error() != `domain: "x" is already defined at input 1; each domain may appear once, so merge the two documents or rename one` {
		t.Errorf("Merge duplicate: %v", err)
	}
}

// TestExample keeps examples/limits.yaml (make run, the README tour) valid and as described.
func TestExample(t *testing.T) {
	l := mustParseFile(t, "../examples/limits.yaml")
	if len(l.Domains) != 2 || l.Domains[0].Name != "platform" || l.Domains[1].Name != "provider" {
		t.Fatalf("domains: %+v", l.Domains)
	}
	provider := l.Domains[1]
	if !reflect.DeepEqual(provider.Rate, &quota.Rate{Unit: time.Second, RequestsPerUnit: 100, Burst: 100}) { // written out
		t.Errorf("provider ceiling %+v", provider.Rate)
	}
	charges := provider.Descriptors[0]
	if charges.Key != "endpoint" || charges.Value != "charges" ||
		!reflect.DeepEqual(charges.Rate, &quota.Rate{Unit: time.Minute, RequestsPerUnit: 60, Burst: 10}) ||
		charges.Concurrency != nil {
		t.Errorf("charges (the README tour expects 60/minute, burst 10, no concurrency cap): %+v", charges)
	}
	if reports := provider.Descriptors[1]; reports.Value != "reports" || reports.Concurrency == nil || reports.Concurrency.MaxInFlight != 4 {
		t.Errorf("reports (the README tour expects max_in_flight 4): %+v", reports)
	}
	tenant := charges.Children[0]
	if tenant.Key != "tenant" || tenant.Value != "" || !reflect.DeepEqual(tenant.Rate, perSecond(10)) {
		t.Errorf("tenant: %+v", tenant)
	}
	if c := tenant.Children[0]; c.Key != "consumer" || c.Value != "" || c.Rate == nil {
		t.Errorf("consumer: %+v", c)
	}
	seed := mustParseFile(t, "testdata/valid/seed002_platform.yaml")
	if !reflect.DeepEqual(l.Domains[0], seed.Domains[0]) {
		t.Errorf("example platform domain differs from seed 002:\n%+v\n%+v", l.Domains[0], seed.Domains[0])
	}
}

// TestParseHostileInput: inputs that must produce an error (or nothing), never a panic or a hang.
func TestParseHostileInput(t *testing.T) {
	inputs := map[string]string{
		"recursive alias":  "domain: x\ndescriptors: &a [*a]\n",
		"alias to nothing": "domain: x\ndescriptors: *nope\n",
		"tab indent":       "domain: x\ndescriptors:\n\t- key: a\n",
		"invalid utf8":     "domain: \"\\xff\"\n",
		"binary":           "\x00\x01\x02",
		"only separators":  "---\n---\n...\n",
		"null document":    "~\n",
		"scalar document":  "hello\n",
		"merge of scalar":  "domain: x\n<<: 5\n",
		"merge loop":       "a: &a {<<: *a}\n",
		"null key":         "domain: x\n~: 1\n",
		"deep flow":        "domain: x\ndescriptors: " + strings.Repeat("[", 5000) + strings.Repeat("]", 5000) + "\n",
		"alias bomb": `domain: x
a: &a [{key: k}, {key: k}, {key: k}, {key: k}, {key: k}, {key: k}, {key: k}, {key: k}, {key: k}]
descriptors: &b [{key: k, descriptors: *a}, {key: k, descriptors: *a}]
`,
		"descriptor alias bomb": func() string {
			s := "domain: x\ndescriptors:\n  - &d0 {key: k0}\n"
			for i := 1; i < 25; i++ {
				s += fmt.Sprintf("  - &d%d {key: k%d, descriptors: [*d%d, {key: z, descriptors: [*d%d]}]}\n", i, i, i-1, i-1)
			}
			return s
		}(),
	}
	for name, in := range inputs {
		t.Run(name, func(t *testing.T) {
			done := make(chan struct{})
			go func() {
				defer close(done)
				l, err := Parse("hostile.yaml", []byte(in))
				if err == nil {
					checkRoundTrip(t, l)
				}
			}()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("Parse did not finish within 10s")
			}
		})
	}
}

// TestParseNodeBudgetFollowsWrittenNodes: an alias bomb is refused after a walk proportional to
// the nodes it writes (a megabyte of comment does not buy it more); a large file without
// aliases, with more YAML nodes than the fixed part of the budget, still parses.
func TestParseNodeBudgetFollowsWrittenNodes(t *testing.T) {
	bomb := "domain: x\ndescriptors:\n  - &d0 {key: k0}\n"
	for i := 1; i < 25; i++ {
		bomb += fmt.Sprintf("  - &d%d {key: k%d, descriptors: [*d%d, {key: z, descriptors: [*d%d]}]}\n", i, i, i-1, i-1)
	}
	// A megabyte of comment does not raise the budget: only written nodes do.
	for _, in := range []string{bomb, "#" + strings.Repeat("x", 1<<20) + "\n" + bomb} {
		_, err := Parse("bomb.yaml", []byte(in))
		if err == nil || !strings.Contains(err.Error(), "expands to more than") || strings.Contains(err.Error(), fmt.Sprintf("more than %d", maxNodes)) {
			t.Fatalf("alias bomb (%d bytes): err = %v, want a refusal under a budget below %d", len(in), err, maxNodes)
		}
	}

	var b strings.Builder
	b.WriteString("domain: big\ndescriptors:\n  - key: tenant\n    descriptors: [")
	const n = 20000 // 4 YAML nodes per descriptor plus the mapping: 100k nodes > minNodes
	for i := range n {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, "{key: user, value: u%d}", i)
	}
	b.WriteString("]\n")
	l, err := Parse("big.yaml", []byte(b.String()))
	if err != nil {
		t.Fatalf("a %d-byte file without aliases: %v", b.Len(), err)
	}
	if got := len(l.Domains[0].Descriptors[0].Children); got != n {
		t.Fatalf("parsed %d user descriptors, want %d", got, n)
	}
}
