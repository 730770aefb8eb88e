package client

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Limiter decides admissions of one request (domain and descriptor path) locally, at memory
// speed, from a share of the path's buckets that the cluster lends to this client. It is the
// x/time/rate-style counterpart of Client.Allow: where the path is decided locally, Allow and
// AllowN answer at once from a local token bucket (no RPC, no allocation); where it is decided
// centrally (below) they are Client.Allow, one RPC that may block up to
// LimiterOptions.CentralTimeout. Wait blocks until a unit is available. AllowLocalN never
// makes an RPC: it answers no where AllowN would ask the cluster.
//
// The client holds one share lease for all its Limiters (one holder: its client ID and a
// random incarnation) and renews it in the background every term/3 ± 10 %, carrying each
// path's demand (an EWMA of the cost attempted, × 1.25). The cluster keeps the bound exact
// across holders and central callers (docs/architecture.md "Shares"). A Limiter decides
// centrally, through Client.Allow, when the path's levels do not lend (no shares in the
// limits, a concurrency limit), when its fair share is too small to lend now, when a cost is
// larger than its local bucket, and until the first grant arrives. After its grant ends
// without a renewal (cluster unreachable) it fails closed, or admits at its slice of the
// level's fallback_rate when the limits set one.
//
// A Limiter is safe for concurrent use by many goroutines; the local path is lock-free. The
// zero value is not usable: call Client.Limiter. Close it when done.
type Limiter struct {
	c       *Client
	h       *shareHolder
	p       *sharePath // nil: invalid request
	req     Request
	timeout time.Duration
	err     error
	closed  atomic.Bool
}

// LimiterOptions tune a Limiter. The zero value is usable.
type LimiterOptions struct {
	// Demand is the rate (units per second) expected before any is observed; the first
	// share request asks for this. 0: as much as is fair (the cluster's max-min share).
	Demand float64
	// MaxCost is the largest cost AllowN will be asked for at once (0: the request's Cost,
	// or 1). The cluster lends a path only if its share is at least 20 × this per term and
	// its bucket at least 2 × this.
	MaxCost uint64
	// CentralTimeout bounds a central decision (default 1s): how long Allow and AllowN block
	// on the cluster where the path is decided centrally, and what a cluster that does not
	// answer costs each such call before it reports false.
	CentralTimeout time.Duration
	// MinDemand (units per second) is the least demand the holder reports for the path, so a
	// quiet path keeps a share large enough to be lent (a regional leader, which never asks
	// centrally, would otherwise stay below the lend threshold). 0: none.
	MinDemand float64
}

// validate refuses a demand that is not a finite rate ≥ 0: NaN passed every check and was sent
// as an arbitrary huge demand (the float's conversion to an integer is undefined).
func (o LimiterOptions) validate() error {
	for _, f := range []struct {
		name string
		v    float64
	}{{"Demand", o.Demand}, {"MinDemand", o.MinDemand}} {
		if math.IsNaN(f.v) || math.IsInf(f.v, 0) || f.v < 0 {
			return fmt.Errorf("%w: LimiterOptions.%s is %v; want a finite rate ≥ 0 (units per second; 0: none)", ErrInvalid, f.name, f.v)
		}
	}
	if o.CentralTimeout < 0 {
		return fmt.Errorf("%w: LimiterOptions.CentralTimeout is %v; want ≥ 0 (0: the default, 1s)", ErrInvalid, o.CentralTimeout)
	}
	return nil
}

