package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/quotad/quotad/quota"
)

// MaxUnits caps requests_per_unit, burst and max_in_flight. The engine keeps tokens in
// micro-units in a uint64, so amounts much above 10^13 would overflow; 10^12 leaves room.
const MaxUnits uint64 = 1_000_000_000_000

// DefaultLeaseTTL is the lease_ttl of a concurrency block that does not set one.
const DefaultLeaseTTL = 30 * time.Second

// unitLengths are the accepted rate_limit.unit names, shortest first. Month and year have fixed
// lengths (30 and 365 days) because a bucket refills at a constant rate.
var unitLengths = []struct {
	name string
	d    time.Duration
}{
	{"second", time.Second},
	{"minute", time.Minute},
	{"hour", time.Hour},
	{"day", 24 * time.Hour},
	{"week", 7 * 24 * time.Hour},
	{"month", 30 * 24 * time.Hour},
	{"year", 365 * 24 * time.Hour},
}

const unitChoices = "second, minute, hour, day, week, month or year"

// Keys allowed at each level. Order is the order used in messages.
var (
	documentKeys    = []string{"domain", "rate_limit", "concurrency", "adaptive", "retry_budget", "work_classes", "resume_jitter", "max_pause", "max_keys", "strict_keys", "shares", "descriptors"}
	descriptorKeys  = []string{"key", "value", "rate_limit", "unlimited", "shadow_mode", "quota_mode", "detailed_metric", "value_to_metric", "share_threshold", "max_keys_per_parent", "name", "replaces", "weight", "concurrency", "adaptive", "shares", "descriptors"}
	domainRateKeys  = []string{"unit", "requests_per_unit", "unit_multiplier", "burst", "scope"}
	levelRateKeys   = []string{"unit", "requests_per_unit", "unit_multiplier", "burst", "scope", "unlimited", "name", "replaces"}
	concurrencyKeys = []string{"max_in_flight", "lease_ttl"}
	replacesKeys    = []string{"name"}
)

// Parse parses one limits file's bytes into Limits (Version 0). name is used in messages only.
// On error the result is nil and the error joins one *Error per problem found.
func Parse(name string, data []byte) (*quota.Limits, error) {
	domains, errs := parseFile(name, data)
	errs = append(errs, checkDuplicates(domains)...)
	errs = append(errs, checkScopes(domains)...)
	if len(errs) > 0 {
		return nil, joinErrors(errs)
	}
	return assemble(domains), nil
}

// LoadFile reads and parses the limits file at path.
func LoadFile(path string) (*quota.Limits, error) {
	return LoadFiles(path)
}

// LoadFiles reads and parses limits files and merges them; a domain may appear only once across
// all of them. A path that is a directory stands for its *.yaml and *.yml files in name order
// (not recursively).
func LoadFiles(paths ...string) (*quota.Limits, error) {
	var (
		domains []parsedDomain
		errs    []*Error
	)
	for _, path := range paths {
		files, err := expand(path)
		if err != nil {
			errs = append(errs, newError(path, 0, "", "%v", err))
			continue
		}
		for _, f := range files {
			data, err := os.ReadFile(f)
			if err != nil {
				errs = append(errs, newError(f, 0, "", "%v", err))
				continue
			}
			ds, es := parseFile(f, data)
			domains = append(domains, ds...)
			errs = append(errs, es...)
		}
	}
	errs = append(errs, checkDuplicates(domains)...)
	errs = append(errs, checkScopes(domains)...)
	if len(errs) > 0 {
		return nil, joinErrors(errs)
	}
	return assemble(domains), nil
}

func expand(path string) ([]string, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if !st.IsDir() {
		return []string{path}, nil
	}
	entries, err := os.ReadDir(path)
	if err != nil {
		return nil, err
	}
	var files []string
	for _, e := range entries {
		ext := strings.ToLower(filepath.Ext(e.Name()))
		if !e.IsDir() && (ext == ".yaml" || ext == ".yml") {
			files = append(files, filepath.Join(path, e.Name()))
		}
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("directory has no .yaml or .yml files; put limits files there or name a file")
	}
	return files, nil
}

