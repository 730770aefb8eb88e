package quota

// Shares: slices of a bucket's capacity lent to holders that decide locally.
//
// A holder (a client process, a quotad node serving Envoy, a regional cluster's leader) asks
// for shares of the buckets on its descriptor paths (Engine.Share) and renews them every
// term/3 with its demand; between renewals it decides from a local token bucket of rate r and
// capacity b per lendable level. The engine keeps the bounded-admission invariant exact over
// holders and central callers together, rule by rule (docs/architecture.md "Shares"; each rule
// has a timeline test in shares_rules_test.go that breaks the bound without it):
//
//   - Conservation: per lendable bucket, Σ charged r ≤ rate and Σ charged b ≤ burst. The
//     central bucket refills at rate − Σr with capacity burst − Σb; its balance is clamped to
//     that capacity whenever the sums grow (the excess, up to b, becomes a first grant's
//     initial tokens; otherwise it is discarded). A bucket with lends is never swept; a
//     missing one is full at burst − lent.
//   - Tokens move only at a holder's first grant at a bucket and at its release.
//   - Grants are acknowledged: per holder and bucket the engine charges the max r and max b
//     over the holder's grants that are neither superseded by an acknowledged later grant nor
//     past their end + ShareMarginFSM. Lend starts and ends are applied in FSM-time order.
//   - A share command applies only if its seq is newer than the holder's last (the same seq
//     with the same paths gets the stored answer, with other paths ErrStaleShare; an older one
//     nothing).
//   - Allocation is one progressive filling (weighted max-min, integers) over every holder's
//     paths in the domain, each lendable bucket a constraint at rate − reserve, the reserve
//     max(reserve_percent, 1.2 × central demand, 2 × the largest cost) capped at 50 %. A path
//     is lent only when r·term ≥ 20 × its largest cost and b ≥ 2 × it.
//
// Rates of shares are in micro-units per second, balances in micro-units.

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"strings"
	"time"
)

// Shares makes a level lendable: holders may hold slices of its bucket and decide locally.
type Shares struct {
	// Lease is the term of a grant (d): a holder decides on it until its send time + Lease −
	// ShareMarginHolder and renews every Lease/3. 0 means DefaultShareLease.
	Lease time.Duration `json:"lease,omitempty"`
	// ReservePercent of the rate and burst is never lent: it is kept for central callers and
	// newcomers (more when central demand or the largest cost ask for it, at most 50). 0 means
	// DefaultReservePercent.
	ReservePercent uint32 `json:"reserve_percent,omitempty"`
	// FallbackRate is a total, in requests_per_unit of the level's unit, that holders may
	// keep admitting at once their lease has ended without a renewal (cluster unreachable),
	// split among the level's holders by weight. 0: holders fail closed.
	FallbackRate uint64 `json:"fallback_rate,omitempty"`
}

// Share defaults and bounds. ShareMarginFSM, ShareLendCostFactor and the others below are
// replicated semantics: changing one changes what replicas decide.
const (
	DefaultShareLease     = 15 * time.Second
	MinShareLease         = time.Second
	MaxShareLease         = 10 * time.Minute
	DefaultReservePercent = 10
	MaxReservePercent     = 50
	// ShareMarginFSM (m_F) is how long after a grant's end the engine still charges it.
	ShareMarginFSM = 250 * time.Millisecond
	// ShareMarginHolder (m_H) is how long before its end a holder stops using a grant. With
	// ShareMarginFSM it covers (ρ_L + ρ_H)·d plus the longest pause between a local check and
	// its answer.
	ShareMarginHolder = 250 * time.Millisecond
	// MaxSharePaths caps the paths of one share request (one holder).
	MaxSharePaths = 4096
	// MaxHoldersPerOwner caps the holders one identity keeps at once.
	MaxHoldersPerOwner = 1024
	// MaxUnackedGrants caps a holder's grants that it has not acknowledged.
	MaxUnackedGrants = 8
	// ShareLendCostFactor: a path is lent only when r·term ≥ this × its largest cost.
	ShareLendCostFactor = 20
	// holderRetention keeps a holder's last seq this long after its last grant ended (or its
	// release), so replays of its commands change nothing.
	holderRetention = 10 * time.Minute
	// shareRewritePercent: a renewal keeps a bucket's current r and b unless the new ones
	// differ by more than this (fewer local rewrites).
	shareRewritePercent = 10
	// demandWindow is the window of the central-demand EWMA.
	demandWindow = time.Second
)

// MicroPerUnit is the fixed-point scale of share rates and balances.
const MicroPerUnit = microPerUnit

// Share errors. Nothing changes when one is returned (not even the clock).
var (
	// ErrStaleShare: the command's seq is not newer than the holder's last (a replay), the
	// grant a repeated seq asks for has ended, or the repeat names other paths than the seq's
	// first request.
	ErrStaleShare = errors.New("quota: share command is stale (seq not newer than the holder's last)")
	// ErrTooManyHolders: the owner already keeps MaxHoldersPerOwner holders.
	ErrTooManyHolders = errors.New("quota: too many share holders for this identity")
	// ErrTooManyUnacked: the holder has MaxUnackedGrants grants it never acknowledged; they
	// end within one term.
	ErrTooManyUnacked = errors.New("quota: too many unacknowledged share grants")
)

// HolderKey names a holder: the authenticated identity, the holder's own ID and its
// incarnation (a restarted process is a new incarnation, hence a new holder).
type HolderKey struct {
	Owner       string
	ID          string
	Incarnation uint64
}

func (k HolderKey) compare(o HolderKey) int {
	if c := strings.Compare(k.Owner, o.Owner); c != 0 {
		return c
	}
	if c := strings.Compare(k.ID, o.ID); c != 0 {
		return c
	}
	return cmp.Compare(k.Incarnation, o.Incarnation)
}

// ShareRequest obtains or renews a holder's shares: one lease covering all its paths.
type ShareRequest struct {
	Holder HolderKey
	// Seq orders the holder's commands; it must be newer than the last one applied (the same
	// seq again gets the stored answer). > 0.
	Seq uint64
	// AckSeq is the seq of the last grant the holder applied (0: none).
	AckSeq uint64
	Paths  []SharePath
	// NeedsFirst allocates work-conservingly (command version 4, needsFirstFill): the
	// holders' needs (demand without the headroom) are filled before anyone's headroom.
	// Replicas must see the same value for the same entry (the fsm sets it from the entry's
	// command version).
	NeedsFirst bool
	// KeyCaps applies the domain's max_keys and its levels' max_keys_per_parent to the
	// buckets a lend would store (command version 7): a path whose lend would store a bucket
	// beyond a cap is not lent (ShareCentral, Message naming the cap), so its requests are
	// decided centrally, where the caps apply. Replicas must see the same value for the same
	// entry (the fsm sets it from the entry's command version).
	KeyCaps bool
}

// SharePath is one descriptor path a holder decides on, with its demand.
type SharePath struct {
	Domain      string
	Descriptors []Entry
	// Demand is the holder's demand on the path in micro-units per second (an EWMA of
	// attempted cost, ×1.25). math.MaxUint64: unknown, as much as is fair.
	Demand uint64
	// MaxCost is the largest cost, in units, the holder asks for at once (0 means 1).
	MaxCost uint64
}

// ShareStatus says whether a path is decided locally.
type ShareStatus string

