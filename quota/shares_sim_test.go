package quota

import (
	"fmt"
	"math"
	"time"
)

// A simulated world for share tests: one engine, holders that follow the holder's side of
// the protocol exactly (anchor at send time, apply then acknowledge, first grants replace the
// local balance, renewals carry it clamped to the new b, stop at end − m_H), central callers,
// and every admission recorded in real time for the bounded-admission check.

type simWorld struct {
	t    interface{ Fatal(...any) }
	e    *Engine
	real Time // real time
	// fsmFast: the leader's clock runs this much fast (FSM time = real × (1+fsmFast)).
	fsmFast float64
	adm     []simAdm
	// needsFirst: renewals are allocated as command version 4 entries are (needsFirstFill).
	needsFirst bool
}

type simAdm struct {
	at   Time
	cost uint64
	who  string
	path string // the tenant, "" for the domain only
}

func newSimWorld(t interface{ Fatal(...any) }, l *Limits) *simWorld {
	e := NewEngine()
	if err := e.SetLimits(0, l); err != nil {
		t.Fatal(err)
	}
	return &simWorld{t: t, e: e}
}

func (w *simWorld) fsmNow() Time { return Time(float64(w.real) * (1 + w.fsmFast)) }

func (w *simWorld) advance(d time.Duration) { w.real += Time(d) }

// central asks the engine for cost units on domain/descs; it records an admission.
func (w *simWorld) central(domain string, descs []Entry, cost uint64) bool {
	d := w.e.Acquire(w.fsmNow(), Request{Domain: domain, Descriptors: descs, Cost: cost})
	if d.Admitted {
		w.adm = append(w.adm, simAdm{w.real, cost, "central", pathTenant(descs)})
	}
	return d.Admitted
}

// centralGreedy admits unit requests until one is refused.
func (w *simWorld) centralGreedy(domain string, descs []Entry) int {
	n := 0
	for n < 1_000_000 && w.central(domain, descs, 1) {
		n++
	}
	return n
}

type simLocal struct {
	r, b, tokens uint64
	last         Time
}

func (l *simLocal) refill(now Time) {
	if now > l.last {
		l.tokens = min(l.b, satAdd(l.tokens, mulDiv(l.r, uint64(now-l.last), uint64(time.Second))))
		l.last = now
	}
}

type simHolder struct {
	w       *simWorld
	name    string
	key     HolderKey
	seq     uint64
	applied uint64
	paths   []SharePath
	grant   ShareGrant
	local   map[string]*simLocal
	end     Time // real time after which the holder does not decide
	marginH time.Duration
	// pause delays every admission after its check (recorded at check + pause).
	pause time.Duration
}

func (w *simWorld) holder(name string, paths ...SharePath) *simHolder {
	return &simHolder{w: w, name: name, key: HolderKey{Owner: "o", ID: name, Incarnation: 1}, paths: paths,
		local: map[string]*simLocal{}, marginH: ShareMarginHolder}
}

// renew sends a share request now; drop loses the reply (the command still applies).
func (h *simHolder) renew(drop bool) (ShareGrant, error) {
	h.seq++
	send := h.w.real
	g, err := h.w.e.Share(h.w.fsmNow(), ShareRequest{Holder: h.key, Seq: h.seq, AckSeq: h.applied, Paths: h.paths, NeedsFirst: h.w.needsFirst})
	if err == nil && !drop {
		h.apply(g, send)
	}
	return g, err
}

func (h *simHolder) apply(g ShareGrant, send Time) {
	now := h.w.real
	live := now < h.end
	next := map[string]*simLocal{}
	for _, p := range g.Paths {
		if p.Status != ShareLent {
			continue
		}
		for _, l := range p.Levels {
			if next[l.Key] != nil {
				continue
			}
			n := &simLocal{r: l.Rate, b: l.Burst, last: now}
			switch old := h.local[l.Key]; {
			case l.First:
				n.tokens = min(l.Burst, l.Initial)
			case old != nil && live:
				old.refill(now)
				n.tokens = min(old.tokens, l.Burst)
			}
			next[l.Key] = n
		}
	}
	h.local, h.grant, h.applied = next, g, g.Seq
	h.end = send + Time(g.Term-h.marginH)
}

// admit decides cost on path i locally; it records the admission.
func (h *simHolder) admit(i int, cost uint64) bool {
	now := h.w.real
	if now >= h.end || i >= len(h.grant.Paths) || h.grant.Paths[i].Status != ShareLent {
		return false
	}
	p := h.grant.Paths[i]
	for _, l := range p.Levels {
		loc := h.local[l.Key]
		loc.refill(now)
		if loc.tokens < cost*microPerUnit {
			return false
		}
	}
	for _, l := range p.Levels {
		h.local[l.Key].tokens -= cost * microPerUnit
	}
	h.w.adm = append(h.w.adm, simAdm{now + Time(h.pause), cost, h.name, pathTenant(h.paths[i].Descriptors)})
	return true
}

func (h *simHolder) greedy(i int) int {
	n := 0
	for n < 1_000_000 && h.admit(i, 1) {
		n++
	}
	return n
}

// release returns the unused tokens and ends the holder's shares.
func (h *simHolder) release() (uint64, error) {
	h.seq++
	var toks []LevelTokens
	for k, l := range h.local {
		l.refill(h.w.real)
		if h.w.real < h.end {
			toks = append(toks, LevelTokens{Key: k, Tokens: l.tokens})
		}
	}
	h.local, h.end = map[string]*simLocal{}, 0
	return h.w.e.ReleaseShare(h.w.fsmNow(), ShareRelease{Holder: h.key, Seq: h.seq, Tokens: toks})
}

// boundViolation checks admitted ≤ burst + rate·(1+rho)·T over every window [a_i, a_j] of the
// recorded admissions (rate in units per second) and returns the worst excess found (≤ 0:
// none), with the window.
func boundViolation(adm []simAdm, rate, burst uint64, rho float64) (float64, string) {
	if len(adm) == 0 {
		return -float64(burst), ""
	}
	as := append([]simAdm(nil), adm...)
	// stable sort by time
	for i := 1; i < len(as); i++ {
		for j := i; j > 0 && as[j].at < as[j-1].at; j-- {
			as[j], as[j-1] = as[j-1], as[j]
		}
	}
	r := float64(rate) * (1 + rho) / float64(time.Second)
	worst, where := math.Inf(-1), ""
	// excess(i..j) = Σcost[i..j] − burst − r·(t_j − t_i) = (P_j − r t_j) − (P_{i−1} − r t_i) − burst
	minStart, minIdx := math.Inf(1), 0
	var prefix float64
	for j, a := range as {
		if v := prefix - r*float64(a.at); v < minStart {
			minStart, minIdx = v, j
		}
		prefix += float64(a.cost)
		if ex := prefix - r*float64(a.at) - minStart - float64(burst); ex > worst {
			worst = ex
			where = fmt.Sprintf("[%v, %v]", time.Duration(as[minIdx].at), time.Duration(a.at))
		}
	}
	return worst, where
}

func sharedDomain(rate, burst uint64, sh *Shares) *Limits {
	return &Limits{Domains: []Domain{{Name: "d", Rate: &Rate{Unit: time.Second, RequestsPerUnit: rate, Burst: burst}, Shares: sh}}}
}

var wholeDomain = SharePath{Domain: "d", Demand: math.MaxUint64, MaxCost: 1}

func pathTenant(descs []Entry) string {
	if len(descs) == 0 {
		return ""
	}
	return descs[0].Value
}