// ShareInfo describes a Limiter's current share of its path.
type ShareInfo struct {
	// Local: decisions are made locally (the path is lent and the grant has not ended).
	Local bool
	// Status is the cluster's answer for the path: lent, central, too_small, invalid, or
	// pending (no answer yet).
	Status string
	// Rate (units per second) and Capacity (units) of the tightest local bucket.
	Rate     float64
	Capacity float64
	// Expiry is when the grant ends (this process's clock, less the holder margin): the moment
	// the Limiter stops deciding locally on it. It stays put for one grant; it moves earlier
	// only when this process's clocks jump ahead (a VM suspend), and later with a renewal.
	Expiry time.Time
	// FallbackRate (units per second) is this holder's slice of the level's
	// shares.fallback_rate, used once the grant has ended unrenewed; 0: it fails closed then.
	FallbackRate float64
	// Message explains a central, too_small or invalid status (and, once a grant has ended,
	// what the Limiter does meanwhile).
	Message string
	// Refused is the cluster's refusal of the last renewal (Unauthenticated or
	// PermissionDenied: a revoked token, a credential without the path's domain), "" when the
	// last renewal was answered or got no answer. While it is set the path has no fallback
	// slice: once the grant in hand ends it admits nothing until a renewal is answered.
	Refused string
}

// ErrLimiterClosed is returned by Wait on a closed Limiter.
var ErrLimiterClosed = errors.New("client: limiter closed")

// Limiter returns a Limiter for req (Cost is the default cost of Allow). The first call starts
// the client's share holder. An invalid request gives a Limiter that admits nothing and whose
// Wait returns the error.
func (c *Client) Limiter(req Request, opts LimiterOptions) *Limiter {
	l := &Limiter{c: c, req: req, timeout: opts.CentralTimeout}
	if l.timeout <= 0 {
		l.timeout = time.Second
	}
	req.MaxWait, req.LeaseTTL = 0, 0
	if err := req.validate(); err != nil {
		l.err = err
		return l
	}
	if err := opts.validate(); err != nil {
		l.err = err
		return l
	}
	h, err := c.shareHolder()
	if err != nil {
		l.err = err
		return l
	}
	l.h = h
	l.p = h.addPath(req, opts)
	return l
}

// Allow is AllowN(1) (or the request's Cost).
func (l *Limiter) Allow() bool { return l.AllowN(max(l.req.Cost, 1)) }

// AllowN reports whether n units may be spent now, and if so spends them. It never waits for
// units. Locally (the path is lent, its grant has not ended or it has a fallback slice, and n
// fits the local bucket) it makes no RPC and costs a clock read and one compare-and-swap per
// lendable level. Otherwise — the path does not lend, its share is too small to lend, n is
// above the local bucket, or no grant has arrived yet (a new Limiter's first calls) — it
// asks the cluster (Client.Allow) and blocks until the answer, at most CentralTimeout; an
// error or a timeout (cluster unreachable) reports false. Use AllowLocalN where a caller
// must never wait on the network.
func (l *Limiter) AllowN(n uint64) bool {
	p := l.p
	if p == nil || l.closed.Load() {
		return false
	}
	if n == 0 {
		n = 1
	}
	p.attempts.Add(n)
	if n > p.maxCost.Load() {
		p.raiseMaxCost(n)
	}
	for {
		st := p.state.Load()
		if st.mode != modeLocal || n > st.maxLocal {
			return l.central(n, st)
		}
		slow, fast := l.h.clock.now()
		if slow < st.pausedUntil {
			// A provider pause the cluster reported binds the fallback too: the cluster being
			// unreachable does not make the provider's Retry-After shorter.
			return false
		}
		if fast >= st.endFast {
			if st.fallback == nil {
				return false
			}
			ok, _ := st.fallback.take(n, slow)
			return ok
		}
		ok, reload := st.takeAll(n, slow)
		if !reload {
			return ok
		}
		runtime.Gosched() // a new grant is being installed
	}
}

// central decides n units through the cluster.
func (l *Limiter) central(n uint64, st *pathState) bool {
	if st.mode == modeInvalid {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), l.timeout)
	defer cancel()
	r := l.req
	r.Cost = n
	_, err := l.c.Allow(ctx, r)
	return err == nil
}

// Wait blocks until one unit (or the request's Cost) is admitted or ctx ends.
func (l *Limiter) Wait(ctx context.Context) error { return l.WaitN(ctx, max(l.req.Cost, 1)) }

