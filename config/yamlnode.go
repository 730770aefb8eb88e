package config

import (
	"fmt"
	"regexp"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	"gopkg.in/yaml.v3"

	"github.com/quotad/quotad/quota"
)

// Limits on what one parse will walk. Aliases can make a small file expand into a huge tree
// ("billion laughs"); nested descriptors deeper than maxDepth are a mistake, not a design.
//
// The node budget follows what the file itself holds: its YAML nodes counted without
// following aliases (written), plus expandFactor times that for what aliases may add, at least
// minNodes, at most maxNodes — but never below written, so a file without aliases is never
// refused. Bytes do not count (a comment does not raise the budget), and a small file that
// aliases its way to millions of nodes stops after a walk proportional to what it wrote (CI:
// a 2.5 KB bomb took 0.6 s alone and > 10 s on a busy machine under a fixed 2^20 budget).
const (
	minNodes     = 1 << 16
	maxNodes     = 1 << 20
	expandFactor = 4
	maxDepth     = 32
)

// nodeBudget is how many YAML nodes the parse of documents holding written nodes may walk.
func nodeBudget(written int) int {
	return max(written, min(maxNodes, minNodes+expandFactor*written))
}

// writtenNodes counts the nodes of the decoded documents without following aliases.
func writtenNodes(docs []*yaml.Node) int {
	n := 0
	var walk func(*yaml.Node)
	walk = func(x *yaml.Node) {
		n++
		for _, c := range x.Content {
			walk(c)
		}
	}
	for _, d := range docs {
		walk(d)
	}
	return n
}

// parser walks yaml.Node trees and collects every problem it finds instead of stopping at the
// first one.
type parser struct {
	file      string
	errs      []*Error
	written   int // the file's YAML nodes without following aliases
	budget    int // nodeBudget(written)
	nodesLeft int
	exhausted bool
	// typos remembers, per mapping, the allowed keys that an unknown key was taken to be a
	// misspelling of, so that the key is not also reported missing.
	typos map[*yaml.Node]map[string]bool
	// scopeAt remembers where each rate_limit with a scope was written (checkScopes).
	scopeAt map[*quota.Rate]position
}

// position is where a field was written: its line and key path.
type position struct {
	line int
	path string
}

// missing reports a required key absent from mapping m, unless an unknown key in m was
// already reported as its misspelling.
func (p *parser) missing(m *yaml.Node, key, path, format string, args ...any) {
	if p.typos[m][key] {
		return
	}
	p.errorf(m, path, format, args...)
}

func (p *parser) errorf(n *yaml.Node, path, format string, args ...any) {
	line := 0
	if n != nil {
		line = n.Line
	}
	p.errs = append(p.errs, newError(p.file, line, path, format, args...))
}

// visit charges one node against the parse budget; false means stop walking.
func (p *parser) visit(n *yaml.Node) bool {
	if p.exhausted {
		return false
	}
	p.nodesLeft--
	if p.nodesLeft < 0 {
		p.exhausted = true
		p.errorf(n, "", "the document expands to more than %d YAML nodes through anchors and aliases (it writes %d; the walk allows %d + %d per written node, at most %d); write the repeated parts out or split the file", p.budget, p.written, minNodes, expandFactor, maxNodes)
		return false
	}
	return true
}

// deref follows aliases to the node they name.
func deref(n *yaml.Node) *yaml.Node {
	for i := 0; n != nil && n.Kind == yaml.AliasNode && i < 100; i++ {
		n = n.Alias
	}
	return n
}

