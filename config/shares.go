package config

import (
	"fmt"

	"gopkg.in/yaml.v3"

	"github.com/quotad/quotad/quota"
)

// The shares block (issue 12): a level lends slices of its bucket to share holders that
// decide locally. Kept in its own file so other changes to the parser stay apart.
//
//	shares: {lease: 15s, reserve_percent: 10, fallback_rate: 5}

var sharesKeys = []string{"lease", "reserve_percent", "fallback_rate"}

// shares parses a shares block at path. rate is the level's parsed rate_limit (nil if none):
// lending needs one.
func (p *parser) shares(key, n *yaml.Node, path string, rate *quota.Rate) *quota.Shares {
	n = deref(n)
	if n == nil || n.Kind != yaml.MappingNode {
		p.errorf(n, path, "expected a mapping like {lease: 15s, reserve_percent: 10}, got %s; write shares: {} for the defaults", describe(n))
		return nil
	}
	if rate == nil {
		p.errorf(key, path, "needs a rate_limit on the same level (shares lend slices of its bucket); add one or remove shares")
		return nil
	}
	f := p.fields(n, path, sharesKeys)
	s := &quota.Shares{}
	good := true
	if lf, has := f["lease"]; has {
		if d, ok := p.duration(lf.val, join(path, "lease")); !ok {
			good = false
		} else if d < quota.MinShareLease || d > quota.MaxShareLease {
			p.errorf(lf.val, join(path, "lease"), "%v is out of range; use %v to %v (default %v)", d, quota.MinShareLease, quota.MaxShareLease, quota.DefaultShareLease)
			good = false
		} else {
			s.Lease = d
		}
	}
	if rf, has := f["reserve_percent"]; has {
		if v, ok := p.count(rf.val, join(path, "reserve_percent"), quota.MaxReservePercent, fmt.Sprintf(" (default %d)", quota.DefaultReservePercent)); ok {
			s.ReservePercent = uint32(v)
		} else {
			good = false
		}
	}
	if ff, has := f["fallback_rate"]; has {
		if v, ok := p.count(ff.val, join(path, "fallback_rate"), rate.RequestsPerUnit, "; leave fallback_rate out for holders to fail closed"); ok {
			s.FallbackRate = v
		} else {
			good = false
		}
	}
	if !good {
		return nil
	}
	return s
}

// sharesNode renders a shares block (Format).
func sharesNode(s *quota.Shares) *yaml.Node {
	m := mapping(true)
	if s.Lease != 0 {
		add(m, "lease", scalar("!!str", formatDuration(s.Lease)))
	}
	if s.ReservePercent != 0 {
		add(m, "reserve_percent", uintNode(uint64(s.ReservePercent)))
	}
	if s.FallbackRate != 0 {
		add(m, "fallback_rate", uintNode(s.FallbackRate))
	}
	return m
}
