package quota

import (
	"slices"
	"strings"
)

// LevelAllocation is one rate-limited level of the installed limits and how much it hands
// out: what an operator compares with the capacity behind a domain (the sum of allocated
// quotas against the ceiling).
type LevelAllocation struct {
	Domain string
	// Path names the level from the domain down: "domain" for the domain's ceiling, else the
	// descriptor entries, a value-less key bare ("endpoint=charges/tenant").
	Path string
	// PerKey: a value-less key (one bucket per distinct value, e.g. per tenant).
	PerKey bool
	// RatePerSecond is one bucket's configured refill rate, in cost units per second.
	RatePerSecond float64
	// ActiveKeys is how many of the level's buckets are held now, i.e. not full: the keys that
	// spent within about one refill of their burst.
	ActiveKeys int
}

// Allocation lists the rate-limited levels of the installed limits, sorted by domain and path,
// with the buckets each holds now. It reads every stored bucket (O(buckets)).
func (e *Engine) Allocation() []LevelAllocation {
	active := make([]int, len(e.lim.levels))
	e.buckets.eachLive(func(_ uint32, r *bucketRec) {
		if int(r.lvl) < len(active) {
			active[r.lvl]++
		}
	})
	var out []LevelAllocation
	var walk func(lv *level, path []string, perKey bool)
	walk = func(lv *level, path []string, perKey bool) {
		if lv.rate != nil {
			p := "domain"
			if len(path) > 0 {
				p = strings.Join(path, "/")
			}
			out = append(out, LevelAllocation{Domain: e.lim.limits.Domains[lv.dom].Name, Path: p, PerKey: perKey,
				RatePerSecond: float64(lv.rate.rpu) * 1e9 / float64(lv.rate.unit), ActiveKeys: active[lv.idx]})
		}
		keys := make([]string, 0, len(lv.children))
		for k := range lv.children {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			cs := lv.children[k]
			vals := make([]string, 0, len(cs.exact))
			for v := range cs.exact {
				vals = append(vals, v)
			}
			slices.Sort(vals)
			for _, v := range vals {
				walk(cs.exact[v], append(slices.Clip(path), k+"="+v), perKey)
			}
			if cs.any != nil {
				walk(cs.any, append(slices.Clip(path), k), true)
			}
		}
	}
	for _, d := range e.lim.limits.Domains {
		walk(e.lim.domains[d.Name], nil, false)
	}
	return out
}
