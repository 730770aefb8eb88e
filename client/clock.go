package client

import (
	"sync"
	"sync/atomic"
	"time"
)

// LimiterClock reads the two clocks a Limiter times its shares with: CLOCK_MONOTONIC_RAW
// (the oscillator, never slewed by NTP, stopped in a VM suspend) and CLOCK_BOOTTIME (which
// counts a suspend), in nanoseconds from any fixed origin. A Limiter refills on the slower of
// the two and ends its grants on the faster, so neither NTP slew nor a suspend makes it
// admit more than its share. Implementations must be safe for concurrent use and never run
// backwards. Tests and the chaos suite set one (Config.LimiterClock) to slew or stop clocks.
type LimiterClock interface {
	Now() (raw, boot int64)
}

// timeSource turns a LimiterClock into the Limiter's two times (nanoseconds since the holder
// started): slow advances by the smaller of the two clocks' increments between reads
// (refill), fast by the larger (expiry). Increments, not totals: after a suspend RAW lags
// BOOTTIME for good, and min(RAW elapsed, BOOTTIME elapsed) would then follow RAW alone, so a
// RAW clock running fast would refill faster than real time (chaos seed 1796130439308053904:
// RAW stopped 6.3 s, later at 1.5×, the holder admitted 1.5× its share).
//
// With the system clocks, reading them costs two system calls (x/sys/unix does not use the
// vDSO), too slow for the hot path: a sampler reads them every millisecond, and the hot path
// extrapolates from the last sample with Go's monotonic clock (vDSO), conservatively (slow
// grows 0.1 % slower, fast 0.1 % faster than it; NTP slews it by at most 0.05 %). Go's
// monotonic clock stops in a suspend, so for up to one sample period after a resume, fast
// lags BOOTTIME; the holder margin (ShareMarginHolder) covers that as it covers a pause
// between a check and its use.
type timeSource struct {
	hook LimiterClock // nil: the system clocks, sampled

	mu                sync.Mutex // guards the accumulation in read
	lastRaw, lastBoot int64      // the clocks at the last read
	slow, fast        int64      // accumulated

	base    time.Time
	sample  atomic.Pointer[clockSample]
	stop    chan struct{}
	stopped sync.WaitGroup
}

type clockSample struct {
	mono       int64 // time.Since(base) when sampled
	slow, fast int64
}

const samplePeriod = time.Millisecond

func newTimeSource(hook LimiterClock) *timeSource {
	ts := &timeSource{hook: hook, base: time.Now(), stop: make(chan struct{})}
	c := hook
	if c == nil {
		c = systemClock{}
	}
	ts.lastRaw, ts.lastBoot = c.Now()
	if hook == nil {
		ts.sample.Store(&clockSample{})
		ts.stopped.Add(1)
		go ts.sampler()
	}
	return ts
}

func (ts *timeSource) read(c LimiterClock) (slow, fast int64) {
	r, b := c.Now()
	ts.mu.Lock()
	defer ts.mu.Unlock()
	// Concurrent readers may lock out of order: a clock never steps back here.
	dr, db := max(r-ts.lastRaw, 0), max(b-ts.lastBoot, 0)
	ts.lastRaw, ts.lastBoot = max(r, ts.lastRaw), max(b, ts.lastBoot)
	ts.slow += min(dr, db)
	ts.fast += max(dr, db)
	return ts.slow, ts.fast
}

func (ts *timeSource) sampler() {
	defer ts.stopped.Done()
	t := time.NewTicker(samplePeriod)
	defer t.Stop()
	for {
		select {
		case <-ts.stop:
			return
		case <-t.C:
		}
		mono := int64(time.Since(ts.base))
		slow, fast := ts.read(systemClock{})
		prev := ts.sample.Load()
		// Never backwards. fast keeps what was extrapolated (an expiry never un-happens);
		// slow may fall behind an extrapolation by its 0.1 % (a refill then waits).
		_, pf := prev.extrapolate(mono)
		ts.sample.Store(&clockSample{mono: mono, slow: max(slow, prev.slow), fast: max(fast, pf)})
	}
}

func (s *clockSample) extrapolate(mono int64) (slow, fast int64) {
	d := max(mono-s.mono, 0)
	return s.slow + d - d>>10, s.fast + d + d>>10
}

// untilFast is how long from now, in real time, until fast (read now) reaches end, with the
// clocks running at their normal rate. With the system clocks fast runs 1/1024 ahead of
// Go's monotonic clock (extrapolate; the sampler keeps what was extrapolated), so a span of
// fast is 1024/1025 of it in real time: taking it as real time made an expiry computed from
// it (ShareInfo.Expiry) move ~1 ms earlier per second as the span shrank. A LimiterClock
// hook's fast runs at the faster clock's own rate.
func (ts *timeSource) untilFast(end, fast int64) time.Duration {
	d := end - fast
	if ts.hook == nil {
		d -= d / 1025
	}
	return time.Duration(d)
}

// now returns (slow, fast) nanoseconds since the holder started.
func (ts *timeSource) now() (slow, fast int64) {
	if ts.hook != nil {
		return ts.read(ts.hook)
	}
	return ts.sample.Load().extrapolate(int64(time.Since(ts.base)))
}

func (ts *timeSource) close() {
	if ts.hook == nil {
		close(ts.stop)
		ts.stopped.Wait()
	}
}
