package client

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestGCRARateBurstAndCap(t *testing.T) {
	const s = int64(time.Second)
	// 100 units/s, burst 10, starting with 4, term 1s: at most 4 + 100 units over the grant.
	g := newGCRA(100e6, 10e6, 4e6, 0, s)
	n := 0
	for g.takeOK(1, 0) {
		n++
	}
	if n != 4 {
		t.Fatalf("at 0: %d admitted, want the 4 initial", n)
	}
	if g.takeOK(1, int64(9*time.Millisecond)) || !g.takeOK(1, int64(10*time.Millisecond)) {
		t.Fatal("one unit every 10ms at 100/s")
	}
	if b := g.balance(int64(time.Second)); b != 10e6 {
		t.Fatalf("balance after a second: %d, want the burst", b)
	}
	// Over the whole term: never more than initial + rate·term.
	total := 5
	for ts := int64(10 * time.Millisecond); ts <= 3*s; ts += int64(time.Millisecond) {
		for g.takeOK(1, ts) {
			total++
		}
	}
	if total > 4+100 {
		t.Fatalf("admitted %d over the grant, cap is 104", total)
	}
	// Seal: the balance comes back once; takes then ask for a reload.
	h := newGCRA(100e6, 10e6, 7e6, 0, s)
	if b := h.seal(0); b != 7e6 {
		t.Fatalf("sealed balance %d, want 7e6", b)
	}
	if ok, reload := h.take(1, 0); ok || !reload {
		t.Fatal("a sealed bucket must ask for a reload")
	}
	// untake gives back exactly what take took.
	u := newGCRA(100e6, 10e6, 3e6, 0, s)
	u.take(2, 0)
	u.untake(2)
	if b := u.balance(0); b != 3e6 {
		t.Fatalf("after take+untake: %d", b)
	}
}

func (g *gcra) takeOK(n uint64, now int64) bool { ok, _ := g.take(n, now); return ok }

// realish is a fake clock that follows real time, with offsets tests add.
type realish struct {
	start           time.Time
	rawOff, bootOff atomic.Int64
	rawStop         atomic.Bool
	stoppedRaw      atomic.Int64
}

func newRealish() *realish { return &realish{start: time.Now()} }

func (r *realish) Now() (int64, int64) {
	d := int64(time.Since(r.start))
	raw := d + r.rawOff.Load()
	if r.rawStop.Load() {
		raw = r.stoppedRaw.Load()
	}
	return raw, d + r.bootOff.Load()
}

const shareTestLimits = `
domain: shared
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
shares: {lease: 3s}
---
domain: backup
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
shares: {lease: 3s, fallback_rate: 100}
---
domain: plain
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
`

func waitLocal(t *testing.T, l *Limiter) ShareInfo {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if s := l.Share(); s.Local {
			return s
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("no local share: %+v", l.Share())
	return ShareInfo{}
}

func TestLimiterDecidesLocallyWithinItsShare(t *testing.T) {
	tc := &testCluster{startShareCluster(t)}
	c := newTestClient(t, tc.addrs(), nil)
	lim := c.Limiter(Request{Domain: "shared"}, LimiterOptions{})
	defer lim.Close()
	s := waitLocal(t, lim)
	if s.Rate != 900 || s.Capacity != 900 || time.Until(s.Expiry) > 3*time.Second {
		t.Fatalf("share %+v, want 900/s, 900, under 3s", s)
	}
	before := tc.Agent(tc.WaitLeader(5 * time.Second)).FSM().AppliedIndex()
	start := time.Now()
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for time.Since(start) < 1500*time.Millisecond {
				if lim.Allow() {
					admitted.Add(1)
				}
			}
		})
	}
	wg.Wait()
	el := time.Since(start).Seconds()
	entries := tc.Agent(tc.WaitLeader(5*time.Second)).FSM().AppliedIndex() - before
	// Local: within 900 initial + 900/s (its share); the log saw renewals and ticks only.
	if a := float64(admitted.Load()); a > 900+900*el+1 || a < 900*el {
		t.Fatalf("admitted %.0f in %.2fs, want about 900 + 900/s", a, el)
	}
	if entries > 10 {
		t.Fatalf("%d log entries for %d local decisions", entries, admitted.Load())
	}
	if n := testing.AllocsPerRun(1000, func() { lim.Allow() }); n != 0 {
		t.Fatalf("Allow allocates %.1f times per call", n)
	}
}

