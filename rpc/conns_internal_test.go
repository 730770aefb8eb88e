package rpc

import (
	"net/http/httptest"
	"testing"
	"time"
)

// TestWriteDeadline: a pprof profile or trace without ?seconds= gets pprof's default sampling
// time (30 s, 1 s) on top of the write allowance — `go tool pprof URL` sends none, and a 30 s
// deadline cut the 30 s profile off — and ?seconds= is read as pprof reads it.
func TestWriteDeadline(t *testing.T) {
	w := httpWriteTimeout
	for _, c := range []struct {
		url  string
		want time.Duration
	}{
		{"/metrics", w},
		{"/healthz?seconds=100", w},
		{"/debug/pprof/profile", w + 30*time.Second},
		{"/debug/pprof/profile?seconds=0", w + 30*time.Second},
		{"/debug/pprof/profile?seconds=x", w + 30*time.Second},
		{"/debug/pprof/profile?seconds=5", w + 5*time.Second},
		{"/debug/pprof/profile?seconds=100000", w + httpMaxDebugSeconds*time.Second},
		{"/debug/pprof/trace", w + time.Second},
		{"/debug/pprof/trace?seconds=-1", w + time.Second},
		{"/debug/pprof/trace?seconds=NaN", w + time.Second},
		{"/debug/pprof/trace?seconds=45.5", w + 45500*time.Millisecond},
		{"/debug/pprof/trace?seconds=Inf", w + httpMaxDebugSeconds*time.Second},
		{"/debug/pprof/heap", w},
		{"/debug/pprof/heap?seconds=10", w + 10*time.Second},
		{"/debug/state", w},
	} {
		if got := writeDeadline(httptest.NewRequest("GET", c.url, nil)); got != c.want {
			t.Errorf("%s: write deadline %v, want %v", c.url, got, c.want)
		}
	}
}
