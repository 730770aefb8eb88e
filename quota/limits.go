package quota

import (
	"bytes"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"time"
	"unsafe"
)

// maxUnits is the largest rate or burst, in units, whose micro-unit value fits in a uint64.
const maxUnits = ^uint64(0) / microPerUnit

// level is one compiled level of a domain's descriptor tree: the domain itself (Scope "domain")
// or a Node. Levels are immutable once compiled; buckets point at theirs.
type level struct {
	scope  string // ScopeDomain or the Node's Key
	idx    uint32 // preorder index in compiled.levels; stable for a given Limits
	dom    uint32 // ordinal of the level's domain in compiled.limits.Domains
	rate   *rateParams
	conc   *Concurrency // nil: no concurrency cap here
	shadow bool
	// blocked > 0: the level's rate_limit has requests_per_unit 0 (envoy's way to block a
	// value) and this unit: it refuses every request, and rate is nil (no bucket is stored).
	blocked time.Duration
	// node is the level's descriptor (nil for a domain's root), in compiled.limits.
	node *Node
	// shareKey, for a wildcard level with share_threshold, is the value that stands for every
	// matching value in bucket keys (the pattern, e.g. "files*"): they share one bucket.
	shareKey string
	weight   uint32 // Node.Weight (0: 1), the weight of flows ending here in share allocation
	fixed    bool   // every value from the domain down is exact: the level is one bucket
	// shares: the level lends to share holders; nil: it does not.
	shares *shareParams
	// adaptive: the rate adapts to provider feedback (AIMD); nil: fixed. Only with rate.
	adaptive *adaptiveParams
	// maxPerParent > 0 caps this level's stored buckets under one parent path
	// (Node.MaxKeysPerParent, counted by bucketStore.parentKeys).
	maxPerParent int
	// Domain (root) levels only:
	domain  string
	retry   *retryParams  // nil: retries are not budgeted
	jitter  time.Duration // resume jitter window
	maxKeys int           // stored buckets the domain may hold (max_keys)
	strict  bool          // strict_keys: an undefined descriptor key is refused
	// overrideLv is the domain's level for buckets of Envoy limit overrides (RLSLimit).
	overrideLv *level
	// override: this is a domain's overrideLv. It has no rate of its own: each of its buckets
	// carries its rate in its key (overrideKey).
	override bool
	// children by key; a nil map means a leaf.
	children map[string]*childSet
}

// childSet holds the children of one level that share a key.
type childSet struct {
	exact map[string]*level // by non-empty Value without a trailing '*'
	wild  []wildChild       // Values ending in '*', in configuration order
	any   *level            // the Value == "" child: one bucket per distinct value
}

// wildChild is a child whose Value ends in '*': it matches every value with that prefix.
type wildChild struct {
	prefix string
	lv     *level
}

// IsWildcard reports whether a descriptor value is a wildcard: it ends in '*' and matches
// every value that starts with what comes before it ("files/*" matches "files/a.txt", "*"
// matches every value). A '*' anywhere else is an ordinary character, as in envoyproxy/ratelimit.
func IsWildcard(value string) bool { return strings.HasSuffix(value, "*") }

// pick is THE matching rule, for the native API, the Envoy RLS adapter and the fair scheduler
// alike: an entry's value selects the child with that exact value, else the first wildcard
// child (in configuration order) whose prefix it starts with, else the child without a value
// (the key's default, one bucket per distinct value), else nothing.
func (cs *childSet) pick(value string) *level {
	if c := cs.exact[value]; c != nil {
		return c
	}
	for i := range cs.wild {
		if strings.HasPrefix(value, cs.wild[i].prefix) {
			return cs.wild[i].lv
		}
	}
	return cs.any
}

// child returns the child that entry e matches (see pick), or nil.
func (l *level) child(e Entry) *level {
	cs := l.children[e.Key]
	if cs == nil {
		return nil
	}
	return cs.pick(e.Value)
}

// keyEntry is the entry that names lv's bucket for request entry e: e itself, or with the
// wildcard's pattern as value when the level shares one bucket among its values.
func (l *level) keyEntry(e Entry) Entry {
	if l.shareKey != "" {
		e.Value = l.shareKey
	}
	return e
}

