package client

import (
	"math"
	"math/bits"
	"runtime"
	"sync/atomic"
)

// gcra is one local token bucket of a share, as a generic cell rate algorithm: one atomic
// "theoretical arrival time" (tat), so a decision is one compare-and-swap with no lock. It
// is equivalent to a token bucket of capacity burst refilled at rate: the balance at time t
// is (tau − (max(tat, t) − t)) / interval units.
//
// Times are slow-clock nanoseconds × timeScale since the holder started (fractions of a
// nanosecond per micro-unit matter at high rates). A bucket is replaced, never changed: the
// holder seals it (tat = sealed) when a new grant arrives, reading its final balance, and
// deciders that meet a sealed bucket load the path's new state.
type gcra struct {
	tat      atomic.Int64
	interval int64 // scaled ns per unit, ≥ 1
	tau      int64 // scaled ns: burst × interval
	// maxTat caps what this grant admits: at most its starting balance + rate × term units.
	maxTat int64
	rate   uint64 // micro-units per second
	burst  uint64 // micro-units
	_      [24]byte
}

const (
	timeScale = 256
	sealed    = math.MaxInt64
)

func scaled(ns int64) int64 { return ns * timeScale }

// newGCRA returns a bucket of rate (micro-units/s) and burst (micro-units) holding tokens
// (micro-units) at slow time now (ns), admitting at most tokens + rate·term.
func newGCRA(rate, burst, tokens uint64, now, termNs int64) *gcra {
	g := &gcra{rate: rate, burst: burst}
	// interval = 1e9 ns × 1e6 micro × timeScale / rate, rounded up (never faster).
	const unit = uint64(1e15) * timeScale
	q := unit / max(rate, 1)
	if unit%max(rate, 1) != 0 {
		q++
	}
	g.interval = int64(min(q, math.MaxInt64/4)) // a cap never reached above 1e-13 units/s
	g.tau = microToScaled(burst, g.interval)
	tokens = min(tokens, burst)
	t0 := scaled(now) + microToScaled(burst-tokens, g.interval)
	g.tat.Store(t0)
	g.maxTat = satAdd64(scaled(now)+g.tau, scaled(termNs))
	return g
}

// microToScaled converts micro-units to scaled time at interval per unit (rounded up).
func microToScaled(micro uint64, interval int64) int64 {
	hi, lo := bits.Mul64(micro, uint64(interval))
	if hi >= 1e6 {
		return math.MaxInt64 / 4
	}
	q, rem := bits.Div64(hi, lo, 1e6)
	if rem != 0 {
		q++
	}
	return int64(min(q, math.MaxInt64/4))
}

func satAdd64(a, b int64) int64 {
	if b > 0 && a > math.MaxInt64-b {
		return math.MaxInt64 - 1
	}
	return a + b
}

// take debits n units at slow time now. ok: admitted. sealedSeen: the bucket was replaced;
// reload the path state and try again.
func (g *gcra) take(n uint64, now int64) (ok, sealedSeen bool) {
	cost := int64(n) * g.interval
	if n > uint64(math.MaxInt64/4)/uint64(g.interval) {
		return false, false
	}
	sn := scaled(now)
	for {
		tat := g.tat.Load()
		if tat == sealed {
			return false, true
		}
		next := max(tat, sn) + cost
		if next-sn > g.tau || next > g.maxTat {
			return false, false
		}
		if g.tat.CompareAndSwap(tat, next) {
			return true, false
		}
	}
}

// untake gives back n units taken by take (an all-or-nothing decision that failed at
// another level). On a sealed bucket it does nothing: the units were counted in the seal.
func (g *gcra) untake(n uint64) {
	cost := int64(n) * g.interval
	for {
		tat := g.tat.Load()
		if tat == sealed || g.tat.CompareAndSwap(tat, tat-cost) {
			return
		}
		runtime.Gosched()
	}
}

// seal ends the bucket and returns its balance in micro-units at slow time now.
func (g *gcra) seal(now int64) uint64 {
	tat := g.tat.Swap(sealed)
	if tat == sealed {
		return 0
	}
	return g.balanceAt(tat, now)
}

// balance is the bucket's balance in micro-units at now (0 when sealed).
func (g *gcra) balance(now int64) uint64 {
	tat := g.tat.Load()
	if tat == sealed {
		return 0
	}
	return g.balanceAt(tat, now)
}

func (g *gcra) balanceAt(tat, now int64) uint64 {
	sn := scaled(now)
	left := g.tau - (max(tat, sn) - sn)
	if left <= 0 {
		return 0
	}
	// micro = left × 1e6 / interval, rounded down.
	hi, lo := bits.Mul64(uint64(left), 1e6)
	if hi >= uint64(g.interval) {
		return g.burst
	}
	q, _ := bits.Div64(hi, lo, uint64(g.interval))
	return min(q, g.burst)
}

// wait returns how long (slow ns) until n units are available, at now.
func (g *gcra) wait(n uint64, now int64) int64 {
	tat := g.tat.Load()
	if tat == sealed {
		return 0
	}
	sn := scaled(now)
	next := max(tat, sn) + int64(n)*g.interval
	if d := next - sn - g.tau; d > 0 {
		return d/timeScale + 1
	}
	return 0
}
