package config

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/quotad/quotad/quota"
)

// Diff describes what changes from old to new, one line per change, for `quotad limits apply`
// to show before it applies. Either side may be nil (no limits). Version is ignored.
//
// Lines start with "+" (added), "-" (removed) or "~" (changed) and name a level by its path,
// domain/key=value/key (a key without "=" is a per-value level). Order is deterministic:
// domains by name; within a domain its own settings, then levels depth-first, removed levels
// (in old order) before added and changed ones (in new order). Reordering siblings is not a
// change: levels are matched by key and value. An empty result means nothing changes.
func Diff(old, new *quota.Limits) []string {
	var oldD, newD []quota.Domain
	if old != nil {
		oldD = old.Domains
	}
	if new != nil {
		newD = new.Domains
	}
	byName := func(ds []quota.Domain) map[string]*quota.Domain {
		m := make(map[string]*quota.Domain, len(ds))
		for i := range ds {
			m[ds[i].Name] = &ds[i]
		}
		return m
	}
	om, nm := byName(oldD), byName(newD)
	names := make([]string, 0, len(om)+len(nm))
	for n := range om {
		names = append(names, n)
	}
	for n := range nm {
		if _, ok := om[n]; !ok {
			names = append(names, n)
		}
	}
	sort.Strings(names)

	var out []string
	for _, name := range names {
		o, n := om[name], nm[name]
		switch {
		case o == nil:
			out = append(out, fmt.Sprintf("+ domain %s%s", name, summarize(domainSettings(n), countLevels(n.Descriptors))))
		case n == nil:
			out = append(out, fmt.Sprintf("- domain %s", name))
		default:
			if a, b := describeRate(o.Rate), describeRate(n.Rate); a != b {
				out = append(out, fmt.Sprintf("~ %s: ceiling %s -> %s", name, a, b))
			}
			if a, b := describeConcurrency(o.Concurrency), describeConcurrency(n.Concurrency); a != b {
				out = append(out, fmt.Sprintf("~ %s: concurrency %s -> %s", name, a, b))
			}
			for _, c := range []struct{ what, a, b string }{
				{"adaptive", describeAdaptive(o.Adaptive), describeAdaptive(n.Adaptive)},
				{"retry_budget", describeRetryBudget(o.RetryBudget), describeRetryBudget(n.RetryBudget)},
				{"work_classes", describeWorkClasses(o.WorkClasses), describeWorkClasses(n.WorkClasses)},
				{"resume_jitter", describeJitter(o.ResumeJitter), describeJitter(n.ResumeJitter)},
				{"max_pause", describeJitter(o.MaxPause), describeJitter(n.MaxPause)},
				{"max_keys", describeMaxKeys(o.MaxKeys), describeMaxKeys(n.MaxKeys)},
				{"strict_keys", strconv.FormatBool(o.StrictKeys), strconv.FormatBool(n.StrictKeys)},
				{"shares", describeShares(o.Shares), describeShares(n.Shares)},
			} {
				if c.a != c.b {
					out = append(out, fmt.Sprintf("~ %s: %s %s -> %s", name, c.what, c.a, c.b))
				}
			}
			out = diffLevels(out, name, o.Descriptors, n.Descriptors)
		}
	}
	return out
}

type levelID struct{ key, value string }

