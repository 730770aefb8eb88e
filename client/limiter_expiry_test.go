package client

import (
	"slices"
	"testing"
	"time"

	"github.com/quotad/quotad/rpc/rpctest"
)

// A long lease, so no renewal lands while the test watches one grant.
const longShareLimits = `
domain: long
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
shares: {lease: 60s}
`

// ShareInfo.Expiry of one grant stays put while time passes. It drifted ~1 ms earlier per
// second (user trial): the Limiter's expiry clock runs 1/1024 fast on purpose (it ends grants
// early, never late), and Share added what was left on that clock to time.Now as if it ran
// at the real rate. The clock also jumps ahead, never back, when its sampler is preempted
// between its two reads (a loaded machine), which moves the true end — and Expiry — earlier
// for real; so the bound is on the smallest move over several 1 s windows of one grant:
// 250 µs (the drift was ~1 ms in every window).
func TestShareExpiryDoesNotDrift(t *testing.T) {
	c := rpctest.Start(t, 3, longShareLimits)
	qc := newTestClient(t, c.Addrs(), nil)
	lim := qc.Limiter(Request{Domain: "long"}, LimiterOptions{})
	defer lim.Close()
	waitLocal(t, lim)
	var moves []time.Duration
	for len(moves) < 4 {
		st := lim.p.state.Load()
		first := lim.Share().Expiry
		time.Sleep(time.Second)
		if lim.p.state.Load() != st {
			continue // a renewal landed: a new grant, a new expiry
		}
		last := lim.Share().Expiry
		if left := time.Until(last); left < 20*time.Second || left > 60*time.Second {
			t.Fatalf("Expiry %v from now, want within the 60 s lease", left)
		}
		moves = append(moves, first.Sub(last).Abs())
	}
	if m := slices.Min(moves); m > 250*time.Microsecond {
		t.Fatalf("Share().Expiry of one grant moved at least %v per second (moves %v)", m, moves)
	}
}
