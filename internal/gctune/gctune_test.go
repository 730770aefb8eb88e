package gctune

import (
	"math"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"testing"
	"time"
)

func TestLimit(t *testing.T) {
	const mb = 1 << 20
	cases := []struct {
		name     string
		s        Sample
		headroom int64
		ceiling  int64
		want     int64
	}{
		{"live plus non-heap plus headroom",
			Sample{Live: 200 * mb, Total: 420 * mb, Released: 50 * mb, Objects: 300 * mb, Free: 40 * mb, Unused: 10 * mb},
			64 * mb, math.MaxInt64, 200*mb + 20*mb + 64*mb},
		{"capped at the explicit limit",
			Sample{Live: 200 * mb, Total: 420 * mb, Released: 50 * mb, Objects: 300 * mb, Free: 40 * mb, Unused: 10 * mb},
			64 * mb, 250 * mb, 250 * mb},
		{"no non-heap memory reported",
			Sample{Live: 10 * mb, Total: 5 * mb, Objects: 10 * mb},
			8 * mb, math.MaxInt64, 18 * mb},
		{"negative headroom counts as none",
			Sample{Live: 10 * mb, Total: 10 * mb, Objects: 10 * mb},
			-1, math.MaxInt64, 10 * mb},
	}
	for _, c := range cases {
		if got := Limit(c.s, c.headroom, c.ceiling); got != c.want {
			t.Errorf("%s: Limit = %d MiB, want %d MiB", c.name, got/mb, c.want/mb)
		}
	}
}

var sink [][]byte

// TestHeapStaysWithinHeadroom holds 128 MiB of pointer-free live data and allocates 256 MiB of
// garbage: with GOGC=100 alone the heap would reach ~256 MiB; with a 16 MiB headroom the
// runtime's memory (what RSS follows) must stay near 128 + 16 MiB.
func TestHeapStaysWithinHeadroom(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates 384 MiB")
	}
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	const mb = 1 << 20
	live := make([][]byte, 128)
	for i := range live {
		live[i] = make([]byte, mb)
		live[i][0] = 1
	}
	debug.FreeOSMemory() // what building the live data left behind is not the tuner's doing
	tu := Start(16 * mb)
	defer tu.Stop()

	peak := uint64(0)
	samples := []metrics.Sample{{Name: "/memory/classes/total:bytes"}, {Name: "/memory/classes/heap/released:bytes"}}
	for i := range 64 * 1024 { // 256 MiB at ~250 MiB/s

		sink = append(sink, make([]byte, 4<<10))
		if len(sink) > 1024 {
			sink = sink[:0]
		}
		if i%256 == 0 {
			time.Sleep(4 * time.Millisecond)
			metrics.Read(samples)
			peak = max(peak, samples[0].Value.Uint64()-samples[1].Value.Uint64())
		}
	}
	runtime.KeepAlive(live)
	lim, n := tu.Last()
	if n < 5 {
		t.Fatalf("the tuner saw %d collections while 256 MiB were allocated; want many", n)
	}
	// The limit is soft: the heap overshoots it while a collection runs. GOGC=100 alone
	// would reach 256 MiB.
	if bound := uint64(128+16+32) * mb; peak > bound {
		t.Errorf("peak runtime memory %d MiB > %d MiB (last limit %d MiB)", peak/mb, bound/mb, lim/mb)
	}
	t.Logf("peak runtime memory %d MiB, last limit %d MiB, %d collections", peak/mb, lim/mb, n)
}

func TestStopRestoresTheExplicitLimit(t *testing.T) {
	prev := debug.SetMemoryLimit(1 << 40)
	defer debug.SetMemoryLimit(prev)
	tu := Start(1 << 20)
	if lim, _ := tu.Last(); lim >= 1<<40 {
		t.Fatalf("limit %d not tuned below the explicit 1 TiB", lim)
	}
	tu.Stop()
	if got := debug.SetMemoryLimit(-1); got != 1<<40 {
		t.Fatalf("after Stop the limit is %d, want the explicit %d", got, int64(1<<40))
	}
}
