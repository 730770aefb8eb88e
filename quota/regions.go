package quota

// Regions (issue 13): a level's rate_limit says whether its published limit is global (held
// exactly across regional clusters, each regional leader holding a share of the global
// cluster's bucket) or regional (each regional cluster enforces it alone: with N regions the
// effective limit is N × the configured one). Regional is the default.

import "fmt"

// ScopeError is the error CheckScopes returns: Rate is the rate_limit of the level whose scope
// is unusable, so that a caller that knows where each level was written (the limits file
// parser) can point at it.
type ScopeError struct {
	Rate *Rate
	Err  error
}

func (e *ScopeError) Error() string { return e.Err.Error() }
func (e *ScopeError) Unwrap() error { return e.Err }

// Scopes of a rate limit (Rate.Scope).
const (
	// ScopeRegional (also the empty Scope, the default): a regional cluster enforces the level
	// alone, so the published limit holds per region.
	ScopeRegional = "regional"
	// ScopeGlobal: the limit holds across regions. A regional cluster admits at the level only
	// from the share its leader holds of the global cluster's bucket (the level must lend:
	// a shares block) and, once that share has ended unrenewed, at its slice of the level's
	// shares.fallback_rate, or not at all.
	ScopeGlobal = "global"
)

// IsGlobal reports whether r's published limit holds across regions.
func (r *Rate) IsGlobal() bool { return r != nil && r.Scope == ScopeGlobal }

// GlobalPath is a level marked scope: global: its domain and the fixed descriptor path to it
// (empty for a domain ceiling). A regional leader holds one share per GlobalPath.
type GlobalPath struct {
	Domain  string
	Entries []Entry
	// Scope is the level's key (ScopeDomain for a domain ceiling).
	Scope string
	// Rate is the level's rate_limit.
	Rate Rate
	// FallbackRate is the level's shares.fallback_rate (0: holders fail closed once their
	// share has ended unrenewed).
	FallbackRate uint64
}

func fallbackOf(s *Shares) uint64 {
	if s == nil {
		return 0
	}
	return s.FallbackRate
}

// GlobalPaths lists the scope: global levels of l in configuration order.
func (l *Limits) GlobalPaths() []GlobalPath {
	var out []GlobalPath
	if l == nil {
		return nil
	}
	for i := range l.Domains {
		d := &l.Domains[i]
		if d.Rate.IsGlobal() {
			out = append(out, GlobalPath{Domain: d.Name, Scope: ScopeDomain, Rate: *d.Rate, FallbackRate: fallbackOf(d.Shares)})
		}
		var walk func(ns []Node, path []Entry)
		walk = func(ns []Node, path []Entry) {
			for j := range ns {
				n := &ns[j]
				p := append(path[:len(path):len(path)], Entry{Key: n.Key, Value: n.Value})
				if n.Rate.IsGlobal() {
					out = append(out, GlobalPath{Domain: d.Name, Entries: p, Scope: n.Key, Rate: *n.Rate, FallbackRate: fallbackOf(n.Shares)})
				}
				walk(n.Children, p)
			}
		}
		walk(d.Descriptors, nil)
	}
	return out
}

// checkScope validates a level's scope: a known value; global only on a level that lends
// (shares) and whose path is fixed (fixed: every value from the domain down is exact, so
// the level is one bucket a regional leader can hold a share of).
func checkScope(where string, r *Rate, s *Shares, fixed bool) error {
	if r == nil {
		return nil
	}
	switch r.Scope {
	case "", ScopeRegional:
		return nil
	case ScopeGlobal:
	default:
		return fmt.Errorf("%w: %s: rate_limit.scope %q is not a scope; use global (one limit across regions) or regional (the default: each region enforces it alone)", ErrInvalidLimits, where, r.Scope)
	}
	if s == nil {
		return fmt.Errorf("%w: %s: rate_limit.scope global needs a shares block on the same level (regional leaders hold shares of the global bucket); add shares: {} or make the scope regional", ErrInvalidLimits, where)
	}
	if !fixed {
		return fmt.Errorf("%w: %s: rate_limit.scope global needs a fixed path (every value from the domain down exact, no per-value or wildcard level): one bucket per value cannot be held by a regional leader yet; make the scope regional", ErrInvalidLimits, where)
	}
	return nil
}

// CheckScopes reports the first level of d whose rate_limit.scope is not usable (see
// checkScope), naming it, as a *ScopeError; the engine checks the same when it compiles limits.
func CheckScopes(d *Domain) error {
	where := fmt.Sprintf("domain %q", d.Name)
	if err := checkScope(where, d.Rate, d.Shares, true); err != nil {
		return &ScopeError{Rate: d.Rate, Err: err}
	}
	var walk func(ns []Node, path string, fixed bool) error
	walk = func(ns []Node, path string, fixed bool) error {
		for i := range ns {
			n := &ns[i]
			name := n.Key
			if n.Value != "" {
				name += "=" + n.Value
			}
			if path != "" {
				name = path + "/" + name
			}
			f := fixed && n.Value != "" && !IsWildcard(n.Value)
			if err := checkScope(fmt.Sprintf("domain %q: descriptor %s", d.Name, name), n.Rate, n.Shares, f); err != nil {
				return &ScopeError{Rate: n.Rate, Err: err}
			}
			if err := walk(n.Children, name, f); err != nil {
				return err
			}
		}
		return nil
	}
	return walk(d.Descriptors, "", true)
}

// LimitsVersion is the version of the limits the engine enforces (cheap: no copy).
func (e *Engine) LimitsVersion() uint64 {
	if e.lim == nil || e.lim.limits == nil {
		return 0
	}
	return e.lim.limits.Version
}
