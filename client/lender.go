package client

import (
	"math"
	"time"
)

// Re-lending (issue 13): a regional cluster's leader holds shares of the global cluster's
// buckets through Limiters and lends slices of them, in its memory, to its own share holders
// (client.Limiters on the regional cluster). The upstream grant bounds the slices:
//
//   - Per bucket key, Σ charged slice rates and bursts + the local bucket's ≤ the newest
//     upstream grant: the local bucket (what AllowLocalN spends: the leader's Acquire and RLS
//     callers) is rebuilt at rate granted − Σ slice rates, burst granted − Σ slice bursts,
//     whenever a slice starts or ends and at every upstream grant. A slice's initial tokens
//     are taken from the local bucket's balance; nothing else creates tokens.
//   - A slice ends no later than the upstream grant in hand (its charged end is the upstream
//     end, on this holder's fast clock; the downstream holder stops a margin before).
//   - Slices are charged as the global cluster charges grants: per downstream holder the max
//     rate and burst over its grants that are neither superseded by an acknowledged later
//     one nor ended.
//   - An upstream grant smaller than the slices still charged is not acknowledged (the next
//     renewal acknowledges the last grant that covered them), so the global cluster keeps
//     charging a grant that covers them until they end.
//   - The holder never releases its shares while slices are charged (a release would end
//     the upstream charge at once); its grant ends by itself.

// SliceRequest asks a Limiter for a slice of its path's deepest lendable level.
type SliceRequest struct {
	// Holder names the downstream holder (its identity, ID and incarnation).
	Holder string
	// Seq is the downstream request's seq, Ack the last grant the holder applied.
	Seq, Ack uint64
	// Demand in micro-units per second (math.MaxUint64: unknown), MaxCost in units.
	Demand  uint64
	MaxCost uint64
}

// SliceGrant is a slice lent downstream. OK false: none (Why says why; the holder decides
// centrally).
type SliceGrant struct {
	OK  bool
	Why string
	// Rate (micro-units per second), Burst and Initial (micro-units), First as in a
	// LevelShare of the share protocol.
	Rate, Burst, Initial uint64
	First                bool
	// Term: the slice's grant ends Term after the downstream send time (at most the time
	// left of the upstream grant).
	Term time.Duration
}

// minSliceTerm: no slice shorter than this (the downstream margin must fit in it with room).
const minSliceTerm = time.Second

type levelLends struct {
	holders map[string]*lendHolder
}

type lendHolder struct {
	ack uint64
	// lastSeq is the seq of the newest grant lent to the holder: an ack can acknowledge no
	// more than what was lent (a caller's AckSeq is clamped to it, as the engine clamps).
	lastSeq uint64
	demand  float64 // units per second
	grants  []lendGrant
}

type lendGrant struct {
	seq         uint64
	rate, burst uint64
	endFast     int64
}

func sub0(a, b uint64) uint64 {
	if a < b {
		return 0
	}
	return a - b
}

// charged returns a downstream holder's charged rate and burst at fast (dropping what ended
// or was superseded).
func (lh *lendHolder) charged(fast int64) (rate, burst uint64) {
	keep := lh.grants[:0]
	for _, g := range lh.grants {
		if g.endFast <= fast || g.seq < lh.ack {
			continue
		}
		keep = append(keep, g)
		rate, burst = max(rate, g.rate), max(burst, g.burst)
	}
	lh.grants = keep
	return rate, burst
}

// lentCharged sums the slices of key charged at fast, except holder's. Under h.mu.
func (h *shareHolder) lentCharged(key string, fast int64, except string) (rate, burst uint64) {
	ll := h.lends[key]
	if ll == nil {
		return 0, 0
	}
	for name, lh := range ll.holders {
		r, b := lh.charged(fast)
		if name == except {
			continue
		}
		if len(lh.grants) == 0 {
			delete(ll.holders, name)
			continue
		}
		{
			rate, burst = rate+r, burst+b
		}
	}
	if len(ll.holders) == 0 {
		delete(h.lends, key)
	}
	return rate, burst
}

// lendsExceed reports whether the slices charged at fast exceed granted at some key.
func (h *shareHolder) lendsExceed(granted map[string][2]uint64, fast int64) bool {
	for key := range h.lends {
		r, b := h.lentCharged(key, fast, "")
		g := granted[key]
		if r > g[0] || b > g[1] {
			return true
		}
	}
	return false
}

