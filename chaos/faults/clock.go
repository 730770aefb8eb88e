package faults

import (
	"sync"
	"time"
	"unsafe"
)

// Clock is a node clock the chaos suite can skew. It models the two ways a real host clock goes
// wrong, separately, because Go keeps two readings in every time.Time:
//
//   - An offset (set, or jumped forward or back) moves the wall reading only, as an NTP step or
//     an operator's `date -s` would. The monotonic reading is untouched, so code that only
//     subtracts readings (t.Sub, time.Since) sees nothing; code that uses the wall time
//     (t.UnixNano, t.Unix) sees the jump.
//   - A rate (1 = real time, 1.5 = 50% fast) is an oscillator error: both readings advance at
//     rate× real time from the moment the rate is set. It is piecewise linear and continuous, so
//     changing the rate never makes the clock jump.
//
// Now implements cluster.Clock. The zero value is not usable; use NewClock. Safe for
// concurrent use.
type Clock struct {
	mu sync.Mutex
	// origin is the real time.Now() at NewClock; every reading is origin.Add(virtual elapsed),
	// which keeps a monotonic reading in it.
	origin time.Time
	// anchorReal is the real time of the last rate change and anchorVirt the virtual elapsed
	// time at that moment.
	anchorReal time.Time
	anchorVirt time.Duration
	rate       float64
	offset     time.Duration
}

// NewClock returns a clock that reads real time until skewed.
func NewClock() *Clock {
	now := time.Now()
	return &Clock{origin: now, anchorReal: now, rate: 1}
}

// Now returns the skewed time: monotonic reading scaled by the rate, wall reading scaled by the
// rate and shifted by the offset.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nowLocked(time.Now())
}

func (c *Clock) virtualLocked(real time.Time) time.Duration {
	return c.anchorVirt + time.Duration(float64(real.Sub(c.anchorReal))*c.rate)
}

func (c *Clock) nowLocked(real time.Time) time.Time {
	mono := c.origin.Add(c.virtualLocked(real))
	return withWallOffset(mono, c.offset)
}

// SetRate makes the clock run at rate× real time from now on (rate > 0).
func (c *Clock) SetRate(rate float64) {
	if rate <= 0 {
		rate = 1
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	real := time.Now()
	c.anchorVirt = c.virtualLocked(real)
	c.anchorReal = real
	c.rate = rate
}

// SetOffset sets the wall-clock offset (a step to real+rate-drift+offset).
func (c *Clock) SetOffset(offset time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.offset = offset
}

// Jump adds d (negative: a jump back) to the wall-clock offset.
func (c *Clock) Jump(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.offset += d
}

// Reset sets the rate back to 1 and the offset to 0. Drift accumulated while the rate was
// skewed stays in the monotonic reading (a real oscillator does not run backwards either), so
// readings never decrease.
func (c *Clock) Reset() {
	c.SetRate(1)
	c.SetOffset(0)
}

// ClockState is a Clock's settings, as the HTTP handler reports them.
type ClockState struct {
	Rate   float64 `json:"rate"`
	Offset string  `json:"offset"`
	// DriftMs is how far the monotonic reading is ahead of real elapsed time.
	DriftMs int64 `json:"drift_ms"`
	// Now is the skewed wall reading (RFC 3339).
	Now string `json:"now"`
}

// State returns the clock's settings.
func (c *Clock) State() ClockState {
	c.mu.Lock()
	defer c.mu.Unlock()
	real := time.Now()
	drift := c.virtualLocked(real) - real.Sub(c.origin)
	return ClockState{
		Rate: c.rate, Offset: c.offset.String(), DriftMs: drift.Milliseconds(),
		Now: c.nowLocked(real).Format(time.RFC3339Nano),
	}
}

// goTime mirrors the layout of time.Time (wall uint64, ext int64, loc *Location), unchanged
// since Go 1.9. With the hasMonotonic bit set in wall, ext is the monotonic reading.
type goTime struct {
	wall uint64
	ext  int64
	loc  *time.Location
}

const hasMonotonic = 1 << 63

// wallOffsetSupported is decided once by a self-test; if a future Go changes the layout of
// time.Time, the offset falls back to moving both readings (and WallOffsetSupported reports it).
var wallOffsetSupported = selfTestWallOffset()

// WallOffsetSupported reports whether clock offsets move only the wall reading (true on every
// Go release so far). When false, an offset also moves the monotonic reading, which a correct
// quotad would then see as a jump.
func WallOffsetSupported() bool { return wallOffsetSupported }

// withWallOffset returns mono with its wall reading moved by offset and its monotonic reading
// unchanged. The Go API has no way to build such a time (Add moves both readings), so the
// monotonic part is copied back from the original.
func withWallOffset(mono time.Time, offset time.Duration) time.Time {
	if offset == 0 {
		return mono
	}
	shifted := mono.Add(offset)
	if !wallOffsetSupported {
		return shifted
	}
	src := (*goTime)(unsafe.Pointer(&mono))
	dst := (*goTime)(unsafe.Pointer(&shifted))
	if src.wall&hasMonotonic == 0 || dst.wall&hasMonotonic == 0 {
		return shifted // no monotonic reading to preserve (or the offset overflowed it)
	}
	dst.ext = src.ext
	return shifted
}

func selfTestWallOffset() bool {
	if unsafe.Sizeof(time.Time{}) != unsafe.Sizeof(goTime{}) {
		return false
	}
	a := time.Now()
	b := a.Add(time.Second)
	shifted := b.Add(3 * time.Hour)
	src := (*goTime)(unsafe.Pointer(&b))
	dst := (*goTime)(unsafe.Pointer(&shifted))
	if src.wall&hasMonotonic == 0 || dst.wall&hasMonotonic == 0 {
		return false
	}
	dst.ext = src.ext
	return shifted.Sub(a) == time.Second && // monotonic: the offset is invisible
		shifted.Round(0).Sub(a.Round(0)) == time.Second+3*time.Hour // wall: it is visible
}