const (
	// ShareLent: the path has shares at every lendable level; decide locally.
	ShareLent ShareStatus = "lent"
	// ShareCentral: a rate-limited level on the path does not lend (or the path has a
	// concurrency limit): decide centrally.
	ShareCentral ShareStatus = "central"
	// ShareTooSmall: the path's fair share is below the lend threshold (r·term ≥ 20 × the
	// largest cost, b ≥ 2 × it) or nothing is left to lend now: decide centrally.
	ShareTooSmall ShareStatus = "too_small"
	// ShareInvalid: the path is malformed or names an unknown domain (Message says why).
	ShareInvalid ShareStatus = "invalid"
)

// ShareGrant answers a ShareRequest.
type ShareGrant struct {
	Seq uint64
	// Duplicate: the seq was the holder's last; this is the stored answer.
	Duplicate bool
	// Term is the grant's length after the holder's send time (of its first attempt); the
	// holder uses it until then minus ShareMarginHolder.
	Term  time.Duration
	Paths []PathGrant // one per request path, in order
	// RenewAfter > 0 advises a holder whose demand exceeds what it was lent, because other
	// holders are charged for the rest, to renew this long from now: when the earliest of
	// those charges ends if its holder does not renew (a crashed holder's rate is reclaimed
	// without waiting for the regular renewal).
	RenewAfter time.Duration
}

// PathGrant is the share of one path.
type PathGrant struct {
	Status  ShareStatus
	Message string
	// Levels are the path's lendable levels, outermost first (only when Status is lent).
	Levels []LevelGrant
	// PausedFor is the longest pause covering the path: no local admission before it ends.
	PausedFor time.Duration
	// Fallback is what the holder may admit on the path, in micro-units per second, once its
	// lease has ended without a renewal (0: fail closed).
	Fallback uint64
}

// LevelGrant is a holder's share of one bucket. A bucket shared by several of the holder's
// paths (a domain ceiling) appears with the same values in each.
type LevelGrant struct {
	Key   string // bucket key
	Scope string
	Rate  uint64 // micro-units per second
	Burst uint64 // micro-units: the local bucket's capacity
	// Initial micro-units moved from the central bucket (only when First).
	Initial uint64
	// First: the holder held no share of this bucket before; its local balance is Initial
	// (anything it kept from an earlier grant must be dropped).
	First bool
}

// LevelTokens is a holder's unused balance of one bucket, returned at release.
type LevelTokens struct {
	Key    string
	Tokens uint64 // micro-units
}

// ShareRelease ends a holder's shares and returns its unused tokens.
type ShareRelease struct {
	Holder HolderKey
	Seq    uint64 // newer than the holder's last
	Tokens []LevelTokens
}

// shareParams is a level's Shares in the form the engine needs.
type shareParams struct {
	lease      time.Duration
	reservePct uint64
	fallback   uint64 // micro-units per second, total
}

func newShareParams(where string, s *Shares, lv *level) (*shareParams, error) {
	if s == nil {
		return nil, nil
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s: shares.%s", ErrInvalidLimits, where, fmt.Sprintf(format, args...))
	}
	switch {
	case lv.rate == nil:
		return nil, fmt.Errorf("%w: %s: shares needs a rate_limit to lend; add one or remove shares", ErrInvalidLimits, where)
	case lv.conc != nil:
		return nil, fmt.Errorf("%w: %s: shares and concurrency cannot be combined (permits are not lent); remove one", ErrInvalidLimits, where)
	case lv.shadow:
		return nil, fmt.Errorf("%w: %s: a shadow_mode level never refuses, so it has nothing to lend; remove shares", ErrInvalidLimits, where)
	case s.Lease != 0 && (s.Lease < MinShareLease || s.Lease > MaxShareLease):
		return nil, bad("lease must be between %v and %v (got %v); e.g. 15s", MinShareLease, MaxShareLease, s.Lease)
	case s.ReservePercent > MaxReservePercent:
		return nil, bad("reserve_percent must be at most %d (got %d)", MaxReservePercent, s.ReservePercent)
	case s.FallbackRate > lv.rate.rpu:
		return nil, bad("fallback_rate must be at most the requests_per_unit %d (got %d): it is a total over all holders", lv.rate.rpu, s.FallbackRate)
	}
	p := &shareParams{lease: s.Lease, reservePct: uint64(s.ReservePercent)}
	if p.lease == 0 {
		p.lease = DefaultShareLease
	}
	if p.reservePct == 0 {
		p.reservePct = DefaultReservePercent
	}
	p.fallback = perSecond(s.FallbackRate*microPerUnit, lv.rate.unit)
	return p, nil
}

// perSecond converts micro-units per unit ns to micro-units per second (rounded down,
// saturating).
func perSecond(microPerUnitRate, unit uint64) uint64 {
	hi, lo := bits.Mul64(microPerUnitRate, uint64(time.Second))
	if hi >= unit {
		return math.MaxUint64
	}
	q, _ := bits.Div64(hi, lo, unit)
	return q
}

// perUnitCeil converts micro-units per second to micro-units per unit ns, rounded up
// (saturating).
func perUnitCeil(microPerSec, unit uint64) uint64 {
	hi, lo := bits.Mul64(microPerSec, unit)
	if hi >= uint64(time.Second) {
		return math.MaxUint64
	}
	q, rem := bits.Div64(hi, lo, uint64(time.Second))
	if rem != 0 {
		q++
	}
	return q
}

// mulDiv returns a·b/c rounded down, saturating; c > 0.
func mulDiv(a, b, c uint64) uint64 {
	hi, lo := bits.Mul64(a, b)
	if hi >= c {
		return math.MaxUint64
	}
	q, _ := bits.Div64(hi, lo, c)
	return q
}

// ruleSet switches share rules off, for the timeline tests that show what each rule
// prevents. The zero value has every rule on; nothing outside this package's tests sets it.
type ruleSet struct {
	noCentralCut bool // conservation: the central rate ignores lends (Σr not subtracted)
	freeInitial  bool // conservation: a first grant starts full, not from the clamped excess
	sweepLent    bool // lent buckets are swept when full
	renewRefills bool // every grant hands out a full local bucket, not only the first
	noAck        bool // only the newest grant is charged
	noSeq        bool // commands whose seq is not newer are applied again
	noMarginF    bool // grants are charged until their end only
}

// holder is one holder's replicated share state.
type holder struct {
	key    HolderKey
	seq    uint64 // last applied command
	ackSeq uint64
	grants []*grant // live grants, by seq
	paths  []holderPath
	// active: the holder's paths count as flows (it holds a live grant).
	active bool
	// dropAt: once it has no grants, the holder is forgotten at this time (0: not scheduled).
	dropAt Time
}

// holderPath is one path of the holder's last request.
type holderPath struct {
	domain  string
	entries []Entry
	key     string // bucket key of the deepest matched level
	demand  uint64
	maxCost uint64
	status  ShareStatus
	message string
	levels  []string // lendable bucket keys on the path, outermost first
	scopes  []string
	weight  uint64
}

// grant is one answer to a holder: its share per bucket for one term.
type grant struct {
	seq    uint64
	start  Time
	term   time.Duration
	levels []grantLevel // by key
}

func (g *grant) end() Time { return addSat(g.start, g.term) }

// chargedUntil is when the engine stops charging g.
func (e *Engine) chargedUntil(g *grant) Time {
	if e.rules.noMarginF {
		return g.end()
	}
	return addSat(g.end(), ShareMarginFSM)
}

type grantLevel struct {
	key     string
	r, b    uint64
	initial uint64
	first   bool
	// fallback is the holder's slice of the level's fallback_rate (micro-units per second).
	fallback uint64
}