// lendsLive reports whether any slice is charged at fast.
func (h *shareHolder) lendsLive(fast int64) bool {
	for key := range h.lends {
		if r, b := h.lentCharged(key, fast, ""); r > 0 || b > 0 {
			return true
		}
	}
	return false
}

// rebuild replaces key's local bucket by one of the granted rate and burst less the slices
// charged, holding its balance less take (clamped), in every path state that uses it.
// Under h.mu.
func (h *shareHolder) rebuild(key string, slow, fast int64, take uint64) {
	old := h.levels[key]
	if old == nil {
		return
	}
	g := h.granted[key]
	cr, cb := h.lentCharged(key, fast, "")
	bal := sub0(old.seal(slow), take)
	lr, lb := sub0(g[0], cr), sub0(g[1], cb)
	left := max(h.endFast-fast, 0)
	ng := newGCRA(lr, lb, min(bal, lb), slow, left)
	h.levels[key] = ng
	for _, p := range h.paths {
		st := p.state.Load()
		if st.mode != modeLocal {
			continue
		}
		i := -1
		for j, lv := range st.levels {
			if lv == old {
				i = j
			}
		}
		if i < 0 {
			continue
		}
		cp := *st
		cp.levels = append([]*gcra(nil), st.levels...)
		cp.levels[i] = ng
		p.setState(&cp)
	}
}

// setLentDemand sets p's downstream demand from key's live slices. Under h.mu.
func (h *shareHolder) setLentDemand(p *sharePath, key string) {
	d := 0.0
	if ll := h.lends[key]; ll != nil {
		for _, lh := range ll.holders {
			d += lh.demand
		}
	}
	p.lentDemand = d
}

// LendSlice lends r.Holder a slice of the deepest lendable level of the Limiter's path, out
// of the local grant, or says why not (no grant in hand, too little left, too short). Each
// call for a new r.Seq is a new grant to the holder (charged with its earlier ones until the
// holder acknowledges it).
func (l *Limiter) LendSlice(r SliceRequest) SliceGrant {
	p := l.p
	if p == nil || l.closed.Load() {
		return SliceGrant{Why: "the regional leader holds no share of this level"}
	}
	h := l.h
	h.mu.Lock()
	defer h.mu.Unlock()
	slow, fast := h.clock.now()
	st := p.state.Load()
	if st.mode != modeLocal || len(st.keys) == 0 || fast >= st.endFast {
		return SliceGrant{Why: "the regional leader has no share of the global level in hand (" + st.info.Status + ")"}
	}
	key := st.keys[len(st.keys)-1]
	g := h.granted[key]
	if h.levels[key] == nil || g[0] == 0 {
		return SliceGrant{Why: "the regional leader's share of the global level is empty"}
	}
	term := time.Duration(h.endFast - fast)
	if term < minSliceTerm {
		return SliceGrant{Why: "the regional leader's share of the global level ends in " + term.Round(time.Millisecond).String() + " (renewal pending)"}
	}
	if h.lends == nil {
		h.lends = map[string]*levelLends{}
	}
	ll := h.lends[key]
	if ll == nil {
		ll = &levelLends{holders: map[string]*lendHolder{}}
		h.lends[key] = ll
	}
	lh := ll.holders[r.Holder]
	if lh == nil {
		lh = &lendHolder{}
		ll.holders[r.Holder] = lh
	}
	// The caller's AckSeq acknowledges at most the newest grant it was lent: an ack beyond it
	// (2^64-1, say) would otherwise drop every grant, this one included, from the charge.
	lh.ack = max(lh.ack, min(r.Ack, lh.lastSeq))
	ownR, _ := lh.charged(fast)
	first := len(lh.grants) == 0
	othersR, othersB := h.lentCharged(key, fast, r.Holder)
	// Keep for the leader's own callers (Acquire, RLS) what they attempt, at least a tenth
	// of the grant, at most half of it.
	keepR := min(g[0]/2, max(g[0]/10, uint64(p.ewma*1.25*1e6)))
	keepB := mulDivU(g[1], keepR, g[0])
	roomR, roomB := sub0(g[0], othersR+keepR), sub0(g[1], othersB+keepB)
	want := r.Demand
	if want == math.MaxUint64 {
		want = sub0(g[0], keepR) / uint64(len(ll.holders))
	}
	// Max-min among the downstream holders when their demands exceed what can be lent.
	var sum float64
	for _, o := range ll.holders {
		if o != lh {
			sum += o.demand
		}
	}
	lh.demand = float64(want) / 1e6
	if lendable := float64(sub0(g[0], keepR)); sum*1e6+float64(want) > lendable {
		want = min(want, max(uint64(lendable)/uint64(len(ll.holders)), ownR))
	}
	rate := min(want, roomR)
	cost := max(r.MaxCost, 1) * 1e6
	burst := min(max(mulDivU(g[1], rate, g[0]), 2*cost), roomB)
	if float64(rate)*term.Seconds() < 20*float64(cost) || burst < 2*cost {
		if first {
			delete(ll.holders, r.Holder)
		}
		h.setLentDemand(p, key)
		return SliceGrant{Why: "too little of the regional leader's share of the global level is free to lend now"}
	}
	var initial uint64
	if first {
		initial = min(h.levels[key].balance(slow), burst)
	}
	if plantedDoubleSlice {
		// A deliberately broken build: the slice is not charged against the local bucket.
		h.setLentDemand(p, key)
		return SliceGrant{OK: true, Rate: rate, Burst: burst, Initial: initial, First: first, Term: term}
	}
	lh.grants = append(lh.grants, lendGrant{seq: r.Seq, rate: rate, burst: burst, endFast: h.endFast})
	lh.lastSeq = max(lh.lastSeq, r.Seq)
	h.rebuild(key, slow, fast, initial)
	h.setLentDemand(p, key)
	return SliceGrant{OK: true, Rate: rate, Burst: burst, Initial: initial, First: first, Term: term}
}