func diffLevels(out []string, parent string, old, new []quota.Node) []string {
	index := func(ns []quota.Node) map[levelID]*quota.Node {
		m := make(map[levelID]*quota.Node, len(ns))
		for i := range ns {
			m[levelID{ns[i].Key, ns[i].Value}] = &ns[i]
		}
		return m
	}
	om, nm := index(old), index(new)
	for i := range old {
		o := &old[i]
		if _, kept := nm[levelID{o.Key, o.Value}]; !kept {
			out = removedLevels(out, parent, o)
		}
	}
	for i := range new {
		n := &new[i]
		path := levelPath(parent, n)
		o, existed := om[levelID{n.Key, n.Value}]
		if !existed {
			out = addedLevels(out, parent, n)
			continue
		}
		changes := []struct{ what, a, b string }{
			{"rate", describeRate(o.Rate), describeRate(n.Rate)},
			{"concurrency", describeConcurrency(o.Concurrency), describeConcurrency(n.Concurrency)},
			{"unlimited", strconv.FormatBool(o.Unlimited), strconv.FormatBool(n.Unlimited)},
			{"shadow_mode", strconv.FormatBool(o.ShadowMode), strconv.FormatBool(n.ShadowMode)},
			{"quota_mode", strconv.FormatBool(o.QuotaMode), strconv.FormatBool(n.QuotaMode)},
			{"share_threshold", strconv.FormatBool(o.ShareThreshold), strconv.FormatBool(n.ShareThreshold)},
			{"detailed_metric", strconv.FormatBool(o.DetailedMetric), strconv.FormatBool(n.DetailedMetric)},
			{"value_to_metric", strconv.FormatBool(o.ValueToMetric), strconv.FormatBool(n.ValueToMetric)},
			{"weight", describeWeight(o.Weight), describeWeight(n.Weight)},
			{"max_keys_per_parent", describePerParent(o.MaxKeysPerParent), describePerParent(n.MaxKeysPerParent)},
			{"adaptive", describeAdaptive(o.Adaptive), describeAdaptive(n.Adaptive)},
			{"shares", describeShares(o.Shares), describeShares(n.Shares)},
			{"name", strconv.Quote(o.Name), strconv.Quote(n.Name)},
			{"replaces", describeNames(o.Replaces), describeNames(n.Replaces)},
		}
		for _, c := range changes {
			if c.a != c.b {
				out = append(out, fmt.Sprintf("~ %s: %s %s -> %s", path, c.what, c.a, c.b))
			}
		}
		out = diffLevels(out, path, o.Children, n.Children)
	}
	return out
}

func addedLevels(out []string, parent string, n *quota.Node) []string {
	path := levelPath(parent, n)
	out = append(out, "+ "+path+summarize(levelSettings(n), 0))
	for i := range n.Children {
		out = addedLevels(out, path, &n.Children[i])
	}
	return out
}

func removedLevels(out []string, parent string, n *quota.Node) []string {
	path := levelPath(parent, n)
	out = append(out, "- "+path)
	for i := range n.Children {
		out = removedLevels(out, path, &n.Children[i])
	}
	return out
}

func levelPath(parent string, n *quota.Node) string {
	if n.Value == "" {
		return parent + "/" + n.Key
	}
	return parent + "/" + n.Key + "=" + n.Value
}

func summarize(settings []string, levels int) string {
	if levels > 0 {
		settings = append(settings, fmt.Sprintf("%d descriptor levels", levels))
	}
	if len(settings) == 0 {
		return ""
	}
	return " (" + strings.Join(settings, ", ") + ")"
}

func domainSettings(d *quota.Domain) []string {
	var s []string
	if d.Rate != nil {
		s = append(s, "ceiling "+describeRate(d.Rate))
	}
	if d.Concurrency != nil {
		s = append(s, "concurrency "+describeConcurrency(d.Concurrency))
	}
	if d.Adaptive != nil {
		s = append(s, "adaptive "+describeAdaptive(d.Adaptive))
	}
	if d.RetryBudget != nil {
		s = append(s, "retry_budget "+describeRetryBudget(d.RetryBudget))
	}
	if len(d.WorkClasses) > 0 {
		s = append(s, "work_classes "+describeWorkClasses(d.WorkClasses))
	}
	if d.StrictKeys {
		s = append(s, "strict_keys")
	}
	if d.Shares != nil {
		s = append(s, "shares "+describeShares(d.Shares))
	}
	return s
}