func (g *grant) level(key string) *grantLevel {
	i, ok := slices.BinarySearchFunc(g.levels, key, func(l grantLevel, k string) int { return strings.Compare(l.key, k) })
	if !ok {
		return nil
	}
	return &g.levels[i]
}

// charge is what the engine charges h at key: the max r and b over its live grants.
func (e *Engine) charge(h *holder, key string) (r, b uint64) {
	gs := h.grants
	if e.rules.noAck && len(gs) > 0 {
		gs = gs[len(gs)-1:]
	}
	for _, g := range gs {
		if l := g.level(key); l != nil {
			r, b = max(r, l.r), max(b, l.b)
		}
	}
	return r, b
}

// lendState is one lendable bucket's lending: the charged sums, central demand, and the
// holders' paths through it.
type lendState struct {
	key        string
	sumR, sumB uint64 // charged r (micro-units/s) and b (micro-units)
	refs       int    // active holders' paths through the bucket
	// Central demand: an EWMA (micro-units per second) of the cost central callers attempt,
	// over windows of demandWindow, and the largest cost seen.
	cwin    Time
	ccost   uint64 // units attempted in the current window
	cdemand uint64
	maxCost uint64
	// Cache of the central rate for a base rate.
	base, central rateParams
	cached        bool
}

func (ls *lendState) lent() bool { return ls.sumR > 0 || ls.sumB > 0 }

// centralOf returns the central part of base: rate − Σr, capacity − Σb.
func (ls *lendState) centralOf(base *rateParams, noCut bool) *rateParams {
	if !ls.lent() {
		return base
	}
	if ls.cached && ls.base == *base {
		return &ls.central
	}
	c := *base
	if !noCut {
		c.rpuMicro -= min(c.rpuMicro, perUnitCeil(ls.sumR, c.unit))
	}
	c.rpu = c.rpuMicro / microPerUnit
	c.capMicro -= min(c.capMicro, ls.sumB)
	c.capUnits = c.capMicro / microPerUnit
	ls.base, ls.central, ls.cached = *base, c, true
	return &ls.central
}

// observe counts cost units a central caller attempted at now.
func (ls *lendState) observe(now Time, cost uint64) {
	ls.roll(now)
	ls.ccost = satAdd(ls.ccost, cost)
	ls.maxCost = max(ls.maxCost, cost)
}

// roll closes the demand windows that ended by now.
func (ls *lendState) roll(now Time) {
	if ls.cwin == 0 || now < ls.cwin {
		if ls.cwin == 0 {
			ls.cwin = now
		}
		return
	}
	n := uint64(now-ls.cwin) / uint64(demandWindow)
	if n == 0 {
		return
	}
	rate := mulDiv(ls.ccost, microPerUnit*uint64(time.Second), uint64(demandWindow))
	ls.cdemand = ls.cdemand/4*3 + rate/4
	for i := uint64(1); i < min(n, 64); i++ {
		ls.cdemand = ls.cdemand / 4 * 3
	}
	ls.ccost = 0
	ls.cwin = addSat(ls.cwin, time.Duration(n)*demandWindow)
}

func satAdd(a, b uint64) uint64 {
	if s := a + b; s >= a {
		return s
	}
	return math.MaxUint64
}

// shareEvent ends a grant (at its end + m_F) or forgets a holder (drop).
type shareEvent struct {
	at   Time
	key  HolderKey
	seq  uint64
	drop bool
}

func (x shareEvent) due() Time { return x.at }

// shareState is the engine's share bookkeeping.
type shareState struct {
	holders map[HolderKey]*holder
	owners  map[string]int                   // holders per owner
	lends   map[string]*lendState            // by bucket key
	domains map[string]map[HolderKey]*holder // active holders with paths in the domain
	events  timeHeap[shareEvent]
	// expiries counts holders whose last grant ended without a release (metrics only).
	expiries uint64
}

func newShareState() shareState {
	return shareState{holders: map[HolderKey]*holder{}, owners: map[string]int{}, lends: map[string]*lendState{},
		domains: map[string]map[HolderKey]*holder{}}
}

// lentRate returns the rate governing the bucket key whose base rate is r: its central part
// when it has lends.
func (e *Engine) lentRate(key []byte, r *rateParams) *rateParams {
	if len(e.sh.lends) == 0 {
		return r
	}
	ls := e.sh.lends[string(key)]
	if ls == nil {
		return r
	}
	return ls.centralOf(r, e.rules.noCentralCut)
}

// isLent reports whether the stored bucket in slot s has lends (it is then never swept).
func (e *Engine) isLent(s uint32) bool {
	if len(e.sh.lends) == 0 || e.rules.sweepLent {
		return false
	}
	ls := e.sh.lends[string(e.buckets.key(s))]
	return ls != nil && ls.lent()
}

// observeCentral counts a central request's cost at the lendable buckets on its path.
func (e *Engine) observeCentral(steps []step, now Time, cost uint64) {
	if len(e.sh.lends) == 0 {
		return
	}
	for i := range steps {
		if steps[i].lv.shares == nil {
			continue
		}
		if ls := e.sh.lends[string(e.keybuf[:steps[i].end])]; ls != nil {
			ls.observe(now, cost)
		}
	}
}

// baseRate returns the rate of bucket key at lv as of at, lends aside (adaptive-aware).
func (e *Engine) baseRate(key string, lv *level, at Time) *rateParams {
	if lv.adaptive != nil {
		if s, _ := find(&e.buckets, key, e.buckets.hashString(key)); s != noSlot {
			return e.baseSlotRate(s)
		}
		return e.rateOf(key, lv, at)
	}
	return lv.rate
}

// setLend changes the charged sums of ls at `at`: the central bucket is refilled to `at`
// under the old sums, then its balance is clamped to the new capacity. It returns the
// micro-units cut off by the clamp. A bucket that starts lending and is not stored is created
// full (an absent bucket is full).
func (e *Engine) setLend(ls *lendState, sumR, sumB uint64, at Time) (excess uint64) {
	if ls.sumR == sumR && ls.sumB == sumB {
		return 0
	}
	lv := e.lim.matchKey(ls.key)
	if lv == nil || lv.rate == nil {
		ls.sumR, ls.sumB, ls.cached = sumR, sumB, false
		return 0
	}
	st := &e.buckets
	h := st.hashString(ls.key)
	s, _ := find(st, ls.key, h)
	var tokens uint64
	var last Time
	if s != noSlot {
		b := st.peek(s)
		tokens, last = e.slotRate(s).refill(b.tokens.get(), Time(b.last.get()), at)
	} else {
		if sumR == 0 && sumB == 0 {
			ls.sumR, ls.sumB, ls.cached = 0, 0, false
			return 0
		}
		tokens, last = e.lentRate([]byte(ls.key), e.baseRate(ls.key, lv, at)).capMicro, at
	}
	ls.sumR, ls.sumB, ls.cached = sumR, sumB, false
	if s == noSlot {
		s = st.add([]byte(ls.key), h, lv.idx)
		st.push(s, math.MaxUint32)
	}
	capMicro := e.slotRate(s).capMicro
	if tokens > capMicro {
		excess, tokens = tokens-capMicro, capMicro
	}
	b := st.rec(s)
	b.tokens.set(tokens)
	b.last.set(uint64(last))
	if ls.lent() && !e.rules.sweepLent {
		st.setDue(s, math.MaxUint32)
	} else {
		e.scheduleFull(s)
	}
	return excess
}

