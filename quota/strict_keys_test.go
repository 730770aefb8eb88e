package quota

import (
	"strings"
	"testing"
	"time"
)

// TestStrictKeys: in a strict_keys domain a descriptor key not defined where it is sent is
// refused as invalid, naming it (and nothing is debited); an undefined value of a defined key
// still matches nothing; a domain without strict_keys skips the rest of the path as before.
func TestStrictKeys(t *testing.T) {
	tree := []Node{{Key: "endpoint", Value: "charges", Rate: &Rate{Unit: time.Minute, RequestsPerUnit: 60, Burst: 10},
		Children: []Node{{Key: "tenant", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 10}}}}}
	ceiling := &Rate{Unit: time.Second, RequestsPerUnit: 100}
	e := mustEngine(t, &Limits{Domains: []Domain{
		{Name: "strict", StrictKeys: true, Rate: ceiling, Descriptors: tree},
		{Name: "loose", Rate: ceiling, Descriptors: tree},
	}})
	req := func(domain string, kv ...string) Request {
		r := Request{Domain: domain}
		for i := 0; i+1 < len(kv); i += 2 {
			r.Descriptors = append(r.Descriptors, Entry{kv[i], kv[i+1]})
		}
		return r
	}
	for _, tc := range []struct {
		r    Request
		want []string // message words; nil: admitted
	}{
		{req("strict", "endpont", "charges"), []string{`"endpont"`, "entry #0", "top of the domain", `"strict"`, "strict_keys", "endpoint"}},
		{req("strict", "tenant", "acme", "endpoint", "charges"), []string{`"tenant"`, "keys defined there: endpoint"}},
		{req("strict", "endpoint", "charges", "tenantt", "acme"), []string{`"tenantt"`, "entry #1", "after endpoint=charges", "tenant"}},
		{req("strict", "endpoint", "charges", "tenant", "acme", "consumer", "x"), []string{`"consumer"`, "none (the path ends there"}},
		{req("strict", "endpoint", "charges", "tenant", "acme"), nil},
		{req("strict", "endpoint", "other"), nil}, // a defined key with an unconfigured value: matches nothing
		{req("loose", "endpont", "charges"), nil},
	} {
		d := e.Acquire(0, tc.r)
		if tc.want == nil {
			if !d.Admitted {
				t.Errorf("%v: %+v, want admitted", tc.r.Descriptors, d)
			}
			continue
		}
		if d.Admitted || d.Reason != ReasonInvalid {
			t.Errorf("%s %v: %+v, want invalid", tc.r.Domain, tc.r.Descriptors, d)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(d.Message, w) {
				t.Errorf("%v: message %q lacks %q", tc.r.Descriptors, d.Message, w)
			}
		}
	}
	// Refusals debited nothing: the strict ceiling paid for its 2 admissions only.
	st, err := e.Status(0, "strict", nil)
	if err != nil || st[0].Remaining != 98 {
		t.Fatalf("strict ceiling: %+v %v, want 98 remaining", st, err)
	}
}