// EndSlices ends holder's slices of the Limiter's level granted at or before seq, the seq of
// its release (it released its shares: its local buckets are sealed). Their unused tokens are
// not returned.
//
// The regional FSM orders a holder's requests by seq: it applies a release only when its seq
// is newer than every share request applied before it, and after it a share request only
// when its seq is newer than the release's. So the slices granted at or before seq are the
// ones the release ended; a slice granted for a later seq answers a share request the FSM
// applied after the release — its holder renewed — and stays charged even when this call
// runs after it was lent (the release's handler and the renewal's run concurrently on the
// leader: ending it would let the leader re-lend capacity that is still being spent).
func (l *Limiter) EndSlices(holder string, seq uint64) {
	l.reclaim(holder, seq)
}

// Reclaim gives the rate and burst of ended slices back to the local bucket.
func (l *Limiter) Reclaim() { l.reclaim("", 0) }

func (l *Limiter) reclaim(holder string, seq uint64) {
	p := l.p
	if p == nil {
		return
	}
	h := l.h
	h.mu.Lock()
	defer h.mu.Unlock()
	st := p.state.Load()
	if len(st.keys) == 0 {
		return
	}
	key := st.keys[len(st.keys)-1]
	ll := h.lends[key]
	if ll == nil {
		return
	}
	slow, fast := h.clock.now()
	before := len(ll.holders)
	ended := false
	if lh := ll.holders[holder]; holder != "" && lh != nil {
		keep := lh.grants[:0]
		for _, g := range lh.grants {
			if g.seq > seq {
				keep = append(keep, g)
			}
		}
		ended = len(keep) != len(lh.grants)
		clear(lh.grants[len(keep):])
		lh.grants = keep
		if len(lh.grants) == 0 {
			delete(ll.holders, holder)
		}
	}
	h.lentCharged(key, fast, "") // drops what ended
	if ended || len(ll.holders) != before {
		h.rebuild(key, slow, fast, 0)
		h.setLentDemand(p, key)
	}
}

// Lent returns the rate and burst (micro-units) of the slices of the Limiter's level charged
// now.
func (l *Limiter) Lent() (rate, burst uint64) {
	p := l.p
	if p == nil {
		return 0, 0
	}
	h := l.h
	h.mu.Lock()
	defer h.mu.Unlock()
	st := p.state.Load()
	if len(st.keys) == 0 {
		return 0, 0
	}
	_, fast := h.clock.now()
	return h.lentCharged(st.keys[len(st.keys)-1], fast, "")
}

func mulDivU(a, b, c uint64) uint64 {
	if c == 0 {
		return 0
	}
	return uint64(float64(a) * float64(b) / float64(c))
}
