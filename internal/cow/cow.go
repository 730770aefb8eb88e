// Package cow counts the generations of copy-on-write captures (quota.Engine.Capture, the
// fsm's dedup table): a structure numbers each capture it hands out and marks what the capture
// shares with that number; once the capture is released, shared parts of that generation or
// older may be changed in place again.
package cow

import "sync/atomic"

// Released is the newest capture generation released. Its zero value is ready to use; it is
// safe for concurrent use (captures are released on other goroutines than the one changing
// the structure).
type Released struct{ gen atomic.Uint64 }

// Load returns the newest generation released.
func (r *Released) Load() uint64 { return r.gen.Load() }

// Release records that capture gen is released; releasing an older one, or one twice, changes
// nothing.
func (r *Released) Release(gen uint64) {
	for {
		cur := r.gen.Load()
		if cur >= gen || r.gen.CompareAndSwap(cur, gen) {
			return
		}
	}
}