func TestLimiterCentralWhenTheLevelDoesNotLend(t *testing.T) {
	tc := &testCluster{startShareCluster(t)}
	c := newTestClient(t, tc.addrs(), nil)
	lim := c.Limiter(Request{Domain: "plain"}, LimiterOptions{})
	defer lim.Close()
	deadline := time.Now().Add(10 * time.Second)
	for lim.Share().Status != "central" && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if s := lim.Share(); s.Status != "central" || s.Local {
		t.Fatalf("share %+v, want central", s)
	}
	if !lim.Allow() {
		t.Fatal("central Allow refused a full bucket")
	}
	// A cost above the local bucket goes central too.
	big := c.Limiter(Request{Domain: "shared"}, LimiterOptions{})
	defer big.Close()
	waitLocal(t, big)
	if !big.AllowN(950) { // above the 900 lent, within the 1000 bucket? central holds 100: refused
		t.Log("cost above the local bucket was refused centrally (central part holds only the reserve)")
	}
}

// A suspended VM: BOOTTIME jumps past the grant's end while RAW (and Go's clock) stand
// still. The Limiter must stop at once (fail closed), then recover with the next renewal.
func TestLimiterFailsClosedWhenBootTimeJumps(t *testing.T) {
	tc := &testCluster{startShareCluster(t)}
	clk := newRealish()
	c := newTestClient(t, tc.addrs(), func(cfg *Config) { cfg.LimiterClock = clk })
	lim := c.Limiter(Request{Domain: "shared"}, LimiterOptions{})
	defer lim.Close()
	waitLocal(t, lim)
	if !lim.Allow() {
		t.Fatal("local Allow refused")
	}
	clk.bootOff.Add(int64(10 * time.Second))
	if lim.Allow() {
		t.Fatal("admitted after BOOTTIME passed the grant's end")
	}
	// The next renewal (within a second: 3s/3) brings a fresh grant (demand keeps it lent).
	deadline := time.Now().Add(10 * time.Second)
	for ok := lim.Allow(); !(ok && lim.Share().Local); ok = lim.Allow() {
		if time.Now().After(deadline) {
			t.Fatalf("no local admission after the renewal: %+v", lim.Share())
		}
		time.Sleep(time.Millisecond)
	}
}

// A stopped RAW clock refills nothing (refill follows the slower clock).
func TestLimiterRefillsOnTheSlowerClock(t *testing.T) {
	tc := &testCluster{startShareCluster(t)}
	clk := newRealish()
	c := newTestClient(t, tc.addrs(), func(cfg *Config) { cfg.LimiterClock = clk })
	lim := c.Limiter(Request{Domain: "shared"}, LimiterOptions{})
	defer lim.Close()
	waitLocal(t, lim)
	for lim.Allow() {
	}
	raw, _ := clk.Now()
	clk.stoppedRaw.Store(raw)
	clk.rawStop.Store(true)
	time.Sleep(300 * time.Millisecond)
	if lim.Allow() {
		t.Fatal("refilled while CLOCK_MONOTONIC_RAW stood still")
	}
}