// addCentral puts micro-units back into the central bucket key at now (a release), up to
// its capacity.
func (e *Engine) addCentral(key string, add uint64, now Time) {
	st := &e.buckets
	s, _ := find(st, key, st.hashString(key))
	if s == noSlot || add == 0 {
		return // absent: full already
	}
	b := st.rec(s)
	r := e.slotRate(s)
	tokens, last := r.refill(b.tokens.get(), Time(b.last.get()), now)
	b.tokens.set(min(r.capMicro, satAdd(tokens, add)))
	b.last.set(uint64(last))
	if due := st.due(e.slotFullAt(s)); !e.isLent(s) && due < st.hAt(int(b.pos)).due {
		st.setDue(s, due)
	}
}

// recharge recomputes what every holder is charged at keys after h's grants changed (old
// holds h's charges before the change), at `at`. It returns the clamp excess per key.
func (e *Engine) recharge(h *holder, old map[string][2]uint64, at Time) map[string]uint64 {
	var excess map[string]uint64
	keys := make([]string, 0, len(old))
	for k := range old {
		keys = append(keys, k)
	}
	slices.Sort(keys) // settle in a fixed order (replicas agree on every intermediate state)
	for _, k := range keys {
		ls := e.sh.lends[k]
		if ls == nil {
			continue
		}
		o := old[k]
		r, b := e.charge(h, k)
		sumR := ls.sumR - min(ls.sumR, o[0])
		sumB := ls.sumB - min(ls.sumB, o[1])
		if x := e.setLend(ls, satAdd(sumR, r), satAdd(sumB, b), at); x > 0 {
			if excess == nil {
				excess = map[string]uint64{}
			}
			excess[k] = x
		}
		e.maybeForgetLend(ls)
	}
	return excess
}

// charges returns h's charges at every key its grants name.
func (e *Engine) charges(h *holder) map[string][2]uint64 {
	m := map[string][2]uint64{}
	for _, g := range h.grants {
		for _, l := range g.levels {
			if _, ok := m[l.key]; !ok {
				r, b := e.charge(h, l.key)
				m[l.key] = [2]uint64{r, b}
			}
		}
	}
	return m
}

func (e *Engine) maybeForgetLend(ls *lendState) {
	if ls.refs > 0 || ls.lent() {
		return
	}
	delete(e.sh.lends, ls.key)
	st := &e.buckets
	if s, _ := find(st, ls.key, st.hashString(ls.key)); s != noSlot {
		e.scheduleFull(s)
	}
}

func (e *Engine) lend(key string) *lendState {
	ls := e.sh.lends[key]
	if ls == nil {
		ls = &lendState{key: key}
		e.sh.lends[key] = ls
	}
	return ls
}

// activate makes h's lendable paths count as flows (it holds a live grant).
func (e *Engine) activate(h *holder) {
	if h.active {
		return
	}
	h.active = true
	for i := range h.paths {
		p := &h.paths[i]
		if p.status != ShareLent && p.status != ShareTooSmall {
			continue
		}
		dm := e.sh.domains[p.domain]
		if dm == nil {
			dm = map[HolderKey]*holder{}
			e.sh.domains[p.domain] = dm
		}
		dm[h.key] = h
		for _, k := range p.levels {
			e.lend(k).refs++
		}
	}
}

// deactivate takes h's paths out of the flows.
func (e *Engine) deactivate(h *holder) {
	if !h.active {
		return
	}
	h.active = false
	for i := range h.paths {
		p := &h.paths[i]
		if p.status != ShareLent && p.status != ShareTooSmall {
			continue
		}
		if dm := e.sh.domains[p.domain]; dm != nil {
			delete(dm, h.key)
			if len(dm) == 0 {
				delete(e.sh.domains, p.domain)
			}
		}
		for _, k := range p.levels {
			if ls := e.sh.lends[k]; ls != nil {
				ls.refs--
				e.maybeForgetLend(ls)
			}
		}
	}
}

// expireShares applies every share event due at or before now, in time order.
func (e *Engine) expireShares(now Time) {
	sh := &e.sh
	for len(sh.events) > 0 && sh.events[0].at <= now {
		x := sh.events.pop()
		h := sh.holders[x.key]
		if h == nil {
			continue
		}
		if x.drop {
			if len(h.grants) == 0 && h.dropAt == x.at {
				e.forgetHolder(h)
			}
			continue
		}
		i := slices.IndexFunc(h.grants, func(g *grant) bool { return g.seq == x.seq })
		if i < 0 || e.chargedUntil(h.grants[i]) != x.at {
			continue
		}
		old := e.charges(h)
		h.grants = slices.Delete(h.grants, i, i+1)
		e.recharge(h, old, x.at)
		if len(h.grants) == 0 {
			e.sh.expiries++
			e.idle(h, x.at)
		}
	}
}

// idle: h holds no grant any more. Its paths stop counting and it is forgotten after the
// retention (its seq kept until then).
func (e *Engine) idle(h *holder, at Time) {
	e.deactivate(h)
	h.paths = nil
	h.dropAt = addSat(at, holderRetention)
	e.sh.events.push(shareEvent{at: h.dropAt, key: h.key, drop: true})
}

func (e *Engine) forgetHolder(h *holder) {
	e.deactivate(h)
	delete(e.sh.holders, h.key)
	if n := e.sh.owners[h.key.Owner]; n <= 1 {
		delete(e.sh.owners, h.key.Owner)
	} else {
		e.sh.owners[h.key.Owner] = n - 1
	}
}

// matchSharePath matches a path as Acquire does and says whether it can be lent.
func (e *Engine) matchSharePath(p SharePath) holderPath {
	hp := holderPath{domain: p.Domain, entries: slices.Clone(p.Descriptors), demand: p.Demand, maxCost: max(p.MaxCost, 1), weight: 1}
	if msg := requestProblem(p.Domain, p.Descriptors, 0); msg != "" {
		hp.status, hp.message = ShareInvalid, msg
		return hp
	}
	lv := e.lim.domains[p.Domain]
	if lv == nil {
		hp.status, hp.message = ShareInvalid, fmt.Sprintf("domain %q is not configured (limits version %d)", p.Domain, e.lim.limits.Version)
		return hp
	}
	kb := appendEscaped(nil, p.Domain)
	hp.status = ShareLent
	visit := func(lv *level) {
		if lv.weight > 0 {
			hp.weight = uint64(lv.weight)
		}
		switch {
		case lv.conc != nil:
			hp.status, hp.message = ShareCentral, fmt.Sprintf("scope %s has a concurrency limit; permits are not lent", lv.scope)
		case lv.rate != nil && !lv.shadow && lv.shares == nil && hp.status == ShareLent:
			hp.status, hp.message = ShareCentral, fmt.Sprintf("scope %s does not lend (no shares in its limits)", lv.scope)
		case lv.shares != nil:
			hp.levels = append(hp.levels, string(kb))
			hp.scopes = append(hp.scopes, lv.scope)
		}
	}
	visit(lv)
	for _, en := range p.Descriptors {
		if lv = lv.child(en); lv == nil {
			break
		}
		kb = appendEntry(kb, en)
		visit(lv)
	}
	hp.key = string(kb)
	if hp.status == ShareLent && len(hp.levels) == 0 {
		hp.status, hp.message = ShareCentral, "no level on the path lends"
	}
	if hp.status != ShareLent {
		hp.levels, hp.scopes = nil, nil
	}
	if hp.maxCost > maxUnits {
		hp.status, hp.message, hp.levels, hp.scopes = ShareInvalid, fmt.Sprintf("max cost %d is too large", hp.maxCost), nil, nil
	}
	return hp
}