// Merge combines Limits parsed from several files into one (Version 0), rejecting a domain that
// appears in more than one. The result shares descriptor trees with its inputs.
func Merge(parts ...*quota.Limits) (*quota.Limits, error) {
	var domains []parsedDomain
	for i, l := range parts {
		if l == nil {
			continue
		}
		for _, d := range l.Domains {
			domains = append(domains, parsedDomain{Domain: d, file: fmt.Sprintf("input %d", i+1)})
		}
	}
	if errs := checkDuplicates(domains); len(errs) > 0 {
		for _, e := range errs {
			e.File = "" // positions are not known after parsing
		}
		return nil, joinErrors(errs)
	}
	return assemble(domains), nil
}

// parsedDomain remembers where a domain was defined, for duplicate-domain messages, and where
// its levels' rate_limit scopes were written, for scope messages.
type parsedDomain struct {
	quota.Domain
	file    string
	line    int
	scopeAt map[*quota.Rate]position
}

func assemble(domains []parsedDomain) *quota.Limits {
	l := &quota.Limits{}
	for _, d := range domains {
		l.Domains = append(l.Domains, d.Domain)
	}
	sort.SliceStable(l.Domains, func(i, j int) bool { return l.Domains[i].Name < l.Domains[j].Name })
	return l
}

func checkDuplicates(domains []parsedDomain) []*Error {
	var errs []*Error
	first := make(map[string]parsedDomain)
	for _, d := range domains {
		prev, dup := first[d.Name]
		if !dup {
			first[d.Name] = d
			continue
		}
		where := prev.file
		if prev.line > 0 {
			where += ":" + strconv.Itoa(prev.line)
		}
		errs = append(errs, newError(d.file, d.line, "domain",
			"%q is already defined at %s; each domain may appear once, so merge the two documents or rename one", d.Name, where))
	}
	return errs
}

func joinErrors(errs []*Error) error {
	sortErrors(errs)
	list := make([]error, len(errs))
	for i, e := range errs {
		list[i] = e
	}
	return errors.Join(list...)
}

// parseFile parses every document of one file. Documents with errors are left out of the
// result; their errors are returned.
func parseFile(name string, data []byte) ([]parsedDomain, []*Error) {
	docs, synErr := decodeAll(name, data)
	p := &parser{file: name, written: writtenNodes(docs)}
	p.budget = nodeBudget(p.written)
	p.nodesLeft = p.budget
	var domains []parsedDomain
	for _, doc := range docs {
		before := len(p.errs)
		d, ok := p.document(doc)
		if ok && len(p.errs) == before {
			d.scopeAt = p.scopeAt
			domains = append(domains, d)
		} else if ok {
			// Keep the name so a duplicate is still reported, but not the broken contents.
			domains = append(domains, parsedDomain{Domain: quota.Domain{Name: d.Name}, file: d.file, line: d.line})
		}
	}
	if synErr != nil {
		p.errs = append(p.errs, synErr)
	}
	if len(p.errs) > 0 {
		return domains, p.errs
	}
	return domains, nil
}

var yamlLineRE = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)

// decodeAll splits data into YAML documents. The recover guards against parser bugs only: this
// package promises never to panic on any input.
func decodeAll(name string, data []byte) (docs []*yaml.Node, synErr *Error) {
	defer func() {
		if r := recover(); r != nil {
			synErr = newError(name, 0, "", "the YAML parser failed (%v); check the file's syntax", r)
		}
	}()
	dec := yaml.NewDecoder(bytes.NewReader(data))
	for {
		var n yaml.Node
		err := dec.Decode(&n)
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			msg := strings.TrimPrefix(err.Error(), "yaml: ")
			line := 0
			if m := yamlLineRE.FindStringSubmatch(err.Error()); m != nil {
				line, _ = strconv.Atoi(m[1])
				msg = m[2]
			}
			return docs, newError(name, line, "", "invalid YAML: %s; fix the syntax (indentation, colons, quotes)", msg)
		}
		docs = append(docs, &n)
	}
}

