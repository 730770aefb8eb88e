package config

import (
	"strconv"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/quotad/quotad/quota"
)

// Defaults of the adaptive block's optional fields.
const (
	DefaultDecreasePercent = 70
	DefaultIncrease        = 1
	DefaultStableWindow    = 5 * time.Second
)

var (
	adaptiveKeys    = []string{"floor", "decrease_percent", "increase", "stable_window"}
	retryBudgetKeys = []string{"ratio_percent", "min_per_second"}
	workClassKeys   = []string{"name", "reserve_percent"}
)

// domainPolicy parses the domain-level quotad extensions for fair sharing and feedback.
func (p *parser) domainPolicy(f map[string]field, d *quota.Domain) {
	if af, has := f["adaptive"]; has && !isNull(deref(af.val)) {
		d.Adaptive = p.adaptive(af, "adaptive", d.Rate, f["rate_limit"])
	}
	if rf, has := f["retry_budget"]; has && !isNull(deref(rf.val)) {
		d.RetryBudget = p.retryBudget(rf, "retry_budget")
	}
	if wf, has := f["work_classes"]; has {
		d.WorkClasses = p.workClasses(wf, "work_classes")
	}
	if jf, has := f["resume_jitter"]; has {
		if j, ok := p.duration(jf.val, "resume_jitter"); ok {
			if j > quota.MaxResumeJitter {
				p.errorf(jf.val, "resume_jitter", "%q is longer than %v; use a window of seconds, e.g. 2s", jf.val.Value, quota.MaxResumeJitter)
			} else {
				d.ResumeJitter = j
			}
		}
	}
	if mf, has := f["max_pause"]; has {
		if m, ok := p.duration(mf.val, "max_pause"); ok {
			if m > quota.MaxMaxPause {
				p.errorf(mf.val, "max_pause", "%q is longer than %v; a provider pause longer than that needs an operator, not a Retry-After", mf.val.Value, quota.MaxMaxPause)
			} else {
				d.MaxPause = m
			}
		}
	}
	if kf, has := f["max_keys"]; has {
		if v, ok := p.count(kf.val, "max_keys", quota.MaxMaxKeys,
			"; it caps the buckets the domain holds at once (default "+strconv.Itoa(quota.DefaultMaxKeys)+")"); ok {
			d.MaxKeys = v
		}
	}
}

// amount reads a whole number from 0 to maxValue.
func (p *parser) amount(n *yaml.Node, path string, maxValue uint64) (uint64, bool) {
	if d := deref(n); d != nil && d.Kind == yaml.ScalarNode && d.ShortTag() == "!!int" {
		var i int64
		if err := d.Decode(&i); err == nil && i == 0 {
			return 0, true
		}
	}
	return p.count(n, path, maxValue, "")
}

// adaptive parses an adaptive block on a level whose rate is rate (nil: none; rateField is the
// level's rate_limit field, to tell "no rate_limit" from "a rate_limit with errors").
func (p *parser) adaptive(af field, path string, rate *quota.Rate, rateField field) *quota.Adaptive {
	n := deref(af.val)
	if n.Kind != yaml.MappingNode {
		p.errorf(n, path, "expected a mapping like {floor: 10, decrease_percent: 70, increase: 1, stable_window: 5s}, got %s", describe(n))
		return nil
	}
	f := p.fields(n, path, adaptiveKeys)
	a := quota.Adaptive{DecreasePercent: DefaultDecreasePercent, Increase: DefaultIncrease, StableWindow: DefaultStableWindow}
	good := true
	if ff, has := f["floor"]; !has {
		p.missing(n, "floor", join(path, "floor"), "missing; add floor: N, the lowest requests_per_unit adaptation may go down to")
		good = false
	} else if v, ok := p.count(ff.val, join(path, "floor"), MaxUnits, ""); !ok {
		good = false
	} else if rate != nil && v > rate.RequestsPerUnit {
		p.errorf(ff.val, join(path, "floor"), "%d is above this level's requests_per_unit %d, which is the ceiling; use a floor of at most %d", v, rate.RequestsPerUnit, rate.RequestsPerUnit)
		good = false
	} else {
		a.Floor = v
	}
	if df, has := f["decrease_percent"]; has {
		if v, ok := p.count(df.val, join(path, "decrease_percent"), 99, "; it is the percentage of the rate kept on a confirmed 429, e.g. 70"); ok {
			a.DecreasePercent = uint32(v)
		} else {
			good = false
		}
	}
	if inf, has := f["increase"]; has {
		if v, ok := p.count(inf.val, join(path, "increase"), MaxUnits, ""); !ok {
			good = false
		} else if rate != nil && v > rate.RequestsPerUnit {
			p.errorf(inf.val, join(path, "increase"), "%d is above this level's requests_per_unit %d; add a small step, e.g. 1", v, rate.RequestsPerUnit)
			good = false
		} else {
			a.Increase = v
		}
	}
	if sf, has := f["stable_window"]; has {
		if d, ok := p.duration(sf.val, join(path, "stable_window")); ok {
			a.StableWindow = d
		} else {
			good = false
		}
	}
	if rate == nil && rateField.key == nil {
		p.errorf(af.key, path, "needs a rate_limit on the same level (its requests_per_unit is the ceiling adaptation stays under); add rate_limit or remove adaptive")
		good = false
	}
	if !good || rate == nil {
		return nil
	}
	return &a
}