// capLends turns every lendable path of paths (one request's, in order) whose lend would
// store a bucket beyond its domain's max_keys, or beyond a level's max_keys_per_parent under
// the bucket's parent path, into a central one (ShareCentral; Message says which cap). A lend
// stores the buckets of its path's lendable levels that are not stored yet; the buckets an
// earlier path of the request would store count against the caps of the later ones (as if
// every lendable path were lent, which is conservative: a path allocated nothing stores
// nothing). Buckets already stored (every bucket with lends is) never count, so a renewal of
// a lend is never refused by a cap. Deterministic: it reads only the replicated store, the
// limits and paths in order.
func (e *Engine) capLends(paths []holderPath) {
	st := &e.buckets
	planned := map[string]bool{}  // bucket keys earlier paths would store
	perDom := map[uint32]int{}    // their number per domain
	perParent := map[string]int{} // per level and parent path (parentKey)
	var pk []byte
	for i := range paths {
		p := &paths[i]
		if p.status != ShareLent {
			continue
		}
		root := e.lim.domains[p.domain]
		var adds []string
		var addLvls []*level
		for _, k := range p.levels {
			if planned[k] || slices.Contains(adds, k) {
				continue
			}
			if s, _ := find(st, k, st.hashString(k)); s != noSlot {
				continue
			}
			adds = append(adds, k)
			addLvls = append(addLvls, e.lim.matchKey(k))
		}
		if len(adds) == 0 {
			continue
		}
		msg := ""
		if held := st.domKeys[root.dom] + perDom[root.dom]; held+len(adds) > root.maxKeys {
			msg = fmt.Sprintf("not lent: domain %q holds %d active buckets and max_keys is %d, so bucket %.80q cannot be added; "+
				"decide centrally (where max_keys applies per request), or raise the domain's max_keys",
				p.domain, held, root.maxKeys, adds[0])
		}
		for j, k := range adds {
			lv := addLvls[j]
			if msg != "" || lv == nil || lv.maxPerParent == 0 || lv == root {
				continue
			}
			pk = parentKey(pk[:0], lv.idx, []byte(k))
			if held := st.underParent(lv.idx, []byte(k)) + perParent[string(pk)]; held >= lv.maxPerParent {
				msg = fmt.Sprintf("not lent: the parent path of bucket %.80q holds %d active %q buckets and that level's max_keys_per_parent is %d; "+
					"decide centrally (where max_keys_per_parent applies per request), or raise max_keys_per_parent",
					k, held, lv.scope, lv.maxPerParent)
			}
		}
		if msg != "" {
			p.status, p.message, p.levels, p.scopes = ShareCentral, msg, nil, nil
			continue
		}
		perDom[root.dom] += len(adds)
		for j, k := range adds {
			planned[k] = true
			if lv := addLvls[j]; lv != nil && lv.maxPerParent > 0 && lv != root {
				pk = parentKey(pk[:0], lv.idx, []byte(k))
				perParent[string(pk)]++
			}
		}
	}
}

// levelCaps is what one lendable bucket offers: rate and burst after the reserve.
type levelCaps struct {
	lv           *level
	rate, burst  uint64 // micro-units/s, micro-units (configured, lends aside)
	lendR, lendB uint64 // after the reserve
}

func (e *Engine) capsOf(key string, lv *level, now Time, holderMaxCost uint64) levelCaps {
	base := e.baseRate(key, lv, now)
	c := levelCaps{lv: lv, rate: perSecond(base.rpuMicro, base.unit), burst: base.capMicro}
	ls := e.sh.lends[key]
	var cdemand, maxCost uint64 = 0, holderMaxCost
	if ls != nil {
		ls.roll(now)
		cdemand, maxCost = ls.cdemand, max(maxCost, ls.maxCost)
	}
	reserve, reserveB := reserveOf(c.rate, c.burst, base.unit, lv.shares, cdemand, maxCost)
	c.lendR, c.lendB = c.rate-reserve, c.burst-reserveB
	return c
}

// reserveOf is the part of a lendable bucket (rate micro-units/s, burst micro-units) never
// lent: max(reserve_percent, 1.2 × central demand, 2 × the largest cost per unit), ≤ 50 %.
func reserveOf(rate, burst, unit uint64, p *shareParams, cdemand, maxCost uint64) (r, b uint64) {
	costMicro := min(maxCost, maxUnits) * microPerUnit
	costRate := perSecond(costMicro, unit) // the largest cost once per unit
	r = max(mulDiv(rate, p.reservePct, 100), mulDiv(cdemand, 12, 10), satAdd(costRate, costRate))
	r = min(r, rate/2)
	b = max(mulDiv(burst, p.reservePct, 100), satAdd(costMicro, costMicro))
	if rate > 0 {
		b = max(b, mulDiv(burst, r, rate))
	}
	b = min(b, burst/2)
	return r, b
}

// Share obtains or renews req.Holder's shares (see the package's Shares rules). It returns
// the grant, or an error wrapping ErrInvalidRequest, ErrStaleShare, ErrTooManyHolders or
// ErrTooManyUnacked; then nothing changes but the clock.
func (e *Engine) Share(now Time, req ShareRequest) (ShareGrant, error) {
	hk := req.Holder
	switch {
	case hk.ID == "" || len(hk.ID) > MaxFieldBytes:
		return ShareGrant{}, fmt.Errorf("%w: share: holder ID must be 1 to %d bytes (got %d)", ErrInvalidRequest, MaxFieldBytes, len(hk.ID))
	case req.Seq == 0:
		return ShareGrant{}, fmt.Errorf("%w: share: seq must be > 0", ErrInvalidRequest)
	case len(req.Paths) > MaxSharePaths:
		return ShareGrant{}, fmt.Errorf("%w: share: %d paths; at most %d per holder", ErrInvalidRequest, len(req.Paths), MaxSharePaths)
	}
	now = e.advance(now)
	h := e.sh.holders[hk]
	if h != nil && !e.rules.noSeq {
		if req.Seq < h.seq {
			return ShareGrant{}, fmt.Errorf("share: seq %d, holder's last %d: %w", req.Seq, h.seq, ErrStaleShare)
		}
		if req.Seq == h.seq {
			if !samePaths(h.paths, req.Paths) {
				// The stored answer is for other paths: matched by position it would give a
				// path another's share (rpc's Share proposes only the paths the caller may
				// spend, which a limits change between two tries can change).
				return ShareGrant{}, fmt.Errorf("share: seq %d was answered for other paths than these (%d then, %d now): %w", req.Seq, len(h.paths), len(req.Paths), ErrStaleShare)
			}
			return e.repeatGrant(h, now)
		}
	}
	if h == nil {
		if e.sh.owners[hk.Owner] >= MaxHoldersPerOwner {
			return ShareGrant{}, fmt.Errorf("share: %q keeps %d holders: %w", hk.Owner, MaxHoldersPerOwner, ErrTooManyHolders)
		}
		h = &holder{key: hk}
		e.sh.holders[hk] = h
		e.sh.owners[hk.Owner]++
	}
	unacked := 0
	for _, g := range h.grants {
		if g.seq > req.AckSeq {
			unacked++
		}
	}
	if unacked >= MaxUnackedGrants {
		return ShareGrant{}, fmt.Errorf("share: holder has %d unacknowledged grants; they end within one term: %w", unacked, ErrTooManyUnacked)
	}
	h.seq = max(h.seq, req.Seq)
	h.dropAt = 0

	// Acknowledgement: every grant older than the newest acknowledged one is superseded.
	if ack := min(req.AckSeq, h.seq); ack > h.ackSeq || e.rules.noSeq {
		h.ackSeq = max(h.ackSeq, ack)
		newest := -1
		for i, g := range h.grants {
			if g.seq <= h.ackSeq {
				newest = i
			}
		}
		if newest > 0 {
			old := e.charges(h)
			h.grants = slices.Delete(h.grants, 0, newest)
			e.recharge(h, old, now)
		}
	}

	// The new paths replace the old ones as flows.
	e.deactivate(h)
	h.paths = h.paths[:0]
	seen := map[string]bool{}
	for _, p := range req.Paths {
		hp := e.matchSharePath(p)
		if hp.status != ShareInvalid && seen[hp.key] {
			hp.status, hp.message, hp.levels, hp.scopes = ShareInvalid, "the same path appears twice in the request", nil, nil
		}
		seen[hp.key] = true
		h.paths = append(h.paths, hp)
	}
	if req.KeyCaps {
		e.capLends(h.paths)
	}
	e.activate(h)

	g := e.allocate(h, now, req.NeedsFirst)
	old := e.charges(h)
	for _, l := range g.levels {
		if _, ok := old[l.key]; !ok {
			old[l.key] = [2]uint64{0, 0}
		}
	}
	// First grants: the holder held nothing at the key.
	for i := range g.levels {
		o := old[g.levels[i].key]
		g.levels[i].first = o[0] == 0 && o[1] == 0
	}
	h.grants = append(h.grants, g)
	excess := e.recharge(h, old, now)
	for i := range g.levels {
		l := &g.levels[i]
		switch {
		case l.first && e.rules.freeInitial, e.rules.renewRefills:
			l.initial, l.first = l.b, true
		case l.first:
			l.initial = min(l.b, excess[l.key])
		}
	}
	e.sh.events.push(shareEvent{at: e.chargedUntil(g), key: hk, seq: g.seq})
	return e.answer(h, g, now, false), nil
}

