// Package cow tracks copy-on-write captures (quota.Engine.Capture, the fsm's dedup table): a
// structure takes a generation number for each capture it hands out and marks what the
// capture shares with it; a part marked m must be copied before it changes while any capture
// that may still read it — one taken at or before m — is open.
package cow

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
)

// Captures are the open captures of one structure. The zero value is ready to use. Take and
// Shared are called by the goroutine that changes the structure; Release from any goroutine.
type Captures struct {
	mu     sync.Mutex
	last   uint64
	open   []uint64      // generations taken and not released; a few at most
	oldest atomic.Uint64 // min(open), or math.MaxUint64 when none (0: not yet set)
}

// Take opens a capture and returns its generation (1, 2, ...).
func (c *Captures) Take() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.last++
	c.open = append(c.open, c.last)
	c.setOldest()
	return c.last
}

// Release closes capture gen. Releasing it again, or one never taken, changes nothing.
func (c *Captures) Release(gen uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if i := slices.Index(c.open, gen); i >= 0 {
		c.open = slices.Delete(c.open, i, i+1)
		c.setOldest()
	}
}

func (c *Captures) setOldest() {
	if len(c.open) == 0 {
		c.oldest.Store(math.MaxUint64)
		return
	}
	c.oldest.Store(slices.Min(c.open))
}

// Shared reports whether a part last marked by capture mark (0: never) may still be read by
// an open capture: one of generation mark or older is open. Captures taken after the mark
// share the part too only if they marked it again (raising mark).
func (c *Captures) Shared(mark uint64) bool {
	if mark == 0 {
		return false
	}
	oldest := c.oldest.Load()
	return oldest != 0 && mark >= oldest
}