// document parses one YAML document into a domain. ok is false for empty documents and for
// documents without a usable domain name.
func (p *parser) document(doc *yaml.Node) (parsedDomain, bool) {
	root := doc
	if doc.Kind == yaml.DocumentNode {
		if len(doc.Content) == 0 {
			return parsedDomain{}, false
		}
		root = doc.Content[0]
	}
	root = deref(root)
	if isNull(root) {
		return parsedDomain{}, false
	}
	if root.Kind != yaml.MappingNode {
		p.errorf(root, "", "a limits document must be a mapping that starts with domain: NAME, not %s", describe(root))
		return parsedDomain{}, false
	}
	f := p.fields(root, "", documentKeys)
	out := parsedDomain{file: p.file, line: root.Line}
	ok := false
	if df, has := f["domain"]; !has {
		p.missing(root, "domain", "domain", "missing; start the document with the domain it limits, e.g. domain: provider")
	} else if name, good := p.str(df.val, "domain", "domain: provider"); good {
		if name == "" {
			p.errorf(df.key, "domain", "\"\" is empty; name the domain, e.g. domain: provider")
		} else {
			out.Name, out.line, ok = name, df.key.Line, true
		}
	}
	if rf, has := f["rate_limit"]; has && !isNull(deref(rf.val)) {
		out.Rate = p.rateLimit(rf.val, "rate_limit", true).rate
	}
	if cf, has := f["concurrency"]; has && !isNull(deref(cf.val)) {
		out.Concurrency = p.concurrency(cf.val, "concurrency")
	}
	p.domainPolicy(f, &out.Domain)
	if sf, has := f["strict_keys"]; has {
		out.StrictKeys, _ = p.boolean(sf.val, "strict_keys")
	}
	if sf, has := f["shares"]; has && !isNull(deref(sf.val)) {
		out.Shares = p.shares(sf.key, sf.val, "shares", out.Rate)
	}
	if df, has := f["descriptors"]; has {
		out.Descriptors = p.descriptors(df.val, "descriptors", 1)
	}
	return out, ok
}

func (p *parser) descriptors(n *yaml.Node, path string, depth int) []quota.Node {
	n = deref(n)
	if isNull(n) {
		return nil
	}
	if n.Kind != yaml.SequenceNode {
		p.errorf(n, path, "expected a list of descriptors (lines starting with \"- key:\"), got %s", describe(n))
		return nil
	}
	if depth > maxDepth {
		p.errorf(n, path, "descriptors are nested more than %d levels deep; flatten the tree", maxDepth)
		return nil
	}
	var out []quota.Node
	type kv struct{ key, value string }
	seen := make(map[kv]int)
	for i, item := range n.Content {
		ipath := path + "[" + strconv.Itoa(i) + "]"
		item = deref(item)
		if !p.visit(item) {
			return out
		}
		if item == nil || item.Kind != yaml.MappingNode {
			p.errorf(item, ipath, "expected a descriptor mapping (key: ..., rate_limit: ...), got %s", describe(item))
			continue
		}
		d, ok := p.descriptor(item, ipath, depth)
		if !ok {
			continue
		}
		id := kv{d.Key, d.Value}
		if line, dup := seen[id]; dup {
			what := fmt.Sprintf("key %q", d.Key)
			if d.Value != "" {
				what += fmt.Sprintf(" with value %q", d.Value)
			} else {
				what += " without a value"
			}
			p.errorf(item, ipath, "%s is already defined at line %d under the same parent; merge the two entries or remove one", what, line)
			continue
		}
		seen[id] = item.Line
		out = append(out, d)
	}
	return out
}

