package config

import (
	"bytes"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"gopkg.in/yaml.v3"

	"github.com/quotad/quotad/quota"
)

// Format renders Limits in the limits file format, one YAML document per domain, so that what
// `quotad limits get` prints is accepted by `quotad limits apply`: for any l that Parse
// returned, Parse(name, Format(l)) equals l. A burst the file left out (stored as 0: one
// unit's worth) is left out, so a file edited from the output keeps following
// requests_per_unit; a burst written in the file is written, even when it equals
// requests_per_unit. lease_ttl and adaptive's decrease_percent, increase and stable_window are
// always written out: Parse fills their defaults (constants) in and the engine needs them set,
// so the stored limits cannot tell a default from the same value written explicitly (see
// `quotad limits get --help`).
//
// Limits that Parse would reject (a zero amount, a unit that is not a whole number of seconds,
// a level both unlimited and rate-limited) are still rendered, as faithfully as the format
// allows; parsing the result reports the problem. Invalid UTF-8 in names is replaced.
func Format(l *quota.Limits) []byte {
	var buf bytes.Buffer
	if l == nil || len(l.Domains) == 0 {
		buf.WriteString("# quotad limits: no domains\n")
		return buf.Bytes()
	}
	if l.Version > 0 {
		fmt.Fprintf(&buf, "# quotad limits version %d\n", l.Version)
	}
	for i := range l.Domains {
		if i > 0 {
			buf.WriteString("---\n")
		}
		var doc bytes.Buffer
		enc := yaml.NewEncoder(&doc)
		enc.SetIndent(2)
		err := enc.Encode(domainNode(&l.Domains[i]))
		if err == nil {
			err = enc.Close()
		}
		if err != nil {
			// Unreachable for nodes built here (all text is valid UTF-8); say so in the output
			// rather than returning half a document.
			fmt.Fprintf(&buf, "# cannot render domain %q: %v\n", l.Domains[i].Name, err)
			continue
		}
		buf.Write(doc.Bytes())
	}
	return buf.Bytes()
}

func domainNode(d *quota.Domain) *yaml.Node {
	m := mapping(false)
	add(m, "domain", str(d.Name))
	if d.Rate != nil {
		add(m, "rate_limit", rateNode(d.Rate, false, "", nil))
	}
	if d.Concurrency != nil {
		add(m, "concurrency", concurrencyNode(d.Concurrency))
	}
	if d.Adaptive != nil {
		add(m, "adaptive", adaptiveNode(d.Adaptive))
	}
	if b := d.RetryBudget; b != nil {
		rb := mapping(true)
		add(rb, "ratio_percent", uintNode(uint64(b.RatioPercent)))
		if b.MinPerSecond > 0 {
			add(rb, "min_per_second", uintNode(b.MinPerSecond))
		}
		add(m, "retry_budget", rb)
	}
	if len(d.WorkClasses) > 0 {
		seq := &yaml.Node{Kind: yaml.SequenceNode, Tag: "!!seq"}
		for _, wc := range d.WorkClasses {
			c := mapping(true)
			add(c, "name", str(wc.Name))
			add(c, "reserve_percent", uintNode(uint64(wc.ReservePercent)))
			seq.Content = append(seq.Content, c)
		}
		add(m, "work_classes", seq)
	}
	if d.ResumeJitter != 0 {
		add(m, "resume_jitter", scalar("!!str", formatDuration(d.ResumeJitter)))
	}
	if d.MaxPause != 0 {
		add(m, "max_pause", scalar("!!str", formatDuration(d.MaxPause)))
	}
	if d.MaxKeys != 0 {
		add(m, "max_keys", uintNode(d.MaxKeys))
	}
	if d.StrictKeys {
		add(m, "strict_keys", scalar("!!bool", "true"))
	}
	if d.Shares != nil {
		add(m, "shares", sharesNode(d.Shares))
	}
	if len(d.Descriptors) > 0 {
		add(m, "descriptors", descriptorsNode(d.Descriptors))
	}
	return m
}

func descriptorsNode(nodes []quota.Node) *yaml.Node {
	seq := &yaml.Node{Kind: yaml.SequenceNode, Tag: "!!seq"}
	for i := range nodes {
		seq.Content = append(seq.Content, descriptorNode(&nodes[i]))
	}
	return seq
}