// compiled is an installed Limits plus its lookup structures.
type compiled struct {
	limits  *Limits // deep copy, domains sorted, Version set; never modified
	domains map[string]*level
	levels  []*level // by idx
	digest  uint64   // FNV-64a of the limits' JSON, for Hash
}

// compileLimits validates l and builds its lookup structures. It does not modify l; the result
// holds a deep copy with domains sorted by name and Version set to version.
func compileLimits(l *Limits, version uint64) (*compiled, error) {
	if l == nil {
		l = &Limits{}
	}
	cp := cloneLimits(l)
	cp.Version = version
	slices.SortStableFunc(cp.Domains, func(a, b Domain) int { return strings.Compare(a.Name, b.Name) })

	c := &compiled{limits: cp, domains: make(map[string]*level, len(cp.Domains))}
	for i := range cp.Domains {
		d := &cp.Domains[i]
		if d.Name == "" {
			return nil, fmt.Errorf("%w: domain #%d has an empty name; give every domain a name", ErrInvalidLimits, i)
		}
		if _, dup := c.domains[d.Name]; dup {
			return nil, fmt.Errorf("%w: domain %q is defined twice; merge the two definitions", ErrInvalidLimits, d.Name)
		}
		where := fmt.Sprintf("domain %q", d.Name)
		first := len(c.levels)
		root, err := c.newLevel(where, ScopeDomain, d.Rate, d.Concurrency, false)
		if err != nil {
			return nil, err
		}
		if err := root.setPolicy(where, d); err != nil {
			return nil, err
		}
		if root.shares, err = newShareParams(where, d.Shares, root); err != nil {
			return nil, err
		}
		root.fixed = true
		if err := checkScope(where, d.Rate, d.Shares, true); err != nil {
			return nil, err
		}
		if err := c.compileChildren(root, d.Name, "", d.Descriptors); err != nil {
			return nil, err
		}
		for _, lv := range c.levels[first:] {
			lv.dom = uint32(i)
		}
		c.domains[d.Name] = root
	}
	// One level per domain for Envoy's limit overrides, after every configured level so that
	// the configured levels keep their indexes (snapshots store them).
	for i := range cp.Domains {
		root := c.domains[cp.Domains[i].Name]
		root.overrideLv = &level{scope: ScopeOverride, idx: uint32(len(c.levels)), dom: root.dom, override: true}
		c.levels = append(c.levels, root.overrideLv)
	}
	js, err := json.Marshal(cp)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidLimits, err)
	}
	h := fnv.New64a()
	h.Write(js)
	c.digest = h.Sum64()
	return c, nil
}

// has reports whether a child with exactly this Value is defined.
func (cs *childSet) has(value string) bool {
	switch {
	case value == "":
		return cs.any != nil
	case IsWildcard(value):
		for _, w := range cs.wild {
			if w.prefix+"*" == value {
				return true
			}
		}
		return false
	}
	return cs.exact[value] != nil
}

func (c *compiled) newLevel(where, scope string, r *Rate, cc *Concurrency, shadow bool) (*level, error) {
	lv := &level{scope: scope, idx: uint32(len(c.levels)), shadow: shadow}
	if r != nil && r.RequestsPerUnit == 0 && scope != ScopeDomain {
		// requests_per_unit 0 blocks a descriptor (envoy's meaning); there is no bucket to
		// keep. A domain's ceiling cannot block: remove the domain instead.
		if r.Unit <= 0 {
			return nil, fmt.Errorf("%w: %s: rate_limit.unit must be > 0 (got %v); use e.g. 1s, 1m, 1h", ErrInvalidLimits, where, r.Unit)
		}
		if r.Burst != 0 {
			return nil, fmt.Errorf("%w: %s: rate_limit.burst %d with requests_per_unit 0 (blocked); remove burst or set requests_per_unit", ErrInvalidLimits, where, r.Burst)
		}
		lv.blocked = r.Unit
		r = nil
	}
	if r != nil {
		rp, err := newRateParams(r)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %v", ErrInvalidLimits, where, err)
		}
		lv.rate = rp
	}
	if cc != nil {
		if cc.MaxInFlight == 0 {
			return nil, fmt.Errorf("%w: %s: concurrency.max_in_flight must be > 0 (got 0); remove concurrency to leave it uncapped", ErrInvalidLimits, where)
		}
		if cc.LeaseTTL <= 0 {
			return nil, fmt.Errorf("%w: %s: concurrency.lease_ttl must be > 0 (got %v); set it to how long a crashed holder may keep its permit, e.g. 30s", ErrInvalidLimits, where, cc.LeaseTTL)
		}
		cp := *cc
		lv.conc = &cp
	}
	c.levels = append(c.levels, lv)
	return lv, nil
}