// descriptor parses one level. ok is false when the level has no usable key.
func (p *parser) descriptor(n *yaml.Node, path string, depth int) (quota.Node, bool) {
	f := p.fields(n, path, descriptorKeys)
	var d quota.Node
	ok := false
	if kf, has := f["key"]; !has {
		p.missing(n, "key", join(path, "key"), "missing; every descriptor needs a key, e.g. key: tenant")
	} else if key, good := p.str(kf.val, join(path, "key"), "key: tenant"); good {
		if key == "" {
			p.errorf(kf.key, join(path, "key"), "\"\" is empty; every descriptor needs a key, e.g. key: tenant")
		} else {
			d.Key, ok = key, true
		}
	}
	if vf, has := f["value"]; has {
		d.Value, _ = p.str(vf.val, join(path, "value"), "value: chat")
	}

	var spec rateSpec
	if rf, has := f["rate_limit"]; has && !isNull(deref(rf.val)) {
		spec = p.rateLimit(rf.val, join(path, "rate_limit"), false)
		d.Rate = spec.rate
	}
	d.Unlimited = spec.unlimited
	if uf, has := f["unlimited"]; has {
		if spec.unlimitedKey != nil {
			p.errorf(uf.key, join(path, "unlimited"), "is set both here and in rate_limit (line %d); keep one", spec.unlimitedKey.Line)
		} else if u, good := p.boolean(uf.val, join(path, "unlimited")); good {
			if u && d.Rate != nil {
				p.errorf(uf.key, join(path, "unlimited"), "true cannot be combined with a rate_limit (line %d); remove one", f["rate_limit"].key.Line)
			}
			d.Unlimited = u
		}
	}
	d.Name = spec.name
	if nf, has := f["name"]; has {
		if spec.nameKey != nil {
			p.errorf(nf.key, join(path, "name"), "is set both here and in rate_limit (line %d); keep one", spec.nameKey.Line)
		} else {
			d.Name, _ = p.str(nf.val, join(path, "name"), "name: chat-limit")
		}
	}
	d.Replaces = spec.replaces
	replacesKey := spec.replacesKey
	replacesPath := join(path, "rate_limit.replaces")
	if rf, has := f["replaces"]; has {
		if spec.replacesKey != nil {
			p.errorf(rf.key, join(path, "replaces"), "is set both here and in rate_limit (line %d); keep one", spec.replacesKey.Line)
		} else {
			replacesKey, replacesPath = rf.key, join(path, "replaces")
			d.Replaces = p.replaces(rf.val, replacesPath)
		}
	}
	if d.Name != "" && contains(d.Replaces, d.Name) {
		p.errorf(replacesKey, replacesPath, "names this limit's own name %q; a limit cannot replace itself", d.Name)
	}
	if sf, has := f["shadow_mode"]; has {
		d.ShadowMode, _ = p.boolean(sf.val, join(path, "shadow_mode"))
	}
	if qf, has := f["quota_mode"]; has {
		d.QuotaMode, _ = p.boolean(qf.val, join(path, "quota_mode"))
	}
	if mf, has := f["detailed_metric"]; has {
		d.DetailedMetric, _ = p.boolean(mf.val, join(path, "detailed_metric"))
	}
	if mf, has := f["value_to_metric"]; has {
		d.ValueToMetric, _ = p.boolean(mf.val, join(path, "value_to_metric"))
	}
	if tf, has := f["share_threshold"]; has {
		if st, ok := p.boolean(tf.val, join(path, "share_threshold")); ok && st && !quota.IsWildcard(d.Value) {
			p.errorf(tf.key, join(path, "share_threshold"), "needs a wildcard value (ending in *, e.g. value: files/*), not %q; remove share_threshold or make the value a wildcard", d.Value)
		} else {
			d.ShareThreshold = st
		}
	}
	if kf, has := f["max_keys_per_parent"]; has {
		kp := join(path, "max_keys_per_parent")
		if v, ok := p.count(kf.val, kp, quota.MaxMaxKeys, "; it caps this level's buckets under one value of its parent (omit it for no cap but max_keys)"); ok {
			switch {
			case d.Value != "" && !quota.IsWildcard(d.Value):
				p.errorf(kf.key, kp, "is set on a level with value %q, which is one bucket; set it on a level without a value (one bucket per distinct value, e.g. key: consumer under key: tenant)", d.Value)
			case d.Rate == nil:
				p.errorf(kf.key, kp, "needs a rate_limit on its level (only rate-limited levels store buckets); add one or remove max_keys_per_parent")
			default:
				d.MaxKeysPerParent = v
			}
		}
	}
	if wf, has := f["weight"]; has {
		w, _ := p.count(wf.val, join(path, "weight"), math.MaxUint32, "; 1 is the default share")
		d.Weight = uint32(w)
	}
	if cf, has := f["concurrency"]; has && !isNull(deref(cf.val)) {
		d.Concurrency = p.concurrency(cf.val, join(path, "concurrency"))
	}
	if af, has := f["adaptive"]; has && !isNull(deref(af.val)) {
		d.Adaptive = p.adaptive(af, join(path, "adaptive"), d.Rate, f["rate_limit"])
	}
	if sf, has := f["shares"]; has && !isNull(deref(sf.val)) {
		d.Shares = p.shares(sf.key, sf.val, join(path, "shares"), d.Rate)
	}
	if df, has := f["descriptors"]; has {
		d.Children = p.descriptors(df.val, join(path, "descriptors"), depth+1)
	}
	return d, ok
}

