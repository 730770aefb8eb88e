package config

import (
	"errors"
	"strings"

	"github.com/quotad/quotad/quota"
)

// The scope of a rate_limit (issue 13): global (one limit across regional clusters, each
// regional leader holding a share of the global cluster's bucket) or regional (the default:
// every regional cluster enforces it alone). Kept in its own file so other changes to the
// parser stay apart.
//
//	rate_limit: {unit: second, requests_per_unit: 1000, scope: global}
//	shares: {fallback_rate: 100}

// scope reads rate_limit.scope from f ("" when absent). ok is false after reporting an error.
func (p *parser) scope(f map[string]field, path string) (string, bool) {
	sf, has := f["scope"]
	if !has {
		return "", true
	}
	s, ok := p.str(sf.val, join(path, "scope"), "scope: global")
	if !ok {
		return "", false
	}
	switch s {
	case quota.ScopeGlobal, quota.ScopeRegional:
		return s, true
	}
	p.errorf(sf.val, join(path, "scope"), "%q is not a scope; use global (one limit across regions: regional leaders hold shares of the global cluster's bucket) or regional (the default: each region enforces the limit alone)", s)
	return "", false
}

// checkScopes reports every domain with a scope: global level that cannot be global (no shares
// block, or a path that is not fixed).
func checkScopes(domains []parsedDomain) []*Error {
	var errs []*Error
	for i := range domains {
		d := &domains[i]
		if err := quota.CheckScopes(&d.Domain); err != nil {
			msg := strings.TrimPrefix(err.Error(), quota.ErrInvalidLimits.Error()+": ")
			// Point at the offending level's scope, not at the domain (a level parsed from a
			// file has its position; Merge's inputs do not).
			at := position{line: d.line, path: "rate_limit.scope"}
			var se *quota.ScopeError
			if errors.As(err, &se) {
				if pos, ok := d.scopeAt[se.Rate]; ok {
					at = pos
				}
			}
			errs = append(errs, newError(d.file, at.line, at.path, "%s", msg))
		}
	}
	return errs
}