// WaitN blocks until n units are admitted or ctx ends (then it returns ctx's error). Where the
// path is decided centrally it is Client.Wait, and an invalid request or a credential the
// cluster refuses (codes Unauthenticated, PermissionDenied) is returned at once.
func (l *Limiter) WaitN(ctx context.Context, n uint64) error {
	if l.err != nil {
		return l.err
	}
	for {
		if l.closed.Load() {
			return ErrLimiterClosed
		}
		if l.AllowN(n) {
			return nil
		}
		st := l.p.state.Load()
		var wait time.Duration
		switch {
		case st.mode != modeLocal || n > st.maxLocal:
			r := l.req
			r.Cost = n
			if _, err := l.c.Wait(ctx, r); err == nil {
				return nil
			} else if errors.Is(err, ErrInvalid) || refusedCredential(err) {
				// Asking again cannot help: a refused credential was retried every 10 ms
				// (about 100 Acquire RPCs a second per waiter) until ctx ended.
				return err
			}
			wait = 10 * time.Millisecond
		default:
			slow, fast := l.h.clock.now()
			switch {
			case fast >= st.endFast && st.refusedErr != nil:
				// The grant ended and the cluster refused its renewal: nothing will be admitted
				// until it accepts one again, which a revoked credential never sees — waiting
				// for that blocked a caller without a deadline forever. Say so instead.
				return fmt.Errorf("quotad: Limiter: the share ended and the cluster refused its renewal: %w", st.refusedErr)
			case slow < st.pausedUntil:
				wait = time.Duration(st.pausedUntil - slow)
			case fast >= st.endFast && st.fallback == nil:
				wait = time.Second // until a renewal lands (changed wakes us)
			case fast >= st.endFast:
				wait = time.Duration(st.fallback.wait(n, slow))
			default:
				for _, g := range st.levels {
					wait = max(wait, time.Duration(g.wait(n, slow)))
				}
			}
		}
		wait = max(wait, 50*time.Microsecond)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		case <-st.changed:
			t.Stop()
		}
	}
}

// Share returns the Limiter's current share.
func (l *Limiter) Share() ShareInfo {
	if l.p == nil {
		return ShareInfo{Status: "invalid", Message: fmt.Sprint(l.err)}
	}
	st := l.p.state.Load()
	info := st.info
	info.Refused = st.refused
	if st.mode == modeLocal {
		_, fast := l.h.clock.now()
		info.Expiry = time.Now().Add(l.h.clock.untilFast(st.endFast, fast))
		info.Local = fast < st.endFast
		if !info.Local {
			// Say why nothing (or only the fallback) is admitted: Status stays the last answer.
			ago := time.Duration(fast - st.endFast).Round(time.Millisecond)
			switch {
			case st.refused != "":
				info.Message = fmt.Sprintf("the share ended %s ago and the cluster refused its renewal (%s): failing closed", ago, st.refused)
			case st.fallback != nil:
				info.Message = fmt.Sprintf("the share ended %s ago without a renewal (no answer from the cluster): admitting at this holder's slice of fallback_rate, %.3f/s", ago, st.fallbackPS)
			default:
				info.Message = fmt.Sprintf("the share ended %s ago without a renewal (no answer from the cluster): failing closed until one lands (a path admits at a fallback only if every lending level on it sets shares.fallback_rate)", ago)
			}
		}
	}
	return info
}

// Close stops the Limiter: Allow answers false from then on. When the client's last Limiter
// on the path closes, the next renewal gives the path's share back. Close is idempotent.
func (l *Limiter) Close() error {
	if l.closed.Swap(true) || l.p == nil {
		return nil
	}
	l.h.removePath(l.p)
	return nil
}

const (
	modePending uint8 = iota // no answer yet: decide centrally
	modeLocal
	modeCentral
	modeInvalid
)