func levelSettings(n *quota.Node) []string {
	var s []string
	if n.Rate != nil {
		s = append(s, "rate "+describeRate(n.Rate))
	}
	if n.Concurrency != nil {
		s = append(s, "concurrency "+describeConcurrency(n.Concurrency))
	}
	if n.Unlimited {
		s = append(s, "unlimited")
	}
	if n.ShadowMode {
		s = append(s, "shadow_mode")
	}
	if n.QuotaMode {
		s = append(s, "quota_mode")
	}
	if n.ShareThreshold {
		s = append(s, "share_threshold")
	}
	if n.Weight != 0 {
		s = append(s, "weight "+describeWeight(n.Weight))
	}
	if n.MaxKeysPerParent != 0 {
		s = append(s, "max_keys_per_parent "+describePerParent(n.MaxKeysPerParent))
	}
	if n.Adaptive != nil {
		s = append(s, "adaptive "+describeAdaptive(n.Adaptive))
	}
	if n.Shares != nil {
		s = append(s, "shares "+describeShares(n.Shares))
	}
	return s
}

func countLevels(ns []quota.Node) int {
	c := len(ns)
	for i := range ns {
		c += countLevels(ns[i].Children)
	}
	return c
}

func describeRate(r *quota.Rate) string {
	if r == nil {
		return "none"
	}
	unit, mult := unitName(r.Unit)
	per := unit
	if mult > 1 {
		per = fmt.Sprintf("%d %ss", mult, unit)
	}
	scope := ""
	if r.Scope == quota.ScopeGlobal {
		scope = " scope global"
	}
	if r.RequestsPerUnit == 0 {
		return fmt.Sprintf("blocked (0/%s)%s", per, scope)
	}
	return fmt.Sprintf("%d/%s burst %d%s", r.RequestsPerUnit, per, r.Capacity(), scope)
}

// describeShares names a shares block with its defaults filled in, so that `shares: {}` and
// the same block spelled out compare equal.
func describeShares(s *quota.Shares) string {
	if s == nil {
		return "none"
	}
	lease, reserve := s.Lease, s.ReservePercent
	if lease == 0 {
		lease = quota.DefaultShareLease
	}
	if reserve == 0 {
		reserve = quota.DefaultReservePercent
	}
	fallback := "fail closed"
	if s.FallbackRate != 0 {
		fallback = fmt.Sprintf("fallback_rate %d", s.FallbackRate)
	}
	return fmt.Sprintf("lease %s, reserve %d%%, %s", formatDuration(lease), reserve, fallback)
}

func describeConcurrency(c *quota.Concurrency) string {
	if c == nil {
		return "none"
	}
	return fmt.Sprintf("%d in flight, lease %s", c.MaxInFlight, formatDuration(c.LeaseTTL))
}

func describeWeight(w uint32) string {
	if w == 0 {
		w = 1
	}
	return strconv.FormatUint(uint64(w), 10)
}

func describeNames(names []string) string {
	if len(names) == 0 {
		return "[]"
	}
	return "[" + strings.Join(names, ", ") + "]"
}

func describeAdaptive(a *quota.Adaptive) string {
	if a == nil {
		return "none"
	}
	return fmt.Sprintf("floor %d, keep %d%% on 429, +%d every %s", a.Floor, a.DecreasePercent, a.Increase, formatDuration(a.StableWindow))
}

func describeRetryBudget(b *quota.RetryBudget) string {
	if b == nil {
		return "none"
	}
	return fmt.Sprintf("%d%% of first attempts, min %d/s", b.RatioPercent, b.MinPerSecond)
}

func describeWorkClasses(wcs []quota.WorkClass) string {
	if len(wcs) == 0 {
		return "[]"
	}
	parts := make([]string, len(wcs))
	for i, wc := range wcs {
		parts[i] = fmt.Sprintf("%s %d%%", wc.Name, wc.ReservePercent)
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

func describePerParent(n uint64) string {
	if n == 0 {
		return "none"
	}
	return strconv.FormatUint(n, 10)
}

func describeMaxKeys(n uint64) string {
	if n == 0 {
		return "default (" + strconv.Itoa(quota.DefaultMaxKeys) + ")"
	}
	return strconv.FormatUint(n, 10)
}

func describeJitter(d time.Duration) string {
	if d == 0 {
		return "default"
	}
	return formatDuration(d)
}
