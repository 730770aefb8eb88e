package main

import (
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// openLoopConfig is an open-loop load: requests arrive at Rate per second whatever the server
// does (as Envoy's requests do: they come from its own clients), at most Concurrency of them
// outstanding.
type openLoopConfig struct {
	Rate        float64       // arrivals per second
	Poisson     bool          // exponential gaps (else evenly spaced)
	Concurrency int           // senders: at most this many requests in flight
	Warmup      time.Duration // arrivals before this are sent but not measured
	Duration    time.Duration // measured arrivals: those intended within [Warmup, Warmup+Duration)
	// Drain bounds the time after the measured window in which queued arrivals are still sent;
	// later ones are not sent and count as abandoned, with their latency so far (a lower bound).
	Drain time.Duration
	Seed  uint64
}

// openLoopStats is what an open-loop run measured. Every latency runs from the arrival's
// intended send time, not from when a sender got to it: a request that waited for a free
// sender (late) carries that wait, so a stalled server cannot hide its stall by slowing the
// load down (coordinated omission).
type openLoopStats struct {
	Lats      []int64 // nanoseconds, one per measured arrival (sorted)
	Intended  int64   // measured arrivals
	Late      int64   // measured arrivals due while Concurrency requests were outstanding
	Abandoned int64   // measured arrivals still queued after Drain, never sent
	MaxQueued int64   // most arrivals waiting for a sender at once
}

// openLoop runs the load; send sends arrival i and is called from Concurrency goroutines.
// measured says whether its outcome counts (the caller records it).
func openLoop(cfg openLoopConfig, send func(i int64, measured bool)) openLoopStats {
	type job struct {
		at       time.Time
		i        int64
		measured bool
	}
	capacity := int(min(cfg.Rate*(cfg.Warmup+cfg.Duration).Seconds()+1, 1<<20))
	queue := make(chan job, max(capacity, 1))
	var (
		dispatched, finished atomic.Int64
		st                   openLoopStats
		late                 atomic.Int64
		abandoned            atomic.Int64
		mu                   sync.Mutex
		wg                   sync.WaitGroup
	)
	start := time.Now()
	from, to := start.Add(cfg.Warmup), start.Add(cfg.Warmup+cfg.Duration)
	drainBy := to.Add(cfg.Drain)
	for range cfg.Concurrency {
		wg.Go(func() {
			var own []int64
			for j := range queue {
				if time.Now().After(drainBy) {
					if j.measured {
						abandoned.Add(1)
						own = append(own, int64(time.Since(j.at)))
					}
					finished.Add(1)
					continue
				}
				send(j.i, j.measured)
				took := time.Since(j.at)
				finished.Add(1)
				if j.measured {
					own = append(own, int64(took))
				}
			}
			mu.Lock()
			st.Lats = append(st.Lats, own...)
			mu.Unlock()
		})
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x5eed))
	gap := func() time.Duration {
		if cfg.Poisson {
			return time.Duration(rng.ExpFloat64() / cfg.Rate * 1e9)
		}
		return time.Duration(1e9 / cfg.Rate)
	}
	next, i := start, int64(0)
dispatch:
	for {
		now := time.Now()
		// Every arrival due by now goes out (a late wake-up sends several at once, each still
		// timed from its own intended moment).
		for !next.After(now) {
			if !next.Before(to) {
				break dispatch
			}
			measured := !next.Before(from)
			if measured {
				st.Intended++
				if dispatched.Load()-finished.Load() >= int64(cfg.Concurrency) {
					late.Add(1)
				}
			}
			if q := dispatched.Load() - finished.Load() - int64(cfg.Concurrency); q > st.MaxQueued {
				st.MaxQueued = q
			}
			dispatched.Add(1)
			queue <- job{at: next, i: i, measured: measured}
			i++
			next = next.Add(gap())
		}
		time.Sleep(next.Sub(now))
	}
	close(queue)
	wg.Wait()
	st.Late, st.Abandoned = late.Load(), abandoned.Load()
	slices.Sort(st.Lats)
	return st
}