func (p *parser) retryBudget(rf field, path string) *quota.RetryBudget {
	n := deref(rf.val)
	if n.Kind != yaml.MappingNode {
		p.errorf(n, path, "expected a mapping like {ratio_percent: 10, min_per_second: 1}, got %s", describe(n))
		return nil
	}
	f := p.fields(n, path, retryBudgetKeys)
	var b quota.RetryBudget
	good := true
	if pf, has := f["ratio_percent"]; !has {
		p.missing(n, "ratio_percent", join(path, "ratio_percent"), "missing; add ratio_percent: N, retries allowed as a percentage of first attempts, e.g. 10")
		good = false
	} else if v, ok := p.amount(pf.val, join(path, "ratio_percent"), 100); ok {
		b.RatioPercent = uint32(v)
	} else {
		good = false
	}
	if mf, has := f["min_per_second"]; has {
		if v, ok := p.amount(mf.val, join(path, "min_per_second"), MaxUnits/10); ok {
			b.MinPerSecond = v
		} else {
			good = false
		}
	}
	if good && b.RatioPercent == 0 && b.MinPerSecond == 0 {
		p.errorf(rf.key, path, "ratio_percent 0 and no min_per_second admit no retry at all; set ratio_percent (e.g. 10) or min_per_second, or remove retry_budget")
		good = false
	}
	if !good {
		return nil
	}
	return &b
}

func (p *parser) workClasses(wf field, path string) []quota.WorkClass {
	n := deref(wf.val)
	if isNull(n) {
		return nil
	}
	if n.Kind != yaml.SequenceNode {
		p.errorf(n, path, "expected a list like [{name: interactive, reserve_percent: 10}, {name: backfill}], got %s", describe(n))
		return nil
	}
	var out []quota.WorkClass
	seen := make(map[string]int)
	sum, good := uint64(0), true
	for i, item := range n.Content {
		ipath := path + "[" + strconv.Itoa(i) + "]"
		item = deref(item)
		if !p.visit(item) {
			return nil
		}
		if item == nil || item.Kind != yaml.MappingNode {
			p.errorf(item, ipath, "expected {name: CLASS, reserve_percent: N}, got %s", describe(item))
			good = false
			continue
		}
		f := p.fields(item, ipath, workClassKeys)
		var wc quota.WorkClass
		nf, has := f["name"]
		if !has {
			p.missing(item, "name", join(ipath, "name"), "missing; name the class, e.g. name: interactive")
			good = false
			continue
		}
		name, ok := p.str(nf.val, join(ipath, "name"), "name: interactive")
		switch {
		case !ok:
			good = false
			continue
		case name == "":
			p.errorf(nf.key, join(ipath, "name"), "\"\" is empty; name the class, e.g. name: interactive")
			good = false
			continue
		}
		if line, dup := seen[name]; dup {
			p.errorf(nf.val, join(ipath, "name"), "%q is already defined at line %d; each work class may appear once", name, line)
			good = false
			continue
		}
		seen[name] = nf.key.Line
		wc.Name = name
		if rf, has := f["reserve_percent"]; has {
			v, ok := p.amount(rf.val, join(ipath, "reserve_percent"), 100)
			if !ok {
				good = false
				continue
			}
			wc.ReservePercent = uint32(v)
			sum += v
		}
		out = append(out, wc)
	}
	if good && sum > 100 {
		p.errorf(wf.key, path, "the reserves add up to %d%%; they must total at most 100%%, so lower some reserve_percent", sum)
		good = false
	}
	if !good {
		return nil
	}
	return out
}