// samePaths reports whether ps are, in order, the paths hs were made from (domain and
// descriptors).
func samePaths(hs []holderPath, ps []SharePath) bool {
	return slices.EqualFunc(hs, ps, func(h holderPath, p SharePath) bool {
		return h.domain == p.Domain && slices.Equal(h.entries, p.Descriptors)
	})
}

// repeatGrant answers a repeated seq with the stored grant.
func (e *Engine) repeatGrant(h *holder, now Time) (ShareGrant, error) {
	if len(h.grants) == 0 || h.grants[len(h.grants)-1].seq != h.seq {
		return ShareGrant{}, fmt.Errorf("share: seq %d was answered and its grant has ended: %w", h.seq, ErrStaleShare)
	}
	return e.answer(h, h.grants[len(h.grants)-1], now, true), nil
}

// answer builds the reply for grant g of h.
func (e *Engine) answer(h *holder, g *grant, now Time, dup bool) ShareGrant {
	out := ShareGrant{Seq: g.seq, Duplicate: dup, Term: g.term, Paths: make([]PathGrant, len(h.paths))}
	for i := range h.paths {
		p := &h.paths[i]
		pg := PathGrant{Status: p.status, Message: p.message}
		if p.status == ShareLent {
			fallback := uint64(math.MaxUint64)
			for j, k := range p.levels {
				l := g.level(k)
				if cost := p.maxCost * microPerUnit; l == nil || l.b < 2*cost ||
					mulDiv(l.r, uint64(g.term), uint64(time.Second)) < ShareLendCostFactor*cost {
					pg.Status, pg.Levels = ShareTooSmall, nil
					break
				}
				pg.Levels = append(pg.Levels, LevelGrant{Key: k, Scope: p.scopes[j], Rate: l.r, Burst: l.b, Initial: l.initial, First: l.first})
				fallback = min(fallback, l.fallback)
			}
			if pg.Status == ShareLent {
				pg.Fallback = fallback
			}
		}
		pg.PausedFor = e.pausedFor(p, now)
		out.Paths[i] = pg
	}
	out.RenewAfter = e.renewHint(h, g, now)
	return out
}

// renewHint is ShareGrant.RenewAfter: for the buckets where h's demand through them exceeds
// its share by more than a tenth, the earliest time another holder's charge there ends.
func (e *Engine) renewHint(h *holder, g *grant, now Time) time.Duration {
	want := map[string]uint64{}
	for i := range h.paths {
		p := &h.paths[i]
		if p.status != ShareLent {
			continue
		}
		for _, k := range p.levels {
			want[k] = satAdd(want[k], p.demand)
		}
	}
	var hint time.Duration
	for _, k := range sortedKeys(want) {
		var r uint64
		if l := g.level(k); l != nil {
			r = l.r
		}
		if want[k] <= satAdd(r, r/10) {
			continue
		}
		d, _, _ := strings.Cut(k, "/")
		d, _ = unescape(d)
		for _, o := range e.sh.domains[d] {
			if o == h || len(o.grants) == 0 {
				continue
			}
			if or, ob := e.charge(o, k); or == 0 && ob == 0 {
				continue
			}
			if until := e.chargedUntil(o.grants[len(o.grants)-1]); until > now && (hint == 0 || until.Sub(now) < hint) {
				hint = until.Sub(now)
			}
		}
	}
	return hint
}

// pausedFor is the longest pause covering path p at now.
func (e *Engine) pausedFor(p *holderPath, now Time) time.Duration {
	if len(e.pauses) == 0 || p.status == ShareInvalid {
		return 0
	}
	var left time.Duration
	check := func(k []byte) {
		if until, ok := e.pauses[string(k)]; ok && until > now {
			left = max(left, until.Sub(now))
		}
	}
	kb := appendEscaped(nil, p.domain)
	check(kb)
	lv := e.lim.domains[p.domain]
	for _, en := range p.entries {
		if lv == nil {
			break
		}
		if lv = lv.child(en); lv == nil {
			break
		}
		kb = appendEntry(kb, en)
		check(kb)
	}
	return left
}

// flowRef names one flow of the allocation: a path of an active holder.
type flowRef struct {
	h *holder
	p *holderPath
}