// pathState is what deciders read for a path: immutable once stored (the buckets inside
// change by compare-and-swap).
type pathState struct {
	mode        uint8
	levels      []*gcra
	maxLocal    uint64 // largest cost the local buckets can hold (units)
	endFast     int64
	pausedUntil int64    // slow ns
	fallback    *gcra    // after endFast; nil: fail closed
	fallbackPS  float64  // fallback's rate, units per second (Share)
	refused     string   // the cluster refused the last renewal (credential): no fallback
	refusedErr  error    // that refusal (WaitN returns it once the grant has ended)
	keys        []string // the levels' bucket keys (re-lending, lender.go)
	info        ShareInfo
	changed     chan struct{} // closed when the next state replaces this one
}

func (st *pathState) takeAll(n uint64, now int64) (ok, reload bool) {
	for i, g := range st.levels {
		ok, sealedSeen := g.take(n, now)
		if !ok {
			for _, u := range st.levels[:i] {
				u.untake(n)
			}
			return false, sealedSeen
		}
	}
	return true, false
}

// sharePath is one path the holder shares, used by one or more Limiters.
type sharePath struct {
	key      string
	domain   string
	descs    []Entry
	attempts atomic.Uint64
	maxCost  atomic.Uint64
	state    atomic.Pointer[pathState]
	_        [32]byte

	// Under shareHolder.mu:
	refs          int
	ewma          float64 // units per second
	observed      bool
	lastAttempts  uint64
	lastAt        int64 // slow ns
	initialDemand float64
	minDemand     float64
	lentDemand    float64 // units per second re-lent downstream (lender.go; with its headroom)
}

func (p *sharePath) raiseMaxCost(n uint64) {
	for {
		m := p.maxCost.Load()
		if n <= m || p.maxCost.CompareAndSwap(m, n) {
			return
		}
	}
}

func (p *sharePath) setState(st *pathState) {
	st.changed = make(chan struct{})
	old := p.state.Swap(st)
	if old != nil {
		close(old.changed)
	}
}

func pathKey(domain string, descs []Entry) string {
	var b strings.Builder
	b.WriteString(domain)
	for _, e := range descs {
		b.WriteByte(0)
		b.WriteString(e.Key)
		b.WriteByte(0)
		b.WriteString(e.Value)
	}
	return b.String()
}

// shareHolder is the client's one share holder: the paths of its Limiters, the current
// grant's local buckets, and the renewal loop.
type shareHolder struct {
	c           *Client
	clock       *timeSource
	incarnation uint64

	mu      sync.Mutex
	paths   map[string]*sharePath
	seq     uint64 // last seq sent
	applied uint64 // last grant applied (acknowledged by the next request)
	levels  map[string]*gcra
	// granted is the newest grant's rate and burst per bucket key; lends the slices of them
	// re-lent downstream (lender.go): the local buckets hold granted − the slices charged.
	granted  map[string][2]uint64
	lends    map[string]*levelLends
	endFast  int64
	term     time.Duration
	held     bool // holds (or may hold) shares: a release is due when the paths are gone
	wake     chan struct{}
	stop     chan struct{}
	done     chan struct{}
	stopOnce sync.Once
	// Renewals counts share requests sent (for tests and benchmarks).
	renewals atomic.Uint64
	// refusals counts the renewals refused in a row (Unauthenticated, PermissionDenied); only
	// run's goroutine touches it.
	refusals int

	// feedbackMu guards feedbackLast (when Feedback last triggered a renewal) and
	// feedbackDue (one is scheduled): see pokeForFeedback.
	feedbackMu   sync.Mutex
	feedbackLast time.Time
	feedbackDue  bool
}

// feedbackRenewGap is the least time between two renewals Feedback triggers.
const feedbackRenewGap = time.Second