// rateSpec is a parsed rate_limit block. The *Key fields remember where envoy-style fields
// were given, to reject the same field also given on the descriptor.
type rateSpec struct {
	rate                               *quota.Rate
	unlimited                          bool
	name                               string
	replaces                           []string
	unlimitedKey, nameKey, replacesKey *yaml.Node
}

func (p *parser) rateLimit(n *yaml.Node, path string, domainLevel bool) rateSpec {
	var spec rateSpec
	n = deref(n)
	if n == nil || n.Kind != yaml.MappingNode {
		p.errorf(n, path, "expected a mapping like {unit: second, requests_per_unit: 10}, got %s", describe(n))
		return spec
	}
	allowed := levelRateKeys
	zeroHint := " (or unlimited: true to leave this level unlimited)"
	if domainLevel {
		allowed = domainRateKeys
		zeroHint = " (or remove rate_limit to have no domain ceiling)"
	}
	f := p.fields(n, path, allowed)
	if uf, has := f["unlimited"]; has {
		spec.unlimitedKey = uf.key
		spec.unlimited, _ = p.boolean(uf.val, join(path, "unlimited"))
	}
	if nf, has := f["name"]; has {
		spec.nameKey = nf.key
		spec.name, _ = p.str(nf.val, join(path, "name"), "name: chat-limit")
	}
	if rf, has := f["replaces"]; has {
		spec.replacesKey = rf.key
		spec.replaces = p.replaces(rf.val, join(path, "replaces"))
	}
	// envoy accepts (and ignores) requests_per_unit beside unlimited: true, so quotad does.
	amounts := []string{"unit", "unit_multiplier", "burst"}
	if spec.unlimited {
		for _, k := range amounts {
			if af, has := f[k]; has {
				p.errorf(af.key, join(path, k), "cannot be combined with unlimited: true (line %d); remove %s or set unlimited: false", spec.unlimitedKey.Line, k)
			}
		}
		return spec
	}
	unitF, hasUnit := f["unit"]
	rpuF, hasRPU := f["requests_per_unit"]
	if !hasUnit && !hasRPU {
		alt := ""
		if !domainLevel {
			alt = " (or unlimited: true)"
		}
		p.errorf(n, path, "needs unit and requests_per_unit, e.g. {unit: second, requests_per_unit: 10}%s", alt)
		return spec
	}
	good := true
	unit := time.Duration(0)
	if !hasUnit {
		p.missing(n, "unit", join(path, "unit"), "missing; add unit: %s", unitChoices)
		good = false
	} else if s, ok := p.str(unitF.val, join(path, "unit"), "unit: second"); !ok {
		good = false
	} else if unit = unitLength(s); unit == 0 {
		p.errorf(unitF.val, join(path, "unit"), "%q is not a unit; use %s", s, unitChoices)
		good = false
	}
	var rpu uint64
	switch {
	case !hasRPU && domainLevel:
		p.missing(n, "requests_per_unit", join(path, "requests_per_unit"), "missing; add requests_per_unit: N, the units allowed per %s", orDefault(unitF.val, "unit"))
		good = false
	case !hasRPU:
		// envoy reads a missing requests_per_unit as 0: the level blocks every request.
	case domainLevel:
		if v, ok := p.count(rpuF.val, join(path, "requests_per_unit"), MaxUnits, zeroHint); ok {
			rpu = v
		} else {
			good = false
		}
	default: // 0 blocks, as in envoy
		if v, ok := p.amount(rpuF.val, join(path, "requests_per_unit"), MaxUnits); ok {
			rpu = v
		} else {
			good = false
		}
	}
	if mf, has := f["unit_multiplier"]; has {
		maxMult := uint64(math.MaxInt64 / int64(time.Second))
		if unit > 0 {
			maxMult = uint64(math.MaxInt64 / int64(unit))
		}
		if m, ok := p.count(mf.val, join(path, "unit_multiplier"), maxMult, "; omit unit_multiplier for the unit itself"); ok {
			unit *= time.Duration(m)
		} else {
			good = false
		}
	}
	// Without burst the bucket holds one unit's worth (quota.Rate.Burst 0 means
	// requests_per_unit): stored as 0, not as the number, so that `limits get` can leave it out
	// and a file edited from its output keeps following requests_per_unit.
	burst := uint64(0)
	if bf, has := f["burst"]; has {
		if rpu == 0 && good {
			p.errorf(bf.key, join(path, "burst"), "cannot be combined with requests_per_unit 0, which blocks every request; remove burst or raise requests_per_unit")
			good = false
		} else if b, ok := p.count(bf.val, join(path, "burst"), MaxUnits, "; omit burst for one unit's worth (requests_per_unit)"); ok {
			burst = b
		} else {
			good = false
		}
	}
	scope, scopeOK := p.scope(f, path)
	if good && scopeOK {
		spec.rate = &quota.Rate{Unit: unit, RequestsPerUnit: rpu, Burst: burst, Scope: scope}
		if sf, has := f["scope"]; has {
			if p.scopeAt == nil {
				p.scopeAt = make(map[*quota.Rate]position)
			}
			p.scopeAt[spec.rate] = position{line: sf.key.Line, path: join(path, "scope")}
		}
	}
	return spec
}

