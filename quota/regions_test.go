package quota

import (
	"strings"
	"testing"
	"time"
)

func TestScopeGlobalNeedsSharesAndFixedPath(t *testing.T) {
	rate := func(scope string) *Rate { return &Rate{Unit: time.Second, RequestsPerUnit: 10, Scope: scope} }
	for _, c := range []struct {
		name string
		d    Domain
		want string
	}{
		{"ok", Domain{Name: "api", Rate: rate(ScopeGlobal), Shares: &Shares{}, Descriptors: []Node{{Key: "route", Value: "a", Rate: rate(ScopeGlobal), Shares: &Shares{}}, {Key: "tenant", Rate: rate(ScopeRegional)}}}, ""},
		{"unknown", Domain{Name: "api", Rate: rate("planet")}, `scope "planet" is not a scope`},
		{"no shares", Domain{Name: "api", Rate: rate(ScopeGlobal)}, "needs a shares block"},
		{"wildcard", Domain{Name: "api", Descriptors: []Node{{Key: "route", Value: "a*", Rate: rate(ScopeGlobal), Shares: &Shares{}}}}, "needs a fixed path"},
		{"under per-value", Domain{Name: "api", Descriptors: []Node{{Key: "tenant", Children: []Node{{Key: "route", Value: "a", Rate: rate(ScopeGlobal), Shares: &Shares{}}}}}}, "needs a fixed path"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := NewEngine()
			err := e.SetLimits(0, &Limits{Domains: []Domain{c.d}})
			err2 := CheckScopes(&c.d)
			if c.want == "" {
				if err != nil || err2 != nil {
					t.Fatalf("SetLimits: %v, CheckScopes: %v", err, err2)
				}
				if g := e.Limits().GlobalPaths(); len(g) != 2 || g[1].Scope != "route" {
					t.Fatalf("global paths %+v", g)
				}
				return
			}
			for _, err := range []error{err, err2} {
				if err == nil || !strings.Contains(err.Error(), c.want) {
					t.Fatalf("error %v, want one containing %q", err, c.want)
				}
			}
		})
	}
}