// allocate computes h's new grant: one progressive filling over the flows of every domain h
// has lendable paths in, then the lend threshold, the cap by what the other holders are
// charged, and the rewrite hysteresis.
func (e *Engine) allocate(h *holder, now Time, needsFirst bool) *grant {
	g := &grant{seq: h.seq, start: now, term: 0}
	// The term: the shortest lease of the lendable levels h touches.
	for i := range h.paths {
		for _, k := range h.paths[i].levels {
			if lv := e.lim.matchKey(k); lv != nil && lv.shares != nil && (g.term == 0 || lv.shares.lease < g.term) {
				g.term = lv.shares.lease
			}
		}
	}
	if g.term == 0 {
		g.term = DefaultShareLease
	}
	domains := map[string]bool{}
	for i := range h.paths {
		if h.paths[i].status == ShareLent {
			domains[h.paths[i].domain] = true
		}
	}
	levelRate := map[string]uint64{} // h's rate per key
	myW, totalW := map[string]uint64{}, map[string]uint64{}
	caps := map[string]levelCaps{}
	free := map[string]uint64{} // lendable rate no flow was given, per key
	var lent []*holderPath      // h's paths with a positive allocation
	for _, d := range sortedKeys(domains) {
		var flows []flowRef
		holders := make([]*holder, 0, len(e.sh.domains[d]))
		for _, o := range e.sh.domains[d] {
			holders = append(holders, o)
		}
		slices.SortFunc(holders, func(a, b *holder) int { return a.key.compare(b.key) })
		for _, o := range holders {
			for i := range o.paths {
				if p := &o.paths[i]; p.domain == d && p.status == ShareLent {
					flows = append(flows, flowRef{o, p})
				}
			}
		}
		// Constraints, their caps, and the largest cost through each.
		idx := map[string]int32{}
		var keys []string
		maxCost := map[string]uint64{}
		for _, f := range flows {
			for _, k := range f.p.levels {
				if _, ok := idx[k]; !ok {
					idx[k] = int32(len(keys))
					keys = append(keys, k)
				}
				maxCost[k] = max(maxCost[k], f.p.maxCost)
			}
		}
		capR := make([]uint64, len(keys))
		for i, k := range keys {
			c := e.capsOf(k, e.lim.matchKey(k), now, maxCost[k])
			caps[k] = c
			capR[i] = c.lendR
		}
		// Flows below the lend threshold are taken out and the filling redone, so what
		// they would have had goes to the others (a few passes; the rest are zeroed).
		excluded := make([]bool, len(flows))
		var x []uint64
		for pass := 0; pass < 3; pass++ {
			af := make([]allocFlow, len(flows))
			for i, f := range flows {
				af[i] = allocFlow{demand: f.p.demand, weight: f.p.weight}
				if excluded[i] {
					af[i].demand = 0
				}
				for _, k := range f.p.levels {
					af[i].levels = append(af[i].levels, idx[k])
				}
			}
			if needsFirst {
				x = needsFirstFill(af, capR)
			} else {
				x = progressiveFill(af, capR)
			}
			changed := false
			for i, f := range flows {
				if !excluded[i] && !e.lendable(x[i], f.p, g.term, caps) {
					excluded[i], changed = true, true
				}
			}
			if !changed {
				break
			}
		}
		used := make([]uint64, len(keys))
		for i, f := range flows {
			if excluded[i] || !e.lendable(x[i], f.p, g.term, caps) {
				x[i] = 0
			}
			for _, k := range f.p.levels {
				used[idx[k]] = satAdd(used[idx[k]], x[i])
			}
			for _, k := range f.p.levels {
				totalW[k] += f.p.weight
			}
			if f.h != h {
				continue
			}
			if x[i] > 0 {
				lent = append(lent, f.p)
			}
			for _, k := range f.p.levels {
				levelRate[k] = satAdd(levelRate[k], x[i])
				myW[k] += f.p.weight
			}
		}
		for i, k := range keys {
			free[k] = capR[i] - min(capR[i], used[i])
		}
	}
	// Per key: b in proportion to r, the caps by what the others are charged, hysteresis.
	got := map[string]grantLevel{}
	for _, k := range sortedKeys(levelRate) {
		c := caps[k]
		r := levelRate[k]
		b := uint64(0)
		if c.lendR > 0 {
			b = mulDiv(r, c.lendB, c.lendR)
		}
		ls := e.sh.lends[k]
		myR, myB := e.charge(h, k)
		othersR, othersB := ls.sumR-min(ls.sumR, myR), ls.sumB-min(ls.sumB, myB)
		capR := c.lendR - min(c.lendR, othersR)
		capB := c.lendB - min(c.lendB, othersB)
		// Hysteresis: keep the current share if the new one is within 10 % of it — unless
		// keeping a larger one would take rate another flow was given.
		if cur := e.currentLevel(h, k); cur != nil && within(cur.r, r) && within(cur.b, b) && cur.r <= capR && cur.b <= capB &&
			(cur.r <= r || cur.r-r <= free[k]) {
			r, b = cur.r, cur.b
		}
		r, b = min(r, capR), min(b, capB)
		if e.centralAhead(k, now) {
			// A scheduled grant credited the central bucket's refill beyond now at its
			// current rate: do not cut that rate under it.
			r, b = min(r, myR), min(b, myB)
		}
		var fb uint64
		if p := c.lv.shares; p.fallback > 0 && totalW[k] > 0 {
			fb = mulDiv(p.fallback, myW[k], totalW[k])
		}
		got[k] = grantLevel{key: k, r: r, b: b, fallback: fb}
	}
	// A key whose capped share is below the threshold for every path of h through it lends
	// nothing (rather than a share no path can use).
	useful := map[string]bool{}
	for _, p := range lent {
		ok := true
		for _, k := range p.levels {
			l := got[k]
			cost := p.maxCost * microPerUnit
			if l.b < 2*cost || mulDiv(l.r, uint64(g.term), uint64(time.Second)) < ShareLendCostFactor*cost {
				ok = false
			}
		}
		if ok {
			for _, k := range p.levels {
				useful[k] = true
			}
		}
	}
	for _, k := range sortedKeys(got) {
		l := got[k]
		if !useful[k] {
			l.r, l.b = 0, 0
		}
		g.levels = append(g.levels, l)
	}
	// Keys h held before and no longer asks for get an explicit zero (a decrease to nothing).
	for _, old := range h.grants {
		for _, l := range old.levels {
			if _, ok := got[l.key]; !ok {
				got[l.key] = grantLevel{key: l.key}
				g.levels = append(g.levels, grantLevel{key: l.key})
			}
		}
	}
	slices.SortFunc(g.levels, func(a, b grantLevel) int { return strings.Compare(a.key, b.key) })
	return g
}

// lendable reports whether rate x (micro-units/s) lets path p be lent for term: r·term ≥ 20 ×
// its largest cost and, at every level, b ≥ 2 × it.
func (e *Engine) lendable(x uint64, p *holderPath, term time.Duration, caps map[string]levelCaps) bool {
	cost := p.maxCost * microPerUnit
	if x == 0 || mulDiv(x, uint64(term), uint64(time.Second)) < ShareLendCostFactor*cost {
		return false
	}
	for _, k := range p.levels {
		c := caps[k]
		if c.lendR == 0 || mulDiv(x, c.lendB, c.lendR) < 2*cost {
			return false
		}
	}
	return true
}

// currentLevel is h's share at key in its newest grant (nil: none).
func (e *Engine) currentLevel(h *holder, key string) *grantLevel {
	if len(h.grants) == 0 {
		return nil
	}
	return h.grants[len(h.grants)-1].level(key)
}

// within reports whether b is within shareRewritePercent of a (a > 0).
func within(a, b uint64) bool {
	if a == 0 {
		return b == 0
	}
	d := max(a, b) - min(a, b)
	return d <= mulDiv(a, shareRewritePercent, 100)
}

