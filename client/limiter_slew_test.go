package client

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotad/quotad/rpc/rpctest"
)

// slewClock runs RAW at rate× real time (BOOTTIME at 1×) from when slew is called.
type slewClock struct {
	mu    sync.Mutex
	start time.Time
	at    time.Duration
	raw0  float64
	rate  float64
}

func (s *slewClock) Now() (int64, int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := time.Since(s.start)
	return int64(s.raw0 + float64(d-s.at)*s.rate), int64(d)
}

func (s *slewClock) slew(rate float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := time.Since(s.start)
	s.raw0 += float64(d-s.at) * s.rate
	s.at, s.rate = d, rate
}

// A RAW clock running fast must not make the Limiter admit faster than its share (refill
// follows the slower clock), across renewals.
func TestLimiterFastRawClockAdmitsNoMore(t *testing.T) {
	tc := &testCluster{startShareCluster(t)}
	clk := &slewClock{start: time.Now(), rate: 1}
	c := newTestClient(t, tc.addrs(), func(cfg *Config) { cfg.LimiterClock = clk })
	lim := c.Limiter(Request{Domain: "shared"}, LimiterOptions{})
	defer lim.Close()
	s := waitLocal(t, lim)
	for lim.Allow() {
	}
	clk.slew(1.5)
	start := time.Now()
	n := 0
	for time.Since(start) < 3*time.Second {
		if lim.Allow() {
			n++
		}
	}
	el := time.Since(start).Seconds()
	t.Logf("share %.0f/s: admitted %d in %.2fs (%.0f/s) with RAW at 1.5x", s.Rate, n, el, float64(n)/el)
	if float64(n) > s.Rate*el*1.05+10 {
		t.Fatalf("admitted %d in %.2fs with a %.0f/s share: RAW at 1.5x refilled faster", n, el, s.Rate)
	}
}

// The chaos suite's shares bucket: 100/s, burst 20, lease 3s; three holders at 60/s each,
// one with RAW at 1.5x.
func TestLimiterFastRawClockChaosShape(t *testing.T) {
	tc := &testCluster{rpctest.Start(t, 3, `
domain: shares
descriptors:
  - key: s
    rate_limit: {unit: second, requests_per_unit: 100, burst: 20}
    shares: {lease: 3s, reserve_percent: 10}
`)}
	clk := &slewClock{start: time.Now(), rate: 1}
	var lims []*Limiter
	for i := range 3 {
		var c *Client
		if i == 0 {
			c = newTestClient(t, tc.addrs(), func(cfg *Config) { cfg.LimiterClock = clk })
		} else {
			c = newTestClient(t, tc.addrs(), nil)
		}
		l := c.Limiter(Request{Domain: "shares", Descriptors: Descriptors("s", "s0")}, LimiterOptions{Demand: 60})
		defer l.Close()
		lims = append(lims, l)
	}
	central := newTestClient(t, tc.addrs(), nil)
	var cn atomic.Int64
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for tk := time.NewTicker(time.Second / 60); ; {
			select {
			case <-stop:
				return
			case <-tk.C:
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				if d, err := central.Allow(ctx, Request{Domain: "shares", Descriptors: Descriptors("s", "s0")}); err == nil && d.Admitted {
					cn.Add(1)
				}
				cancel()
			}
		}
	}()
	run := func(d time.Duration) (n [3]int, rates [3]float64) {
		start := time.Now()
		c0 := cn.Load()
		defer func() { t.Logf("central admitted %d", cn.Load()-c0) }()
		var owed float64
		for next := start; time.Since(start) < d; next = next.Add(10 * time.Millisecond) {
			owed += 0.6
			for ; owed >= 1; owed-- {
				for i, l := range lims {
					if l.Allow() {
						n[i]++
					}
				}
			}
			for i, l := range lims {
				rates[i] = max(rates[i], l.Share().Rate)
			}
			time.Sleep(time.Until(next))
		}
		return n, rates
	}
	run(5 * time.Second)
	n, r := run(4 * time.Second)
	t.Logf("before: admitted %v in 4s, max rates %v", n, r)
	clk.slew(1.5)
	n, r = run(4 * time.Second)
	t.Logf("RAW 1.5x: admitted %v in 4s, max rates %v", n, r)
	if float64(n[0]) > r[0]*4*1.05+20 {
		t.Fatalf("slewed holder admitted %d in 4s with a share of at most %.2f/s", n[0], r[0])
	}
}

// After a suspend RAW lags BOOTTIME for good; a RAW clock that then runs fast must still not
// refill faster than BOOTTIME (refill follows the slower clock's increments, not the smaller
// total). Before the fix: 135/s on a 90/s share.
func TestLimiterFastRawAfterSuspendAdmitsNoMore(t *testing.T) {
	tc := &testCluster{rpctest.Start(t, 3, `
domain: shares
descriptors:
  - key: s
    rate_limit: {unit: second, requests_per_unit: 100, burst: 20}
    shares: {lease: 3s, reserve_percent: 10}
`)}
	clk := &slewClock{start: time.Now(), rate: 1}
	c := newTestClient(t, tc.addrs(), func(cfg *Config) { cfg.LimiterClock = clk })
	l := c.Limiter(Request{Domain: "shares", Descriptors: Descriptors("s", "s0")}, LimiterOptions{Demand: 30})
	defer l.Close()
	run := func(d time.Duration) int {
		n := 0
		var owed float64
		start := time.Now()
		for next := start; time.Since(start) < d; next = next.Add(10 * time.Millisecond) {
			owed += 3 // 300 attempts/s, above any share of this bucket
			for ; owed >= 1; owed-- {
				if l.Allow() {
					n++
				}
			}
			time.Sleep(time.Until(next))
		}
		return n
	}
	run(3 * time.Second)
	clk.slew(0) // a suspend: RAW stands still, BOOTTIME runs on
	run(3 * time.Second)
	clk.slew(1.5)
	n := run(4 * time.Second)
	s := l.Share()
	t.Logf("RAW at 1.5x after a 3s RAW stop: %d in 4s on a %.1f/s share", n, s.Rate)
	if float64(n) > s.Rate*4*1.05+s.Capacity+1 {
		t.Fatalf("admitted %d in 4s on a %.1f/s share (burst %.1f): refill followed the fast RAW clock", n, s.Rate, s.Capacity)
	}
}