func (c *compiled) compileChildren(parent *level, domain, path string, nodes []Node) error {
	if len(nodes) == 0 {
		return nil
	}
	parent.children = make(map[string]*childSet)
	for i := range nodes {
		n := &nodes[i]
		name := n.Key
		if n.Value != "" {
			name += "=" + n.Value
		}
		if path != "" {
			name = path + "/" + name
		}
		where := fmt.Sprintf("domain %q: descriptor %s", domain, name)
		if n.Key == "" {
			return fmt.Errorf("%w: domain %q: descriptor #%d under %q has an empty key; every descriptor needs a key", ErrInvalidLimits, domain, i, path)
		}
		if n.Unlimited && n.Rate != nil {
			return fmt.Errorf("%w: %s: unlimited and rate_limit are mutually exclusive; remove one", ErrInvalidLimits, where)
		}
		if n.Unlimited && n.Concurrency != nil {
			return fmt.Errorf("%w: %s: unlimited and concurrency are mutually exclusive; remove one", ErrInvalidLimits, where)
		}
		cs := parent.children[n.Key]
		if cs == nil {
			cs = &childSet{}
			parent.children[n.Key] = cs
		}
		if cs.has(n.Value) {
			return fmt.Errorf("%w: %s: defined twice under the same parent; merge the two entries", ErrInvalidLimits, where)
		}
		if n.ShareThreshold && !IsWildcard(n.Value) {
			return fmt.Errorf("%w: %s: share_threshold needs a wildcard value (ending in *); remove share_threshold or make the value a wildcard", ErrInvalidLimits, where)
		}
		if n.Unlimited && n.Rate != nil && n.Rate.RequestsPerUnit == 0 {
			return fmt.Errorf("%w: %s: unlimited and a blocking rate_limit (requests_per_unit 0) are mutually exclusive; remove one", ErrInvalidLimits, where)
		}
		lv, err := c.newLevel(where, n.Key, n.Rate, n.Concurrency, n.ShadowMode)
		if err != nil {
			return err
		}
		lv.node = n
		if lv.adaptive, err = newAdaptiveParams(where, n.Adaptive, lv.rate); err != nil {
			return err
		}
		lv.weight = n.Weight
		if lv.shares, err = newShareParams(where, n.Shares, lv); err != nil {
			return err
		}
		lv.fixed = parent.fixed && n.Value != "" && !IsWildcard(n.Value)
		if err := checkScope(where, n.Rate, n.Shares, lv.fixed); err != nil {
			return err
		}
		switch {
		case n.Value == "":
			cs.any = lv
		case IsWildcard(n.Value):
			cs.wild = append(cs.wild, wildChild{prefix: strings.TrimSuffix(n.Value, "*"), lv: lv})
			if n.ShareThreshold {
				lv.shareKey = n.Value
			}
		default:
			if cs.exact == nil {
				cs.exact = make(map[string]*level)
			}
			cs.exact[n.Value] = lv
		}
		if lv.maxPerParent, err = maxKeysPerParent(where, n, lv); err != nil {
			return err
		}
		if err := c.compileChildren(lv, domain, name, n.Children); err != nil {
			return err
		}
	}
	return nil
}