// pokeForFeedback renews the share now for a pause Feedback reported, at most once per
// feedbackRenewGap: a caller reporting every 429 of a provider that keeps refusing (hundreds
// a second) would otherwise have the holder renew back to back, one share request per round
// trip, each carrying every path. A report within the gap renews at its end, once.
func (h *shareHolder) pokeForFeedback() {
	h.feedbackMu.Lock()
	defer h.feedbackMu.Unlock()
	if h.feedbackDue {
		return
	}
	wait := time.Until(h.feedbackLast.Add(feedbackRenewGap))
	if wait <= 0 {
		h.feedbackLast = time.Now()
		h.poke()
		return
	}
	h.feedbackDue = true
	time.AfterFunc(wait, func() {
		h.feedbackMu.Lock()
		h.feedbackDue, h.feedbackLast = false, time.Now()
		h.feedbackMu.Unlock()
		h.poke()
	})
}

func (c *Client) shareHolder() (*shareHolder, error) {
	c.sharesOnce.Do(func() {
		var b [8]byte
		inc := uint64(time.Now().UnixNano())
		if _, err := randRead(b[:]); err == nil {
			inc ^= uint64(b[0]) | uint64(b[1])<<8 | uint64(b[2])<<16 | uint64(b[3])<<24 | uint64(b[4])<<32 | uint64(b[5])<<40 | uint64(b[6])<<48 | uint64(b[7])<<56
		}
		h := &shareHolder{c: c, clock: newTimeSource(c.cfg.LimiterClock), incarnation: inc | 1,
			paths: map[string]*sharePath{}, levels: map[string]*gcra{},
			wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
		c.shares = h
		c.sharesLive.Store(h)
		go h.run()
	})
	if c.shares == nil {
		return nil, ErrClosed
	}
	select {
	case <-c.closing:
		return nil, ErrClosed
	default:
	}
	return c.shares, nil
}

func (h *shareHolder) addPath(req Request, opts LimiterOptions) *sharePath {
	key := pathKey(req.Domain, req.Descriptors)
	h.mu.Lock()
	p := h.paths[key]
	if p == nil {
		p = &sharePath{key: key, domain: req.Domain, descs: append([]Entry(nil), req.Descriptors...), initialDemand: opts.Demand, minDemand: opts.MinDemand}
		p.setState(&pathState{mode: modePending, info: ShareInfo{Status: "pending"}})
		h.paths[key] = p
		h.poke()
	}
	p.refs++
	p.raiseMaxCost(max(opts.MaxCost, req.Cost, 1))
	h.mu.Unlock()
	return p
}

func (h *shareHolder) removePath(p *sharePath) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if p.refs--; p.refs <= 0 {
		delete(h.paths, p.key)
		h.poke()
	}
}

func (h *shareHolder) poke() {
	select {
	case h.wake <- struct{}{}:
	default:
	}
}

// run renews the share every term/3 ± 10 % (sooner when paths come and go, or after a
// failure) until the client closes.
func (h *shareHolder) run() {
	defer close(h.done)
	timer := time.NewTimer(time.Hour)
	for {
		select {
		case <-h.stop:
			timer.Stop()
			return
		case <-h.wake:
			// Let a burst of new Limiters join one request.
			select {
			case <-time.After(2 * time.Millisecond):
			case <-h.stop:
				timer.Stop()
				return
			}
		case <-timer.C:
		}
		next := h.renew()
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		timer.Reset(next)
	}
}

// renewInterval is term/3 with ±10 % jitter.
func renewInterval(term time.Duration) time.Duration {
	base := term / 3
	return base - base/10 + time.Duration(randInt63n(int64(base/5)+1))
}