// centralAhead reports whether key's central bucket has refill credited beyond now (a
// scheduled grant).
func (e *Engine) centralAhead(key string, now Time) bool {
	st := &e.buckets
	s, _ := find(st, key, st.hashString(key))
	return s != noSlot && Time(st.peek(s).last.get()) > now
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

// ReleaseShare ends a holder's shares at once and puts the tokens it did not use back into
// the central buckets (each capped at what the holder was charged as b there, and at the
// central capacity). The holder must have stopped deciding before it sends the release. A
// release whose seq is not newer than the holder's last is refused with ErrStaleShare and
// changes nothing; so is one for an unknown holder. It reports the micro-units put back.
func (e *Engine) ReleaseShare(now Time, rel ShareRelease) (uint64, error) {
	now = e.advance(now)
	h := e.sh.holders[rel.Holder]
	if h == nil {
		return 0, fmt.Errorf("release share: unknown holder: %w", ErrStaleShare)
	}
	if rel.Seq <= h.seq && !e.rules.noSeq {
		return 0, fmt.Errorf("release share: seq %d, holder's last %d: %w", rel.Seq, h.seq, ErrStaleShare)
	}
	h.seq = max(h.seq, rel.Seq)
	back := map[string]uint64{}
	for _, t := range rel.Tokens {
		_, b := e.charge(h, t.Key)
		back[t.Key] = min(b, satAdd(back[t.Key], t.Tokens))
	}
	old := e.charges(h)
	h.grants = nil
	e.recharge(h, old, now)
	var total uint64
	for _, k := range sortedKeys(back) {
		if back[k] > 0 && e.lim.matchKey(k) != nil {
			e.addCentral(k, back[k], now)
			total = satAdd(total, back[k])
		}
	}
	e.idle(h, now)
	return total, nil
}

// ShareCounts counts the share state (its memory grows with these).
type ShareCounts struct {
	Holders     int // holders known, live or remembered for their seq
	LentBuckets int // buckets with lends or holders' paths
}

// ShareCounts returns the engine's share counts.
func (e *Engine) ShareCounts() ShareCounts {
	return ShareCounts{Holders: len(e.sh.holders), LentBuckets: len(e.sh.lends)}
}

// HolderStatus is a read-only view of one holder's shares at a bucket.
type HolderStatus struct {
	Holder HolderKey
	Key    string
	Rate   uint64 // charged, micro-units per second
	Burst  uint64 // charged, micro-units
	Seq    uint64
	AckSeq uint64 // the last grant the holder said it applied
	// Until is when the charge ends at the latest (the newest grant's end + ShareMarginFSM).
	Until Time
	// Demand is the holder's demand over its paths through the bucket (micro-units per
	// second; math.MaxUint64: unknown).
	Demand uint64
	// Acked: the holder acknowledged every live grant but its newest (which it acknowledges
	// in its next request): nothing older than the newest grant is charged. False after a
	// lost reply or a decrease not yet applied.
	Acked bool
	// Unacked counts the live grants newer than the acknowledged one.
	Unacked int
}

// LendStatus is a read-only view of one lendable bucket's lending.
type LendStatus struct {
	Key           string
	LentRate      uint64 // Σ charged r, micro-units per second
	LentBurst     uint64
	Holders       int
	CentralDemand uint64 // micro-units per second
	// Rate and Burst are the bucket's (lends aside); ReserveRate and ReserveBurst the part the
	// allocation keeps for central callers (as of the last renewal's central demand).
	Rate, Burst               uint64
	ReserveRate, ReserveBurst uint64
}

// ShareExpiries counts the holders whose last grant ended without a release since the engine
// was made (derived: not replicated, not in snapshots; for metrics).
func (e *Engine) ShareExpiries() uint64 { return e.sh.expiries }

// ShareStatus lists the lending of every bucket of domain (all domains if empty) and its
// holders, by key. It changes nothing.
func (e *Engine) ShareStatus(domain string) ([]LendStatus, []HolderStatus) {
	var ls []LendStatus
	inDomain := func(k string) bool {
		if domain == "" {
			return true
		}
		d, _, _ := strings.Cut(k, "/")
		d, _ = unescape(d)
		return d == domain
	}
	count := map[string]int{}
	var hs []HolderStatus
	for _, h := range e.sh.holders {
		keys := map[string]bool{}
		for _, g := range h.grants {
			for _, l := range g.levels {
				keys[l.key] = true
			}
		}
		for k := range keys {
			if !inDomain(k) {
				continue
			}
			r, b := e.charge(h, k)
			if r == 0 && b == 0 {
				continue
			}
			count[k]++
			newest := h.grants[len(h.grants)-1]
			st := HolderStatus{Holder: h.key, Key: k, Rate: r, Burst: b, Seq: h.seq, AckSeq: h.ackSeq,
				Until: e.chargedUntil(newest), Acked: true}
			for _, g := range h.grants {
				if g.seq > h.ackSeq {
					st.Unacked++
					st.Acked = st.Acked && g == newest
				}
			}
			for _, p := range h.paths {
				if slices.Contains(p.levels, k) {
					st.Demand = satAdd(st.Demand, p.demand)
				}
			}
			hs = append(hs, st)
		}
	}
	for k, l := range e.sh.lends {
		if !inDomain(k) {
			continue
		}
		st := LendStatus{Key: k, LentRate: l.sumR, LentBurst: l.sumB, Holders: count[k], CentralDemand: l.cdemand}
		if lv := e.lim.matchKey(k); lv != nil && lv.rate != nil && lv.shares != nil {
			base := e.baseRate(k, lv, e.clock)
			st.Rate, st.Burst = perSecond(base.rpuMicro, base.unit), base.capMicro
			st.ReserveRate, st.ReserveBurst = reserveOf(st.Rate, st.Burst, base.unit, lv.shares, l.cdemand, l.maxCost)
		}
		ls = append(ls, st)
	}
	slices.SortFunc(ls, func(a, b LendStatus) int { return strings.Compare(a.Key, b.Key) })
	slices.SortFunc(hs, func(a, b HolderStatus) int {
		if c := strings.Compare(a.Key, b.Key); c != 0 {
			return c
		}
		return a.Holder.compare(b.Holder)
	})
	return ls, hs
}

// rebuildLends recomputes every lend state's sums and refs from the holders (after a restore
// or a limits change): keys whose level no longer has a rate lose their lend state.
func (e *Engine) rebuildLends() {
	old := e.sh.lends
	e.sh.lends = map[string]*lendState{}
	e.sh.domains = map[string]map[HolderKey]*holder{}
	hs := make([]*holder, 0, len(e.sh.holders))
	for _, h := range e.sh.holders {
		hs = append(hs, h)
	}
	slices.SortFunc(hs, func(a, b *holder) int { return a.key.compare(b.key) })
	for _, h := range hs {
		act := h.active
		h.active = false
		if act {
			e.activate(h)
		}
		for k, c := range e.charges(h) {
			if lv := e.lim.matchKey(k); lv == nil || lv.rate == nil {
				continue
			}
			ls := e.lend(k)
			ls.sumR, ls.sumB = satAdd(ls.sumR, c[0]), satAdd(ls.sumB, c[1])
		}
	}
	for k, ls := range e.sh.lends {
		if o := old[k]; o != nil {
			ls.cwin, ls.ccost, ls.cdemand, ls.maxCost = o.cwin, o.ccost, o.cdemand, o.maxCost
		}
	}
	for k, ls := range e.sh.lends {
		if !ls.lent() && ls.refs == 0 {
			delete(e.sh.lends, k)
		}
	}
}

// clampLent clamps every lent bucket's balance to its central capacity and keeps it out of
// the sweep (after a limits change or a restore).
func (e *Engine) clampLent() {
	st := &e.buckets
	for _, k := range sortedKeys(e.sh.lends) {
		ls := e.sh.lends[k]
		s, _ := find(st, k, st.hashString(k))
		if s == noSlot {
			if ls.lent() {
				// Lends on a bucket that is not stored (a limits change re-created its level):
				// store it empty — what it held is unknown, so assume nothing.
				lv := e.lim.matchKey(k)
				s = st.add([]byte(k), st.hashString(k), lv.idx)
				b := st.rec(s)
				b.last.set(uint64(e.clock))
				st.push(s, math.MaxUint32)
			}
			continue
		}
		b := st.rec(s)
		if c := e.slotRate(s).capMicro; b.tokens.get() > c {
			b.tokens.set(c)
		}
		if ls.lent() && !e.rules.sweepLent {
			st.setDue(s, math.MaxUint32)
		}
	}
}
