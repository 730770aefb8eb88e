package cow

import (
	"sync"
	"testing"
)

// Releases racing in any order leave the newest generation; an older one never lowers it.
func TestReleaseKeepsTheNewest(t *testing.T) {
	var r Released
	var wg sync.WaitGroup
	for g := uint64(1); g <= 200; g++ {
		wg.Go(func() { r.Release(g) })
	}
	wg.Wait()
	if got := r.Load(); got != 200 {
		t.Fatalf("Load() = %d after releasing 1..200, want 200", got)
	}
	r.Release(7)
	if got := r.Load(); got != 200 {
		t.Fatalf("releasing an older generation lowered it to %d", got)
	}
}