// renew sends one share request (retried under the same seq until it is answered or the
// attempt's time is up) and applies the answer. It returns when to renew next.
func (h *shareHolder) renew() time.Duration {
	h.mu.Lock()
	if len(h.paths) == 0 {
		held := h.held
		h.mu.Unlock()
		if held {
			h.release(context.Background())
		}
		return time.Hour
	}
	h.seq++
	h.held = true
	seq, ack := h.seq, h.applied
	slowNow, _ := h.clock.now()
	paths := make([]*sharePath, 0, len(h.paths))
	for _, p := range h.paths {
		paths = append(paths, p)
	}
	req := &shareRequest{holderID: h.c.id, incarnation: h.incarnation, seq: seq, ack: ack}
	for _, p := range paths {
		req.paths = append(req.paths, sharePathRequest{domain: p.domain, descs: p.descs, demand: p.demand(slowNow), maxCost: p.maxCost.Load()})
	}
	term := h.term
	h.mu.Unlock()

	_, sentFast := h.clock.now() // the grant is anchored at the first attempt's send time
	timeout := 5 * time.Second
	if term > 0 {
		timeout = max(term/3, time.Second)
	}
	ctx, cancel := context.WithTimeout(h.c.baseCtx, timeout)
	defer cancel()
	h.renewals.Add(1)
	resp, err := h.c.sendShare(ctx, req)
	if err != nil {
		if refusedCredential(err) {
			h.refusals++
			// The cluster answered: this credential may no longer hold shares (a revoked
			// token). The grant in hand ends at its term; no fallback after it — fallback_rate
			// is for a cluster that cannot be reached, not for one that refuses.
			h.refused(paths, err)
			return refusedRetry(h.refusals)
		}
		return 250 * time.Millisecond // a new seq soon; the grant in hand stays valid meanwhile
	}
	h.refusals = 0
	decreased, starved := h.apply(resp, paths, sentFast)
	next := renewInterval(resp.term)
	if starved {
		// Wanting more than it holds: renew twice as often (what others give up reaches
		// it sooner), and right after a competing charge may end.
		next = min(next, renewInterval(resp.term/2))
		if resp.renewAfter > 0 {
			next = min(next, resp.renewAfter+20*time.Millisecond)
		}
	}
	if decreased {
		// A smaller share is charged at the old size until acknowledged: acknowledge soon,
		// so the capacity given up reaches the others.
		next = min(next, 200*time.Millisecond)
	}
	return next
}

// refusedCredential reports whether the cluster refused the call's credential
// (Unauthenticated: a revoked or unknown token; PermissionDenied: a credential without the
// domain or tenant) rather than giving no answer.
func refusedCredential(err error) bool {
	c := status.Code(err)
	return c == codes.Unauthenticated || c == codes.PermissionDenied
}

// refusedRetry is when to ask again after the n-th refused renewal in a row: 250 ms, then
// twice as long each time up to 5 s. A refusal can pass (a follower that has not yet applied
// a new token or limits, a limits change reverted): a fixed 5 s outlasted a grant of a lease
// under 7.5 s, and the Limiter failed closed while the cluster would have renewed it. A
// revoked credential still costs the cluster one refused request per 5 s.
func refusedRetry(n int) time.Duration {
	return min(250*time.Millisecond<<min(max(n-1, 0), 5), 5*time.Second)
}

// refused takes the fallback slice away from paths whose renewal the cluster refused
// (Unauthenticated, PermissionDenied): they decide on the grant in hand until its end, then
// fail closed until a renewal is answered again. Logged once per refusal streak.
func (h *shareHolder) refused(paths []*sharePath, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	first := false
	for _, p := range paths {
		if _, ok := h.paths[p.key]; !ok && p.refs <= 0 {
			continue
		}
		st := p.state.Load()
		if st.refused != "" {
			continue
		}
		next := *st
		next.refused, next.refusedErr = err.Error(), err
		next.fallback, next.fallbackPS, next.info.FallbackRate = nil, 0, 0
		p.setState(&next)
		first = true
	}
	if first {
		h.c.logger().Warn("quotad: the cluster refused this client's share renewal; its Limiters decide on the grant in hand until it ends, then admit nothing (no fallback_rate)", "err", err)
	}
}