// After the lease ends without a renewal, a level with fallback_rate admits at the holder's
// slice of it; one without fails closed.
func TestLimiterFallbackAfterExpiry(t *testing.T) {
	tc := &testCluster{startShareCluster(t)}
	clk := newRealish()
	c := newTestClient(t, tc.addrs(), func(cfg *Config) { cfg.LimiterClock = clk })
	fb := c.Limiter(Request{Domain: "backup"}, LimiterOptions{})
	closed := c.Limiter(Request{Domain: "shared"}, LimiterOptions{})
	defer fb.Close()
	defer closed.Close()
	waitLocal(t, fb)
	waitLocal(t, closed)
	// Every node gone: no renewal can land.
	for i := range 3 {
		tc.Kill(i)
	}
	clk.bootOff.Add(int64(10 * time.Second))
	clk.rawOff.Add(int64(10 * time.Second))
	if closed.Allow() {
		t.Fatal("fail-closed level admitted after its lease")
	}
	// Share says why: a user watching it saw Status "lent" and no message while nothing was
	// admitted.
	if s := closed.Share(); s.Local || !strings.Contains(s.Message, "failing closed") {
		t.Fatalf("fail-closed share after its end: %+v, want a message saying it fails closed", s)
	}
	if s := fb.Share(); s.Local || !strings.Contains(s.Message, "fallback_rate, 100.000/s") {
		t.Fatalf("fallback share after its end: %+v, want a message naming the fallback rate", s)
	}
	n := 0
	start := time.Now()
	for time.Since(start) < 500*time.Millisecond {
		if fb.Allow() {
			n++
		}
		time.Sleep(100 * time.Microsecond)
	}
	// 100/s fallback, one holder: ~50 in 0.5s (+1 burst).
	if n < 30 || n > 60 {
		t.Fatalf("fallback admitted %d in 0.5s, want about 50", n)
	}
}

func TestLimiterWaitAndCloseReleases(t *testing.T) {
	tc := &testCluster{startShareCluster(t)}
	c := newTestClient(t, tc.addrs(), nil)
	lim := c.Limiter(Request{Domain: "shared"}, LimiterOptions{})
	waitLocal(t, lim)
	for lim.Allow() {
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	start := time.Now()
	for range 5 {
		if err := lim.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if el := time.Since(start); el < 3*time.Millisecond || el > 500*time.Millisecond {
		t.Fatalf("5 waits at 900/s took %v", el)
	}
	lim.Close()
	if lim.Allow() {
		t.Fatal("a closed Limiter admitted")
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	// The release ended the lend: the whole rate is central again.
	c2 := newTestClient(t, tc.addrs(), nil)
	st, err := c2.Status(context.Background(), "shared")
	if err != nil {
		t.Fatal(err)
	}
	if st.Buckets[0].Limit != 1000 {
		t.Fatalf("after Close: %+v, want the lend returned", st.Buckets[0])
	}
}

// Bad LimiterOptions give a Limiter that admits nothing and whose Wait names the option
// (the package's rule for bad input); before, a NaN demand was sent as an arbitrary number.
func TestLimiterRejectsBadOptions(t *testing.T) {
	c, err := New(Config{Addrs: []string{"127.0.0.1:1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	req := Request{Domain: "d", Descriptors: Descriptors("tenant", "acme")}
	for _, tc := range []struct {
		opts LimiterOptions
		want string
	}{
		{LimiterOptions{Demand: math.NaN()}, "LimiterOptions.Demand is NaN"},
		{LimiterOptions{Demand: -1}, "LimiterOptions.Demand is -1"},
		{LimiterOptions{MinDemand: math.Inf(1)}, "LimiterOptions.MinDemand is +Inf"},
		{LimiterOptions{CentralTimeout: -time.Second}, "LimiterOptions.CentralTimeout is -1s"},
	} {
		l := c.Limiter(req, tc.opts)
		if l.Allow() {
			t.Errorf("%+v: admitted", tc.opts)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := l.Wait(ctx)
		cancel()
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: Wait = %v, want ErrInvalid naming %q", tc.opts, err, tc.want)
		}
		if s := l.Share(); s.Status != "invalid" || !strings.Contains(s.Message, tc.want) {
			t.Errorf("%+v: Share = %+v, want invalid naming %q", tc.opts, s, tc.want)
		}
		l.Close()
	}
}
