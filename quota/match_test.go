package quota

import (
	"testing"
	"time"
)

func perMinute(n uint64) *Rate { return &Rate{Unit: time.Minute, RequestsPerUnit: n} }

// matchLimits has every kind of child under one key, in an order that matters for wildcards.
func matchLimits() *Limits {
	return &Limits{Domains: []Domain{{Name: "d", Descriptors: []Node{
		{Key: "path", Value: "files/special", Rate: perMinute(1), Name: "special"},
		{Key: "path", Value: "files/*", Rate: perMinute(2)},
		{Key: "path", Value: "files/a*", Rate: perMinute(3)}, // after files/*: never reached
		{Key: "path", Value: "*", Rate: perMinute(4)},
		{Key: "path", Value: "a*b", Rate: perMinute(5)}, // '*' not last: literal
		{Key: "tenant", Rate: perMinute(100), Children: []Node{
			{Key: "user", Rate: perMinute(10)},
			{Key: "group", Children: []Node{{Key: "x", Rate: perMinute(7)}}},
			{Key: "free", Unlimited: true},
			{Key: "banned", Rate: &Rate{Unit: time.Minute}},
		}},
	}}}}
}

func TestMatcherPickOrder(t *testing.T) {
	m, err := NewMatcher(matchLimits())
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		value string
		rpu   uint64 // 0: no match
	}{
		{"files/special", 1},   // exact beats every wildcard
		{"files/x", 2},         // first wildcard in configuration order
		{"files/abc", 2},       // files/a* comes after files/*: never chosen
		{"files/", 2},          // the empty rest matches
		{"other", 4},           // * matches everything
		{"", 4},                // even the empty value
		{"a*b", 5},             // a '*' inside a value is literal: exact match
		{"axxb", 4},            // ... so it is not a pattern
		{"files/special/x", 2}, // exact means exact
	}
	for _, tt := range tests {
		nodes, ok := m.Path("d", []Entry{{"path", tt.value}})
		if !ok {
			t.Fatal("domain d unknown")
		}
		got := uint64(0)
		if len(nodes) == 1 {
			got = nodes[0].Rate.RequestsPerUnit
		}
		if got != tt.rpu {
			t.Errorf("path=%q matched the %d/min node, want %d/min", tt.value, got, tt.rpu)
		}
		if r := m.Rule("d", []Entry{{"path", tt.value}}); r == nil || r.Rate.RequestsPerUnit != tt.rpu {
			t.Errorf("Rule(path=%q) = %+v, want the %d/min node", tt.value, r, tt.rpu)
		}
	}
}

func TestMatcherNativePathVersusEnvoyRule(t *testing.T) {
	m, err := NewMatcher(matchLimits())
	if err != nil {
		t.Fatal(err)
	}
	e := func(kv ...string) []Entry {
		var out []Entry
		for i := 0; i < len(kv); i += 2 {
			out = append(out, Entry{kv[i], kv[i+1]})
		}
		return out
	}
	tests := []struct {
		name    string
		entries []Entry
		path    int    // nodes on the native path
		rule    uint64 // rpu of the Envoy rule; 0: none
		ruleKey string
	}{
		{"ancestor only", e("tenant", "acme"), 1, 100, "d.tenant"},
		{"last entry wins", e("tenant", "acme", "user", "u1"), 2, 10, "d.tenant.user"},
		{"deeper than config", e("tenant", "acme", "user", "u1", "extra", "1"), 2, 0, ""},
		{"no limit at the last node", e("tenant", "acme", "group", "g"), 2, 0, ""},
		{"below a node without limit", e("tenant", "acme", "group", "g", "x", "1"), 3, 7, "d.tenant.group.x"},
		{"unmatched middle", e("tenant", "acme", "nope", "1", "user", "u"), 1, 0, ""},
		{"unknown first key", e("nope", "1"), 0, 0, ""},
		{"wildcard key keeps its pattern", e("path", "files/q"), 1, 2, "d.path_files/*"},
		{"exact value", e("path", "files/special"), 1, 1, "d.path_files/special"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			nodes, _ := m.Path("d", tt.entries)
			if len(nodes) != tt.path {
				t.Errorf("native path has %d nodes, want %d", len(nodes), tt.path)
			}
			r := m.Rule("d", tt.entries)
			got := uint64(0)
			if r != nil {
				got = r.Rate.RequestsPerUnit
			}
			if got != tt.rule {
				t.Errorf("Envoy rule is %d/min, want %d/min", got, tt.rule)
			}
			if k := m.RuleKey("d", tt.entries); k != tt.ruleKey {
				t.Errorf("RuleKey = %q, want %q", k, tt.ruleKey)
			}
		})
	}
	if r := m.Rule("d", e("tenant", "a", "free", "x")); r == nil || !r.Unlimited {
		t.Errorf("an unlimited node is a rule (Envoy: unlimited limit), got %+v", r)
	}
	if r := m.Rule("d", e("tenant", "a", "banned", "x")); r == nil || r.Rate.RequestsPerUnit != 0 {
		t.Errorf("a blocking node (requests_per_unit 0) is a rule, got %+v", r)
	}
	if r := m.Rule("nope", e("tenant", "a")); r != nil {
		t.Errorf("unknown domain matched %+v", r)
	}
	if _, ok := m.Path("nope", nil); ok {
		t.Error("Path of an unknown domain is ok")
	}
}

func TestMatcherMetricKeys(t *testing.T) {
	l := &Limits{Domains: []Domain{{Name: "d", Descriptors: []Node{
		{Key: "a", ValueToMetric: true, Children: []Node{{Key: "b", Rate: perMinute(1)}}},
		{Key: "c", Children: []Node{{Key: "e", Rate: perMinute(1), DetailedMetric: true}}},
		{Key: "f", Value: "x*", ShareThreshold: true, ValueToMetric: true, Rate: perMinute(1)},
	}}}}
	m, err := NewMatcher(l)
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		entries []Entry
		want    string
	}{
		{[]Entry{{"a", "1"}, {"b", "2"}}, "d.a_1.b"},   // value_to_metric on a
		{[]Entry{{"c", "1"}, {"e", "2"}}, "d.c_1.e_2"}, // detailed_metric on the rule
		{[]Entry{{"f", "xyz"}}, "d.f_x*"},              // share_threshold keeps the pattern
	} {
		if got := m.RuleKey("d", tt.entries); got != tt.want {
			t.Errorf("RuleKey(%v) = %q, want %q", tt.entries, got, tt.want)
		}
	}
}

func TestCompileRejectsWildcardMistakes(t *testing.T) {
	for name, l := range map[string]*Limits{
		"duplicate wildcard": {Domains: []Domain{{Name: "d", Descriptors: []Node{
			{Key: "k", Value: "a*"}, {Key: "k", Value: "a*"}}}}},
		"share_threshold without wildcard": {Domains: []Domain{{Name: "d", Descriptors: []Node{
			{Key: "k", Value: "a", ShareThreshold: true}}}}},
	} {
		if _, err := NewMatcher(l); err == nil {
			t.Errorf("%s: compiled", name)
		}
	}
}