func orDefault(n *yaml.Node, def string) string {
	if n = deref(n); n != nil && n.Kind == yaml.ScalarNode && n.Value != "" {
		return n.Value
	}
	return def
}

// unitLength returns the duration of a unit name, or 0 if it is not one.
func unitLength(name string) time.Duration {
	name = strings.ToLower(name)
	for _, u := range unitLengths {
		if u.name == name {
			return u.d
		}
	}
	return 0
}

func (p *parser) replaces(n *yaml.Node, path string) []string {
	n = deref(n)
	if isNull(n) {
		return nil
	}
	if n.Kind != yaml.SequenceNode {
		p.errorf(n, path, "expected a list like [{name: other-limit}], got %s", describe(n))
		return nil
	}
	var out []string
	for i, item := range n.Content {
		ipath := path + "[" + strconv.Itoa(i) + "]"
		item = deref(item)
		if !p.visit(item) {
			return out
		}
		if item == nil || item.Kind != yaml.MappingNode {
			p.errorf(item, ipath, "expected {name: LIMIT}, got %s; write - name: other-limit", describe(item))
			continue
		}
		f := p.fields(item, ipath, replacesKeys)
		nf, has := f["name"]
		if !has {
			p.missing(item, "name", join(ipath, "name"), "missing; name the limit this one replaces, e.g. - name: other-limit")
			continue
		}
		name, ok := p.str(nf.val, join(ipath, "name"), "name: other-limit")
		if !ok {
			continue
		}
		if name == "" {
			p.errorf(nf.key, join(ipath, "name"), "\"\" is empty; name the limit this one replaces, e.g. - name: other-limit")
			continue
		}
		out = append(out, name)
	}
	return out
}

func (p *parser) concurrency(n *yaml.Node, path string) *quota.Concurrency {
	n = deref(n)
	if n == nil || n.Kind != yaml.MappingNode {
		p.errorf(n, path, "expected a mapping like {max_in_flight: 10, lease_ttl: 30s}, got %s", describe(n))
		return nil
	}
	f := p.fields(n, path, concurrencyKeys)
	c := quota.Concurrency{LeaseTTL: DefaultLeaseTTL}
	good := true
	if mf, has := f["max_in_flight"]; !has {
		p.missing(n, "max_in_flight", join(path, "max_in_flight"), "missing; add max_in_flight: N, the permits that may be held at once")
		good = false
	} else if m, ok := p.count(mf.val, join(path, "max_in_flight"), MaxUnits, ""); ok {
		c.MaxInFlight = m
	} else {
		good = false
	}
	if lf, has := f["lease_ttl"]; has {
		if d, ok := p.duration(lf.val, join(path, "lease_ttl")); ok {
			c.LeaseTTL = d
		} else {
			good = false
		}
	}
	if !good {
		return nil
	}
	return &c
}