func isNull(n *yaml.Node) bool {
	return n == nil || (n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null")
}

// describe names a node's value for an error message: scalars quoted, others by kind.
func describe(n *yaml.Node) string {
	n = deref(n)
	switch {
	case n == nil:
		return "nothing"
	case n.Kind == yaml.MappingNode:
		return "a mapping"
	case n.Kind == yaml.SequenceNode:
		return "a list"
	case isNull(n):
		return "empty"
	case n.ShortTag() == "!!str":
		return fmt.Sprintf("%q", n.Value)
	default:
		return n.Value
	}
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// field is one key: value pair of a YAML mapping.
type field struct {
	key, val *yaml.Node
}

// fields returns the pairs of mapping m by key name. It reports (and drops) keys that are not
// in allowed, keys that are not plain names, and keys given twice; merge keys ("<<: *base") are
// expanded, explicit keys winning over merged ones as in YAML 1.1.
func (p *parser) fields(m *yaml.Node, path string, allowed []string) map[string]field {
	out := make(map[string]field)
	p.collectFields(m, path, allowed, out, 0)
	return out
}

func (p *parser) collectFields(m *yaml.Node, path string, allowed []string, out map[string]field, mergeDepth int) {
	var merges []*yaml.Node
	explicit := make(map[string]bool)
	for i := 0; i+1 < len(m.Content); i += 2 {
		k, v := m.Content[i], m.Content[i+1]
		if !p.visit(k) {
			return
		}
		if k.Kind == yaml.ScalarNode && k.ShortTag() == "!!merge" {
			merges = append(merges, v)
			continue
		}
		dk := deref(k)
		if dk == nil || dk.Kind != yaml.ScalarNode || isNull(dk) {
			p.errorf(k, path, "a key must be a plain name, not %s; use one of %s", describe(k), strings.Join(allowed, ", "))
			continue
		}
		name := dk.Value
		if !contains(allowed, name) {
			hint := ""
			if s := suggest(name, allowed); s != "" {
				hint = fmt.Sprintf("did you mean %q? ", s)
				if p.typos == nil {
					p.typos = make(map[*yaml.Node]map[string]bool)
				}
				if p.typos[m] == nil {
					p.typos[m] = make(map[string]bool)
				}
				p.typos[m][s] = true
			}
			p.errorf(k, join(path, name), "unknown key %q; %sallowed here: %s", name, hint, strings.Join(allowed, ", "))
			continue
		}
		if explicit[name] {
			p.errorf(k, join(path, name), "key %q is given twice in this mapping (first at line %d); keep one", name, out[name].key.Line)
			continue
		}
		explicit[name] = true
		out[name] = field{key: k, val: v}
	}
	if mergeDepth > 8 {
		if len(merges) > 0 {
			p.errorf(merges[0], path, "merge keys (<<) nested more than 8 deep; flatten them")
		}
		return
	}
	for _, mv := range merges {
		mv = deref(mv)
		var sources []*yaml.Node
		switch {
		case mv != nil && mv.Kind == yaml.MappingNode:
			sources = []*yaml.Node{mv}
		case mv != nil && mv.Kind == yaml.SequenceNode:
			for _, s := range mv.Content {
				sources = append(sources, deref(s))
			}
		default:
			p.errorf(mv, join(path, "<<"), "a merge key needs a mapping or a list of mappings, not %s", describe(mv))
			continue
		}
		for _, src := range sources {
			if src == nil || src.Kind != yaml.MappingNode {
				p.errorf(mv, join(path, "<<"), "a merge key needs a mapping or a list of mappings, not %s", describe(src))
				continue
			}
			merged := make(map[string]field)
			p.collectFields(src, path, allowed, merged, mergeDepth+1)
			for name, f := range merged {
				if _, ok := out[name]; !ok {
					out[name] = f
				}
			}
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// suggest returns the allowed key closest to name if it is close enough to be a typo.
func suggest(name string, allowed []string) string {
	best, bestD := "", 3
	lower := strings.ToLower(name)
	for _, a := range allowed {
		if d := editDistance(lower, a); d < bestD {
			best, bestD = a, d
		}
	}
	return best
}

func editDistance(a, b string) int {
	if len(a) > 64 || len(b) > 64 {
		return 64
	}
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// str reads a string scalar. Any scalar is accepted as its text (value: 200 is "200", as in
// envoy), null is "" (absent), mappings and lists are errors.
func (p *parser) str(n *yaml.Node, path, example string) (string, bool) {
	n = deref(n)
	switch {
	case isNull(n):
		return "", true
	case n.Kind != yaml.ScalarNode:
		p.errorf(n, path, "expected a string, got %s; write e.g. %s", describe(n), example)
		return "", false
	case !utf8.ValidString(n.Value):
		p.errorf(n, path, "%q is not valid UTF-8; use UTF-8 text", n.Value)
		return "", false
	}
	return n.Value, true
}

// count reads a whole number of at least 1 and at most maxValue. what names the field's meaning
// for the message.
func (p *parser) count(n *yaml.Node, path string, maxValue uint64, zeroHint string) (uint64, bool) {
	n = deref(n)
	if n == nil || n.Kind != yaml.ScalarNode || isNull(n) {
		p.errorf(n, path, "expected a whole number, got %s; write e.g. %s: 10", describe(n), lastKey(path))
		return 0, false
	}
	switch n.ShortTag() {
	case "!!int":
	case "!!str":
		p.errorf(n, path, "%q is a string; write the number without quotes, e.g. %s: 10", n.Value, lastKey(path))
		return 0, false
	case "!!float":
		if wholeNumberRE.MatchString(n.Value) { // too many digits for an integer
			p.errorf(n, path, "%s is too large; use at most %d", n.Value, maxValue)
			return 0, false
		}
		p.errorf(n, path, "%s is not a whole number; use digits only, e.g. %s: 10", n.Value, lastKey(path))
		return 0, false
	default:
		p.errorf(n, path, "%s is not a number; write e.g. %s: 10", describe(n), lastKey(path))
		return 0, false
	}
	var i int64
	if err := n.Decode(&i); err == nil {
		switch {
		case i < 0:
			p.errorf(n, path, "%s is negative; use a whole number of at least 1", n.Value)
			return 0, false
		case i == 0:
			p.errorf(n, path, "0 is not allowed; use at least 1%s", zeroHint)
			return 0, false
		case uint64(i) > maxValue:
			p.errorf(n, path, "%s is too large; use at most %d", n.Value, maxValue)
			return 0, false
		}
		return uint64(i), true
	}
	var u uint64
	if err := n.Decode(&u); err == nil && u <= maxValue {
		return u, true
	}
	p.errorf(n, path, "%s is too large; use at most %d", n.Value, maxValue)
	return 0, false
}

var wholeNumberRE = regexp.MustCompile(`^[-+]?[0-9][0-9_]*$`)

func (p *parser) boolean(n *yaml.Node, path string) (bool, bool) {
	n = deref(n)
	if n != nil && n.Kind == yaml.ScalarNode && n.ShortTag() == "!!bool" {
		var b bool
		if err := n.Decode(&b); err == nil {
			return b, true
		}
	}
	// envoyproxy/ratelimit reads YAML 1.1, where unquoted yes/no/on/off/y/n are booleans too.
	if n != nil && n.Kind == yaml.ScalarNode && n.Style == 0 {
		if b, ok := yaml11Bools[n.Value]; ok {
			return b, true
		}
	}
	p.errorf(n, path, "%s is not a boolean; use true or false (without quotes)", describe(n))
	return false, false
}

var yaml11Bools = map[string]bool{
	"y": true, "Y": true, "yes": true, "Yes": true, "YES": true, "on": true, "On": true, "ON": true,
	"n": false, "N": false, "no": false, "No": false, "NO": false, "off": false, "Off": false, "OFF": false,
}

func (p *parser) duration(n *yaml.Node, path string) (time.Duration, bool) {
	n = deref(n)
	if n == nil || n.Kind != yaml.ScalarNode || isNull(n) {
		p.errorf(n, path, "expected a duration, got %s; use a Go duration such as \"30s\" or \"2m\"", describe(n))
		return 0, false
	}
	d, err := time.ParseDuration(n.Value)
	if err != nil {
		hint := ""
		if n.ShortTag() == "!!int" {
			hint = " (a bare number has no unit)"
		}
		p.errorf(n, path, "%q is not a duration%s; use a Go duration such as \"30s\" or \"2m\"", n.Value, hint)
		return 0, false
	}
	if d <= 0 {
		p.errorf(n, path, "%q is not positive; use a duration above zero such as \"30s\"", n.Value)
		return 0, false
	}
	return d, true
}

func lastKey(path string) string {
	if i := strings.LastIndexByte(path, '.'); i >= 0 {
		return path[i+1:]
	}
	return path
}

// sortErrors orders errors by file and line so that a long report reads top to bottom.
func sortErrors(errs []*Error) {
	sort.SliceStable(errs, func(i, j int) bool {
		if errs[i].File != errs[j].File {
			return errs[i].File < errs[j].File
		}
		return errs[i].Line < errs[j].Line
	})
}