func descriptorNode(n *quota.Node) *yaml.Node {
	m := mapping(false)
	add(m, "key", str(n.Key))
	if n.Value != "" {
		add(m, "value", str(n.Value))
	}
	// Envoy keeps unlimited, name and replaces inside rate_limit; write them there whenever
	// there is a rate_limit block, on the descriptor otherwise.
	if n.Rate != nil || n.Unlimited {
		add(m, "rate_limit", rateNode(n.Rate, n.Unlimited, n.Name, n.Replaces))
	} else {
		if n.Name != "" {
			add(m, "name", str(n.Name))
		}
		if len(n.Replaces) > 0 {
			add(m, "replaces", replacesNode(n.Replaces))
		}
	}
	if n.ShadowMode {
		add(m, "shadow_mode", scalar("!!bool", "true"))
	}
	if n.QuotaMode {
		add(m, "quota_mode", scalar("!!bool", "true"))
	}
	if n.DetailedMetric {
		add(m, "detailed_metric", scalar("!!bool", "true"))
	}
	if n.ValueToMetric {
		add(m, "value_to_metric", scalar("!!bool", "true"))
	}
	if n.ShareThreshold {
		add(m, "share_threshold", scalar("!!bool", "true"))
	}
	if n.MaxKeysPerParent != 0 {
		add(m, "max_keys_per_parent", uintNode(n.MaxKeysPerParent))
	}
	if n.Weight != 0 {
		add(m, "weight", uintNode(uint64(n.Weight)))
	}
	if n.Concurrency != nil {
		add(m, "concurrency", concurrencyNode(n.Concurrency))
	}
	if n.Adaptive != nil {
		add(m, "adaptive", adaptiveNode(n.Adaptive))
	}
	if n.Shares != nil {
		add(m, "shares", sharesNode(n.Shares))
	}
	if len(n.Children) > 0 {
		add(m, "descriptors", descriptorsNode(n.Children))
	}
	return m
}

func rateNode(r *quota.Rate, unlimited bool, name string, replaces []string) *yaml.Node {
	m := mapping(true)
	if r != nil {
		unit, mult := unitName(r.Unit)
		add(m, "unit", str(unit))
		if mult > 1 {
			add(m, "unit_multiplier", uintNode(mult))
		}
		add(m, "requests_per_unit", uintNode(r.RequestsPerUnit))
		if r.Burst > 0 { // 0: one unit's worth, the default, left out so it follows requests_per_unit
			add(m, "burst", uintNode(r.Burst))
		}
		if r.Scope != "" {
			add(m, "scope", str(r.Scope))
		}
	}
	if unlimited {
		add(m, "unlimited", scalar("!!bool", "true"))
	}
	if name != "" {
		add(m, "name", str(name))
	}
	if len(replaces) > 0 {
		add(m, "replaces", replacesNode(replaces))
	}
	return m
}

func replacesNode(names []string) *yaml.Node {
	seq := &yaml.Node{Kind: yaml.SequenceNode, Tag: "!!seq", Style: yaml.FlowStyle}
	for _, n := range names {
		m := mapping(true)
		add(m, "name", str(n))
		seq.Content = append(seq.Content, m)
	}
	return seq
}

func adaptiveNode(a *quota.Adaptive) *yaml.Node {
	m := mapping(true)
	add(m, "floor", uintNode(a.Floor))
	add(m, "decrease_percent", uintNode(uint64(a.DecreasePercent)))
	add(m, "increase", uintNode(a.Increase))
	add(m, "stable_window", scalar("!!str", formatDuration(a.StableWindow)))
	return m
}

func concurrencyNode(c *quota.Concurrency) *yaml.Node {
	m := mapping(true)
	add(m, "max_in_flight", uintNode(c.MaxInFlight))
	add(m, "lease_ttl", scalar("!!str", formatDuration(c.LeaseTTL)))
	return m
}

// unitName expresses d as the largest named unit that divides it, times a multiplier. A
// duration that is not a positive whole number of seconds is written as a Go duration, which
// Parse rejects: such a unit cannot come from a limits file.
func unitName(d time.Duration) (string, uint64) {
	for i := len(unitLengths) - 1; i >= 0; i-- {
		u := unitLengths[i]
		if d > 0 && d%u.d == 0 {
			return u.name, uint64(d / u.d)
		}
	}
	return d.String(), 1
}

// formatDuration writes d as time.Duration.String does, minus zero trailing fields ("1m", not
// "1m0s"); time.ParseDuration reads both.
func formatDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = s[:len(s)-2]
	}
	if strings.HasSuffix(s, "h0m") {
		s = s[:len(s)-2]
	}
	return s
}

func mapping(flow bool) *yaml.Node {
	m := &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map"}
	if flow {
		m.Style = yaml.FlowStyle
	}
	return m
}

func add(m *yaml.Node, key string, v *yaml.Node) {
	m.Content = append(m.Content, scalar("!!str", key), v)
}

func scalar(tag, value string) *yaml.Node {
	return &yaml.Node{Kind: yaml.ScalarNode, Tag: tag, Value: value}
}

func uintNode(v uint64) *yaml.Node {
	return scalar("!!int", strconv.FormatUint(v, 10))
}

// str renders a string so that it reads back as exactly the same string: plain when that is
// unambiguous, double-quoted otherwise (the encoder escapes what needs escaping).
func str(s string) *yaml.Node {
	s = strings.ToValidUTF8(s, "\uFFFD")
	n := scalar("!!str", s)
	if !plainSafe(s) {
		n.Style = yaml.DoubleQuotedStyle
	}
	return n
}

// plainSafe reports whether s can be written unquoted: a conservative character set, and not a
// word YAML would read as another type (the encoder adds quotes for those itself, too).
func plainSafe(s string) bool {
	if s == "" || !utf8.ValidString(s) {
		return false
	}
	for i, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '_':
		case i > 0 && (r == '-' || r == '.' || r == '/'):
		default:
			return false
		}
	}
	var v any
	if err := yaml.Unmarshal([]byte(s), &v); err != nil {
		return false
	}
	got, ok := v.(string)
	return ok && got == s
}