// demandTau is the time constant of the demand EWMA: an interval of length Δt weighs
// 1 − e^(−Δt/τ) (about 0.86 for a 5 s renewal interval).
const demandTau = 2500 * time.Millisecond

// demand is the path's demand in micro-units per second: an EWMA of attempted cost, × 1.25.
func (p *sharePath) demand(slowNow int64) uint64 {
	a := p.attempts.Load()
	if p.lastAt != 0 && slowNow-p.lastAt >= int64(100*time.Millisecond) {
		dt := float64(slowNow - p.lastAt)
		rate := float64(a-p.lastAttempts) / (dt / 1e9)
		if p.observed {
			w := 1 - math.Exp(-dt/float64(demandTau))
			p.ewma = p.ewma*(1-w) + rate*w
		} else {
			p.ewma, p.observed = rate, true
		}
		p.lastAttempts, p.lastAt = a, slowNow
	} else if p.lastAt == 0 {
		p.lastAttempts, p.lastAt = a, max(slowNow, 1)
	}
	d := p.ewma
	if !p.observed {
		if p.initialDemand <= 0 {
			return math.MaxUint64
		}
		d = p.initialDemand
	}
	d = max(d, p.minDemand/1.25) + p.lentDemand/1.25
	v := d * 1.25 * 1e6
	if v >= math.MaxUint64/2 {
		return math.MaxUint64
	}
	return uint64(v)
}

// apply installs an answer: new local buckets (first grants start at their initial tokens;
// others carry the old balance, clamped to the new burst, if the old grant had not ended),
// then the paths' new states. The old buckets are sealed first, so no decision is lost
// between them.
//
// It reports whether a bucket's share decreased (rate or burst below the previous grant's)
// and whether a lent path wants more than it holds (starved).
func (h *shareHolder) apply(resp *shareResponse, paths []*sharePath, sentFast int64) (decreased, starved bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	slow, fast := h.clock.now()
	live := fast < h.endFast
	termNs := int64(resp.term)
	endFast := sentFast + termNs - int64(resp.margin)
	next := map[string]*gcra{}
	granted := map[string][2]uint64{}
	for i, pr := range resp.paths {
		if i >= len(paths) || pr.status != "lent" {
			continue
		}
		for _, lv := range pr.levels {
			if next[lv.key] != nil {
				continue
			}
			var carried uint64
			if old := h.levels[lv.key]; old != nil {
				prev := h.granted[lv.key]
				decreased = decreased || lv.rate < prev[0] || lv.burst < prev[1]
				carried = old.seal(slow)
				delete(h.levels, lv.key)
			}
			tokens := uint64(0)
			switch {
			case lv.first:
				tokens = lv.initial
			case live:
				tokens = carried
			}
			// Slices re-lent downstream (lender.go) are charged against the grant: the local
			// bucket holds the rest.
			cr, cb := h.lentCharged(lv.key, fast, "")
			lr, lb := sub0(lv.rate, cr), sub0(lv.burst, cb)
			next[lv.key] = newGCRA(lr, lb, min(tokens, lb), slow, termNs)
			granted[lv.key] = [2]uint64{lv.rate, lv.burst}
		}
	}
	for _, old := range h.levels {
		old.seal(slow)
		decreased = true // a share given up entirely
	}
	// A grant smaller than the slices still lent downstream is not acknowledged: the global
	// cluster keeps charging the last acknowledged one (which covers them) until they end.
	gated := h.lendsExceed(granted, fast)
	h.levels, h.endFast, h.term, h.granted = next, endFast, resp.term, granted
	if !gated {
		h.applied = resp.seq
	} else {
		decreased = false // nothing to acknowledge early
	}
	expiry := time.Now().Add(h.clock.untilFast(endFast, fast))
	for i, p := range paths {
		if i >= len(resp.paths) {
			break
		}
		pr := resp.paths[i]
		st := &pathState{mode: modeCentral, info: ShareInfo{Status: pr.status, Message: pr.message}}
		switch pr.status {
		case "invalid":
			st.mode = modeInvalid
		case "lent":
			st.mode, st.endFast, st.maxLocal = modeLocal, endFast, math.MaxUint64
			st.pausedUntil = slow + pr.pausedFor.Nanoseconds()
			rate, capacity := math.Inf(1), math.Inf(1)
			for _, lv := range pr.levels {
				g := next[lv.key]
				st.levels, st.keys = append(st.levels, g), append(st.keys, lv.key)
				st.maxLocal = min(st.maxLocal, lv.burst/1e6)
				rate, capacity = min(rate, float64(lv.rate)/1e6), min(capacity, float64(lv.burst)/1e6)
			}
			if pr.fallback > 0 {
				burst := max(uint64(1e6), p.maxCost.Load()*1e6)
				fb := pr.fallback
				if plantedFallbackAtShareRate {
					fb = uint64(rate * 1e6)
				}
				st.fallback = newGCRA(fb, burst, 0, slow, math.MaxInt64/(2*timeScale))
				st.fallbackPS = float64(fb) / 1e6
				st.info.FallbackRate = float64(fb) / 1e6
			}
			st.info.Rate, st.info.Capacity, st.info.Expiry, st.info.Local = rate, capacity, expiry, true
			if p.observed && rate < 0.9*p.ewma {
				starved = true
			}
		case "too_small":
			// Starved only if the path would be lent with room: r·term ≥ 20 × its cost.
			cost := float64(max(p.maxCost.Load(), 1))
			starved = starved || p.observed && p.ewma*1.25*resp.term.Seconds() >= 20*cost
			if st.info.Message == "" {
				// The cluster sends no message for it: a user watching Share saw only
				// "too_small" while every Allow became an RPC.
				st.info.Message = fmt.Sprintf("not lent: this holder's fair share of the path (from its demand, the other holders' and the central callers') is under the lend threshold — 20 × its largest cost (%.0f) per %v term, and a bucket of 2 × it — or nothing is left to lend now; decided centrally (each Allow is a call to the cluster) until it grows",
					cost, resp.term)
			}
		}
		if _, ok := h.paths[p.key]; ok || p.refs > 0 {
			p.setState(st)
		}
	}
	if gated {
		// Renew at the regular pace: each renewal is a grant the cluster holds unacknowledged
		// (at most quota.MaxUnackedGrants) until the slices end.
		starved = false
	}
	return decreased, starved
}