// maxKeysPerParent checks n's max_keys_per_parent and returns it (0: none).
func maxKeysPerParent(where string, n *Node, lv *level) (int, error) {
	m := n.MaxKeysPerParent
	switch {
	case m == 0:
		return 0, nil
	case m > MaxMaxKeys:
		return 0, fmt.Errorf("%w: %s: max_keys_per_parent must be at most %d (got %d)", ErrInvalidLimits, where, uint64(MaxMaxKeys), m)
	case (n.Value != "" && !IsWildcard(n.Value)) || lv.shareKey != "":
		return 0, fmt.Errorf("%w: %s: max_keys_per_parent %d on a level that is one bucket (value %q); set it on a level without a value, which stores one bucket per distinct value",
			ErrInvalidLimits, where, m, n.Value)
	case lv.rate == nil:
		return 0, fmt.Errorf("%w: %s: max_keys_per_parent %d on a level without a rate_limit, which stores no buckets; add a rate_limit or remove max_keys_per_parent",
			ErrInvalidLimits, where, m)
	}
	return int(m), nil
}

// UsesMaxKeysPerParent reports whether any level of l sets max_keys_per_parent (which nodes
// before fsm command version 6 would ignore).
func (l *Limits) UsesMaxKeysPerParent() bool {
	var walk func(ns []Node) bool
	walk = func(ns []Node) bool {
		for i := range ns {
			if ns[i].MaxKeysPerParent > 0 || walk(ns[i].Children) {
				return true
			}
		}
		return false
	}
	for i := range l.Domains {
		if walk(l.Domains[i].Descriptors) {
			return true
		}
	}
	return false
}

// match returns the level that the key's full path selects, or nil.
func (c *compiled) matchKey(key string) *level {
	domain, entries, ok := parseKey(key)
	if !ok {
		return nil
	}
	lv := c.domains[domain]
	for _, e := range entries {
		if lv == nil {
			return nil
		}
		lv = lv.child(e)
	}
	return lv
}

// matchKeyBytes is matchKey for a key held as bytes, without allocating: it unescapes names
// into buf and returns buf for reuse.
func (c *compiled) matchKeyBytes(key, buf []byte) (*level, []byte) {
	seg, rest, more := bytes.Cut(key, []byte{'/'})
	buf, ok := unescapeBytes(buf[:0], seg)
	if !ok {
		return nil, buf
	}
	lv := c.domains[string(buf)]
	for more && lv != nil {
		seg, rest, more = bytes.Cut(rest, []byte{'/'})
		k, v, found := bytes.Cut(seg, []byte{'='})
		if !found {
			return nil, buf
		}
		var okK, okV bool
		buf, okK = unescapeBytes(buf[:0], k)
		n := len(buf)
		buf, okV = unescapeBytes(buf, v)
		if !okK || !okV {
			return nil, buf
		}
		cs := lv.children[string(buf[:n])]
		if cs == nil {
			return nil, buf
		}
		// The value is only read while buf is not modified, so it may share buf's bytes.
		lv = cs.pick(unsafe.String(unsafe.SliceData(buf[n:]), len(buf)-n))
	}
	return lv, buf
}

func cloneLimits(l *Limits) *Limits {
	cp := &Limits{Version: l.Version, Domains: make([]Domain, len(l.Domains))}
	for i, d := range l.Domains {
		cp.Domains[i] = Domain{
			Name:         d.Name,
			Rate:         cloneRate(d.Rate),
			Concurrency:  cloneConc(d.Concurrency),
			Descriptors:  cloneNodes(d.Descriptors),
			WorkClasses:  slices.Clone(d.WorkClasses),
			RetryBudget:  clonePtr(d.RetryBudget),
			Adaptive:     clonePtr(d.Adaptive),
			ResumeJitter: d.ResumeJitter,
			MaxPause:     d.MaxPause,
			MaxKeys:      d.MaxKeys,
			StrictKeys:   d.StrictKeys,
			Shares:       clonePtr(d.Shares),
		}
	}
	return cp
}

