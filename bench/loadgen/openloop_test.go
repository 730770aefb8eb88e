package main

import (
	"sync/atomic"
	"testing"
	"time"
)

// A server that keeps up: every measured arrival is answered, (almost) none waits for a
// sender — a busy machine can delay the dispatcher, which then sends a burst — and the count
// follows the rate.
func TestOpenLoopKeepsRate(t *testing.T) {
	var sent atomic.Int64
	st := openLoop(openLoopConfig{Rate: 2000, Concurrency: 64, Warmup: 100 * time.Millisecond, Duration: 400 * time.Millisecond, Drain: time.Second},
		func(i int64, measured bool) {
			sent.Add(1)
		})
	if st.Intended < 700 || st.Intended > 900 {
		t.Errorf("%d measured arrivals in 400 ms at 2000/s; want about 800", st.Intended)
	}
	if int64(len(st.Lats)) != st.Intended || st.Late > st.Intended/4 || st.Abandoned != 0 {
		t.Errorf("latencies %d of %d arrivals, late %d, abandoned %d; want one each, under 25 %% late (a busy machine's bursts), none abandoned",
			len(st.Lats), st.Intended, st.Late, st.Abandoned)
	}
	if got := sent.Load(); got < st.Intended+150 {
		t.Errorf("%d sent with %d measured; want the warm-up's (~200) sent too", got, st.Intended)
	}
	if p50 := time.Duration(st.Lats[len(st.Lats)/2]); p50 > 20*time.Millisecond {
		t.Errorf("p50 %v for an immediate send", p50)
	}
}

// A stall of 150 ms: a closed loop of 4 callers would record 4 slow requests; the open loop
// times every arrival during the stall from its intended moment, so about 150 of them
// (1000/s) are slow, and the ones that found every sender busy count as late.
func TestOpenLoopCountsStallFromIntendedTime(t *testing.T) {
	start := time.Now()
	stallFrom, stallTo := start.Add(300*time.Millisecond), start.Add(450*time.Millisecond)
	st := openLoop(openLoopConfig{Rate: 1000, Concurrency: 4, Warmup: 100 * time.Millisecond, Duration: 600 * time.Millisecond, Drain: time.Second},
		func(i int64, measured bool) {
			if now := time.Now(); now.After(stallFrom) && now.Before(stallTo) {
				time.Sleep(stallTo.Sub(now))
			}
		})
	slow := 0
	for _, l := range st.Lats {
		if time.Duration(l) >= 20*time.Millisecond {
			slow++
		}
	}
	if slow < 100 {
		t.Errorf("%d arrivals of %d took ≥ 20 ms through a 150 ms stall at 1000/s; want ≥ 100 (coordinated omission hidden?)", slow, len(st.Lats))
	}
	if st.Late < 100 || st.MaxQueued < 100 {
		t.Errorf("late %d, max queued %d through the stall; want ≥ 100 each", st.Late, st.MaxQueued)
	}
	if int64(len(st.Lats)) != st.Intended || st.Abandoned != 0 {
		t.Errorf("latencies %d of %d arrivals, abandoned %d", len(st.Lats), st.Intended, st.Abandoned)
	}
}

// A server that never answers within the drain: queued arrivals are not sent but still
// counted (abandoned), each with its latency so far.
func TestOpenLoopAbandonsAfterDrain(t *testing.T) {
	var sent atomic.Int64
	st := openLoop(openLoopConfig{Rate: 500, Concurrency: 2, Duration: 200 * time.Millisecond, Drain: 50 * time.Millisecond},
		func(i int64, measured bool) {
			sent.Add(1)
			time.Sleep(300 * time.Millisecond)
		})
	if st.Abandoned < 50 || int64(len(st.Lats)) != st.Intended {
		t.Errorf("abandoned %d, latencies %d of %d arrivals; want ≥ 50 abandoned and every arrival timed", st.Abandoned, len(st.Lats), st.Intended)
	}
	if got := sent.Load(); got > 6 {
		t.Errorf("%d sent by 2 senders stuck 300 ms each; want the rest abandoned, not sent", got)
	}
	if max := time.Duration(st.Lats[len(st.Lats)-1]); max < 250*time.Millisecond {
		t.Errorf("max latency %v; want the abandoned arrivals' wait (≥ 250 ms)", max)
	}
}
