package rpc

import (
	"testing"
	"time"
)

// TestHorizonCoversTimerLateness: the release horizon is the release-to-stamp delay + the pump
// timer's lateness (up to fairLateMax), each as mean + 4 × deviation, + fairPassMin: a steady
// delay is covered exactly, a late timer lengthens it at once (never by more than fairLateMax),
// and one outlier is forgotten within a few dozen observations (a decaying maximum kept it
// for hundreds).
func TestHorizonCoversTimerLateness(t *testing.T) {
	f := &fair{}
	for range 50 {
		f.observeStamp(int64(time.Millisecond))
	}
	if want := time.Millisecond + fairPassMin; !near(f.horizon, want) {
		t.Fatalf("horizon %v after steady 1 ms stamp delays, want %v", f.horizon, want)
	}
	for range 50 {
		f.observeLate(time.Millisecond)
	}
	if want := 2*time.Millisecond + fairPassMin; !near(f.horizon, want) {
		t.Fatalf("horizon %v after timers steadily 1 ms late, want %v (the lateness must be covered)", f.horizon, want)
	}
	f.observeLate(50 * time.Millisecond)
	if want := time.Millisecond + fairLateMax + fairPassMin; !near(f.horizon, want) {
		t.Fatalf("horizon %v after a timer 50 ms late, want %v (lateness counted up to fairLateMax)", f.horizon, want)
	}
	f.observeStamp(int64(20 * time.Millisecond))
	if f.horizon < 20*time.Millisecond {
		t.Fatalf("horizon %v right after a 20 ms stamp delay, want at least that (one slow stamp must lengthen it at once)", f.horizon)
	}
	for range 60 {
		f.observeLate(time.Millisecond)
		f.observeStamp(int64(time.Millisecond))
	}
	if most := 2*time.Millisecond + fairPassMin + 100*time.Microsecond; f.horizon > most {
		t.Fatalf("horizon %v 60 observations after the outliers, want back under %v", f.horizon, most)
	}
	f.observeStamp(int64(time.Hour))
	if f.horizon != fairHorizonMax {
		t.Fatalf("horizon %v after a stamp an hour late, want the cap %v", f.horizon, fairHorizonMax)
	}
}

func near(got, want time.Duration) bool {
	return got > want-10*time.Microsecond && got < want+10*time.Microsecond
}

// TestHorizonInitialUntilStampMeasured: before any release-to-stamp delay is measured the
// horizon stays fairHorizonInitial, whatever the pump timer's lateness says: lateness is the
// smaller part it covers, and a timer-driven pass before the first stamp (a new leader's first
// waiters) set it to lateness + fairPassMin (~3 ms), below a commit's fsync on this machine.
func TestHorizonInitialUntilStampMeasured(t *testing.T) {
	f := &fair{horizon: fairHorizonInitial}
	for range 5 {
		f.observeLate(time.Millisecond)
	}
	if f.horizon != fairHorizonInitial {
		t.Fatalf("horizon %v after timer lateness only, want fairHorizonInitial %v until a stamp delay is measured", f.horizon, fairHorizonInitial)
	}
	f.observeStamp(int64(time.Millisecond))
	if want := fairPassMin + time.Millisecond; f.horizon < want || f.horizon >= fairHorizonInitial {
		t.Fatalf("horizon %v after the first stamp delay (1 ms), want it measured: at least %v, below %v", f.horizon, want, fairHorizonInitial)
	}
}