func cloneNodes(ns []Node) []Node {
	if ns == nil {
		return nil
	}
	out := make([]Node, len(ns))
	for i, n := range ns {
		n.Rate = cloneRate(n.Rate)
		n.Concurrency = cloneConc(n.Concurrency)
		n.Adaptive = clonePtr(n.Adaptive)
		n.Shares = clonePtr(n.Shares)
		n.Replaces = slices.Clone(n.Replaces)
		n.Children = cloneNodes(n.Children)
		out[i] = n
	}
	return out
}

func cloneRate(r *Rate) *Rate {
	if r == nil {
		return nil
	}
	cp := *r
	return &cp
}

func clonePtr[T any](p *T) *T {
	if p == nil {
		return nil
	}
	cp := *p
	return &cp
}

func cloneConc(c *Concurrency) *Concurrency {
	if c == nil {
		return nil
	}
	cp := *c
	return &cp
}

// Bucket keys are "domain" for the ceiling and "domain/k1=v1/k2=v2" for levels. '%', '/' and '='
// inside names are percent-escaped so a key always splits back into its path.

const hexDigits = "0123456789ABCDEF"

func appendEscaped(b []byte, s string) []byte {
	start := 0 // s[start:i] needs no escaping; append it in one go
	for i := 0; i < len(s); i++ {
		if c := s[i]; c == '%' || c == '/' || c == '=' {
			b = append(b, s[start:i]...)
			b = append(b, '%', hexDigits[c>>4], hexDigits[c&15])
			start = i + 1
		}
	}
	return append(b, s[start:]...)
}

// appendEntry appends "/key=value" to a bucket key.
func appendEntry(b []byte, e Entry) []byte {
	b = append(b, '/')
	b = appendEscaped(b, e.Key)
	b = append(b, '=')
	return appendEscaped(b, e.Value)
}

// BucketKey returns the key of the bucket for domain and the descriptor path entries, as used in
// Decision.Charges and BucketStatus.Key.
func BucketKey(domain string, entries ...Entry) string {
	b := appendEscaped(nil, domain)
	for _, e := range entries {
		b = appendEntry(b, e)
	}
	return string(b)
}

// parseKey splits a bucket key back into its domain and entries.
func parseKey(key string) (domain string, entries []Entry, ok bool) {
	parts := strings.Split(key, "/")
	domain, ok = unescape(parts[0])
	if !ok {
		return "", nil, false
	}
	entries = make([]Entry, 0, len(parts)-1)
	for _, p := range parts[1:] {
		k, v, found := strings.Cut(p, "=")
		if !found {
			return "", nil, false
		}
		uk, ok1 := unescape(k)
		uv, ok2 := unescape(v)
		if !ok1 || !ok2 {
			return "", nil, false
		}
		entries = append(entries, Entry{Key: uk, Value: uv})
	}
	return domain, entries, true
}

func unescape(s string) (string, bool) {
	if strings.IndexByte(s, '%') < 0 {
		return s, true
	}
	var sb strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '%' {
			sb.WriteByte(s[i])
			continue
		}
		if i+2 >= len(s) {
			return "", false
		}
		hi, lo := unhex(s[i+1]), unhex(s[i+2])
		if hi < 0 || lo < 0 {
			return "", false
		}
		sb.WriteByte(byte(hi<<4 | lo))
		i += 2
	}
	return sb.String(), true
}

// unescapeBytes appends s unescaped to buf; ok is false if s has a malformed escape.
func unescapeBytes(buf, s []byte) (_ []byte, ok bool) {
	for i := 0; i < len(s); i++ {
		if s[i] != '%' {
			buf = append(buf, s[i])
			continue
		}
		if i+2 >= len(s) {
			return buf, false
		}
		hi, lo := unhex(s[i+1]), unhex(s[i+2])
		if hi < 0 || lo < 0 {
			return buf, false
		}
		buf = append(buf, byte(hi<<4|lo))
		i += 2
	}
	return buf, true
}

func unhex(c byte) int {
	switch {
	case '0' <= c && c <= '9':
		return int(c - '0')
	case 'A' <= c && c <= 'F':
		return int(c-'A') + 10
	case 'a' <= c && c <= 'f':
		return int(c-'a') + 10
	}
	return -1
}
