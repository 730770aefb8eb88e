//go:build chaos_bug_holderexpiry

package main

import (
	"time"

	"github.com/quotad/quotad/client"
)

// allowFunc is a broken holder (planted bug): while its share is local it decides with the
// Limiter, but once the share has ended (expired: no renewal reached it, or its clock was
// stopped past the end) it keeps admitting at the last share's rate and capacity from a
// bucket of its own, as a holder that ignores its expiry would.
func allowFunc(lim *client.Limiter) func() bool {
	var rate, capacity, tokens float64
	last := time.Now()
	return func() bool {
		sh := lim.Share()
		now := time.Now()
		if sh.Local {
			rate, capacity = sh.Rate, sh.Capacity
			tokens, last = capacity, now
			return lim.Allow()
		}
		if rate == 0 {
			return lim.Allow()
		}
		tokens = min(capacity, tokens+rate*now.Sub(last).Seconds())
		last = now
		if tokens >= 1 {
			tokens--
			return true
		}
		return false
	}
}
