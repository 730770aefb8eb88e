package rpc

import (
	"testing"
	"time"
)

// TestHorizonCoversTimerLateness: the release horizon is 1.5 × the recent release-to-stamp
// delay + the pump timer's recent lateness (up to fairLateMax) + fairPassMin, both maxima
// decaying, so a late timer lengthens it at once (never by more than fairLateMax) and a quiet
// machine shortens it again.
func TestHorizonCoversTimerLateness(t *testing.T) {
	f := &fair{}
	f.observeStamp(int64(time.Millisecond))
	if want := 1500*time.Microsecond + fairPassMin; f.horizon != want {
		t.Fatalf("horizon %v after a 1 ms stamp delay, want %v", f.horizon, want)
	}
	f.observeLate(time.Millisecond)
	if want := 1500*time.Microsecond + time.Millisecond + fairPassMin; f.horizon != want {
		t.Fatalf("horizon %v after a timer 1 ms late, want %v (the lateness must be covered)", f.horizon, want)
	}
	f.observeLate(50 * time.Millisecond)
	if want := 1500*time.Microsecond + fairLateMax + fairPassMin; f.horizon != want {
		t.Fatalf("horizon %v after a timer 50 ms late, want %v (lateness counted up to fairLateMax)", f.horizon, want)
	}
	f.observeLate(-time.Millisecond) // early (cannot be, but must not shorten it below zero lateness)
	for range 1000 {
		f.observeLate(0)
		f.observeStamp(int64(time.Millisecond))
	}
	if got, most := f.horizon, 1500*time.Microsecond+100*time.Microsecond+fairPassMin; got > most {
		t.Fatalf("horizon %v after 1000 timers on time, want it back near %v (the maxima decay)", got, most)
	}
	f.observeStamp(int64(time.Hour))
	if f.horizon != fairHorizonMax {
		t.Fatalf("horizon %v after a stamp an hour late, want the cap %v", f.horizon, fairHorizonMax)
	}
}
