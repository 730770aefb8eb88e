package quota

// Matching a request's descriptor list against a domain's tree. There is one rule for picking
// a child (childSet.pick: exact value, else the first wildcard prefix in configuration order,
// else the key's default) and two ways of walking with it:
//
//   - the native API (Engine.Acquire, Status, the fair scheduler) walks entry by entry and uses
//     every level it reaches: all of them are charged, all-or-nothing; it stops at the first
//     entry that matches nothing;
//   - Envoy's RLS (Engine.RateLimit) uses only the level reached by the descriptor's LAST entry,
//     and only if every entry matched; a descriptor deeper than the configuration (the walk
//     reaches a leaf with entries left) selects nothing — envoyproxy/ratelimit's GetLimit.

// Matcher matches descriptor lists against one installed Limits. It is immutable and safe for
// concurrent use; Engine.Matcher returns the engine's current one.
type Matcher struct {
	c *compiled
}

// NewMatcher compiles l (validated as SetLimits would) into a Matcher.
func NewMatcher(l *Limits) (*Matcher, error) {
	v := uint64(0)
	if l != nil {
		v = l.Version
	}
	c, err := compileLimits(l, v)
	if err != nil {
		return nil, err
	}
	return &Matcher{c: c}, nil
}

// Matcher returns a Matcher for the installed limits. It stays valid (for those limits) after
// later SetLimits calls.
func (e *Engine) Matcher() *Matcher { return &Matcher{c: e.lim} }

// Limits returns the limits the matcher matches against (read-only; domains sorted by name).
func (m *Matcher) Limits() *Limits { return m.c.limits }

// Domain returns the named domain, or nil.
func (m *Matcher) Domain(domain string) *Domain {
	root := m.c.domains[domain]
	if root == nil {
		return nil
	}
	return &m.c.limits.Domains[root.dom]
}

// Path matches entries by the native rule: nodes[i] is the node entries[i] selects, and
// nodes stops at the first entry that selects nothing. ok is false for an unknown domain.
// The nodes belong to the matcher (read-only).
func (m *Matcher) Path(domain string, entries []Entry) (nodes []*Node, ok bool) {
	lv := m.c.domains[domain]
	if lv == nil {
		return nil, false
	}
	for _, en := range entries {
		if lv = lv.child(en); lv == nil {
			break
		}
		nodes = append(nodes, lv.node)
	}
	return nodes, true
}

// Rule matches an Envoy descriptor by envoyproxy/ratelimit's rule and returns the node whose
// limit applies (a rate_limit, a blocking one, or unlimited), or nil: unknown domain, no
// entries, an entry that selects nothing, a descriptor deeper than the configuration, or a
// last node without a limit. Ancestors' limits never apply to an Envoy descriptor.
func (m *Matcher) Rule(domain string, entries []Entry) *Node {
	if lv := m.c.envoyRule(m.c.domains[domain], entries); lv != nil {
		return lv.node
	}
	return nil
}

// RuleKey returns envoyproxy/ratelimit's statistics key of the rule an Envoy descriptor
// selects ("" if none): the domain and the configured path joined by '.', each level as key
// or key_value (a wildcard level keeps its pattern). detailed_metric on the rule uses the
// request's values at every level; value_to_metric on a level uses the request's value there.
func (m *Matcher) RuleKey(domain string, entries []Entry) string {
	return string(m.AppendRuleKey(nil, domain, entries))
}

// AppendRuleKey appends RuleKey's key to b (nothing if the descriptor selects no rule).
func (m *Matcher) AppendRuleKey(b []byte, domain string, entries []Entry) []byte {
	root := m.c.domains[domain]
	last := m.c.envoyRule(root, entries)
	if last == nil {
		return b
	}
	detailed := last.node.DetailedMetric
	b = append(b, domain...)
	lv := root
	for _, en := range entries {
		lv = lv.child(en)
		n := lv.node
		b = append(b, '.')
		b = append(b, en.Key...)
		v := n.Value
		if detailed || (n.ValueToMetric && !n.ShareThreshold) {
			v = en.Value
		}
		if v != "" {
			b = append(b, '_')
			b = append(b, v...)
		}
	}
	return b
}

// envoyRule is Matcher.Rule on compiled levels (root nil: unknown domain).
func (c *compiled) envoyRule(root *level, entries []Entry) *level {
	if root == nil {
		return nil
	}
	lv := root
	for i, en := range entries {
		next := lv.child(en)
		if next == nil {
			return nil
		}
		if i == len(entries)-1 {
			if next.hasLimit() {
				return next
			}
			return nil
		}
		if next.children == nil {
			return nil // the request is deeper than the configuration
		}
		lv = next
	}
	return nil
}

// hasLimit reports whether an Envoy descriptor ending at this level has a limit.
func (l *level) hasLimit() bool {
	return l.rate != nil || l.blocked > 0 || (l.node != nil && l.node.Unlimited)
}