// release gives the shares back: the local buckets are sealed (no decision after this) and
// their balances returned.
func (h *shareHolder) release(ctx context.Context) {
	h.mu.Lock()
	slow, fast := h.clock.now()
	live := fast < h.endFast
	if h.lendsLive(fast) {
		// Slices of the grant are still lent downstream: a release would let the cluster stop
		// charging them. Seal the local buckets and let the grant end by itself.
		for _, g := range h.levels {
			g.seal(slow)
		}
		h.levels = map[string]*gcra{}
		h.held = false
		h.mu.Unlock()
		return
	}
	var toks []levelTokens
	for k, g := range h.levels {
		if b := g.seal(slow); live && b > 0 {
			toks = append(toks, levelTokens{key: k, tokens: b})
		}
	}
	h.levels = map[string]*gcra{}
	h.endFast = 0
	h.seq++
	seq := h.seq
	h.held = false
	h.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	_ = h.c.sendReleaseShare(ctx, h.incarnation, seq, toks)
}

// close stops renewing and releases the shares (best effort, about a second).
func (h *shareHolder) close() {
	h.stopOnce.Do(func() {
		close(h.stop)
		<-h.done
		h.mu.Lock()
		held := h.held
		for _, p := range h.paths {
			p.setState(&pathState{mode: modeInvalid, info: ShareInfo{Status: "closed"}})
		}
		h.mu.Unlock()
		if held {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			h.release(ctx)
			cancel()
		}
		h.clock.close()
	})
}
