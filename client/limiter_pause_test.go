package client

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/rpc/rpctest"
)

// A lease of a minute: the holder renews every 20 s, so only a renewal triggered by Feedback
// can bring a pause to the Limiter within the test's second.
const pauseShareLimits = `
domain: paused
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
shares: {lease: 60s, fallback_rate: 500}
`

// TestLimiterFeedbackPausesItsLimitersAtOnce: a provider 429 reported through the client pauses
// that client's Limiters before their next renewal. Trial: a Limiter kept deciding locally for
// up to term/3 after quotahttp.Transport (or Feedback) reported a 429 — 5 s with a 15 s lease,
// 20 s with a minute — spending straight through the provider's Retry-After.
func TestLimiterFeedbackPausesItsLimitersAtOnce(t *testing.T) {
	tc := rpctest.Start(t, 3, pauseShareLimits)
	c := newTestClient(t, tc.Addrs(), nil)
	lim := c.Limiter(Request{Domain: "paused"}, LimiterOptions{})
	defer lim.Close()
	waitLocal(t, lim)
	if !lim.Allow() {
		t.Fatal("a local share admitted nothing before the pause")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	res, err := c.Feedback(ctx, Feedback{Domain: "paused", StatusCode: 429, RetryAfter: 30 * time.Second, Reason: "app"})
	if err != nil || res.PausedFor <= 0 {
		t.Fatalf("feedback: %+v, %v; want the domain paused", res, err)
	}
	// Without the renewal Feedback triggers, the next one is 20 s away: 5 s is ample room
	// for a loaded machine and still tells the two apart.
	start := time.Now()
	for lim.Allow() {
		if time.Since(start) > 5*time.Second {
			t.Fatalf("Limiter still admitting %v after its own client reported a 30 s pause: share %+v",
				time.Since(start).Round(time.Millisecond), lim.Share())
		}
		time.Sleep(time.Millisecond)
	}
	t.Logf("the Limiter stopped %v after the feedback", time.Since(start).Round(time.Millisecond))
	for range 100 {
		if lim.Allow() {
			t.Fatal("the Limiter admitted again within the 30 s pause")
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestLimiterFallbackHonoursAKnownPause: a Limiter whose grant ended while the cluster is
// unreachable admits at its fallback slice — but not through a provider pause its last
// renewal reported: the cluster going away does not shorten the provider's Retry-After.
func TestLimiterFallbackHonoursAKnownPause(t *testing.T) {
	tc := rpctest.Start(t, 3, pauseShareLimits)
	clk := newRealish()
	c := newTestClient(t, tc.Addrs(), func(cfg *Config) { cfg.LimiterClock = clk })
	lim := c.Limiter(Request{Domain: "paused"}, LimiterOptions{})
	defer lim.Close()
	waitLocal(t, lim)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := c.Feedback(ctx, Feedback{Domain: "paused", StatusCode: 429, RetryAfter: 5 * time.Minute, Reason: "app"}); err != nil {
		t.Fatal(err)
	}
	// The pause reaches the Limiter (by its renewal).
	deadline := time.Now().Add(5 * time.Second)
	for lim.Allow() {
		if time.Now().After(deadline) {
			t.Fatalf("pause never reached the Limiter: %+v", lim.Share())
		}
		time.Sleep(5 * time.Millisecond)
	}
	for i := range 3 {
		tc.Kill(i)
	}
	// Past the grant's end (a minute), well within the 5 min pause: the fallback slice applies.
	clk.bootOff.Add(int64(90 * time.Second))
	clk.rawOff.Add(int64(90 * time.Second))
	if s := lim.Share(); s.Local || s.FallbackRate == 0 {
		t.Fatalf("share after its end: %+v, want the fallback slice", s)
	}
	if lim.Allow() {
		t.Fatal("fallback admitted through a provider pause the cluster had reported")
	}
	if ok, _ := lim.AllowLocalN(1); ok {
		t.Fatal("AllowLocalN's fallback admitted through a provider pause")
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer wcancel()
	if err := lim.Wait(wctx); err == nil {
		t.Fatal("Wait's fallback admitted through a provider pause")
	}
}

// TestLimiterTooSmallSaysWhy: a path whose share is under the lend threshold reports
// too_small with a message naming the threshold (it had none: a user saw only "too_small"
// while every Allow became a call to the cluster).
func TestLimiterTooSmallSaysWhy(t *testing.T) {
	tc := startShareCluster(t)
	c := newTestClient(t, tc.Addrs(), nil)
	// 900/s lendable × a 3 s term = 2700 < 20 × 200: too small to lend.
	lim := c.Limiter(Request{Domain: "shared"}, LimiterOptions{MaxCost: 200})
	defer lim.Close()
	deadline := time.Now().Add(10 * time.Second)
	for lim.Share().Status == "pending" && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	s := lim.Share()
	if s.Status != "too_small" || !strings.Contains(s.Message, "20 × its largest cost (200)") {
		t.Fatalf("share of a path too small to lend: %+v, want too_small with a message naming the threshold", s)
	}
}

// TestLimiterFeedbackFloodDoesNotFloodRenewals: a caller reporting every 429 of a provider
// that keeps refusing (each report answered "paused") has its Limiters' holder renew at most
// once a second for them — each report renewed the share at once, so a flood of reports was
// a flood of share requests, one per round trip, each carrying every path.
func TestLimiterFeedbackFloodDoesNotFloodRenewals(t *testing.T) {
	tc := rpctest.Start(t, 3, pauseShareLimits)
	c := newTestClient(t, tc.Addrs(), nil)
	lim := c.Limiter(Request{Domain: "paused"}, LimiterOptions{})
	defer lim.Close()
	waitLocal(t, lim)
	h := c.sharesLive.Load()
	before := h.renewals.Load()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	reports := 0
	for time.Since(start) < 1500*time.Millisecond {
		res, err := c.Feedback(ctx, Feedback{Domain: "paused", StatusCode: 429, RetryAfter: 30 * time.Second, Reason: "app"})
		if err != nil || res.PausedFor <= 0 {
			t.Fatalf("feedback: %+v, %v; want the domain paused", res, err)
		}
		reports++
	}
	elapsed := time.Since(start)
	time.Sleep(1100 * time.Millisecond) // the renewal due at the end of the last gap
	got := h.renewals.Load() - before
	// One at once, then one per second of the flood and one after it, and room for a renewal
	// of the holder's own (a retry); the regular one is 20 s away. Without the gap: hundreds.
	limit := uint64(elapsed/feedbackRenewGap) + 4
	t.Logf("%d reports in %v: %d share renewals", reports, elapsed.Round(time.Millisecond), got)
	if reports < 20 {
		t.Skipf("only %d reports in %v: too slow a machine to flood", reports, elapsed)
	}
	if got > limit {
		t.Fatalf("%d reports in %v made %d share renewals, want at most %d", reports, elapsed.Round(time.Millisecond), got, limit)
	}
	if got == 0 {
		t.Fatal("no renewal for the reported pause")
	}
	if lim.Allow() {
		t.Fatal("the Limiter admits within the reported pause")
	}
}
