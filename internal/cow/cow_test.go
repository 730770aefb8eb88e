package cow

import (
	"sync"
	"testing"
)

// A part is shared while a capture at or before its mark is open, whatever order captures are
// released in: one capture's release never frees what an older open capture still reads.
func TestSharedUntilEveryCaptureAtOrBeforeTheMarkIsReleased(t *testing.T) {
	var c Captures
	if c.Shared(0) || c.Shared(1) {
		t.Fatal("nothing is shared before any capture")
	}
	a := c.Take() // say a growing index's capture
	b := c.Take() // and a snapshot's, taken later
	mark := b     // the part was marked by both; the last mark wins
	c.Release(b)  // the later capture ends first
	if !c.Shared(mark) {
		t.Fatal("released the later capture: the part is no longer shared though the earlier one still reads it")
	}
	c.Release(a)
	if c.Shared(mark) {
		t.Fatal("every capture released: the part is still shared")
	}
	d := c.Take()
	if c.Shared(mark) {
		t.Fatalf("capture %d, taken after the mark %d, made the part shared without marking it", d, mark)
	}
	if !c.Shared(d) {
		t.Fatal("a part marked by an open capture is not shared")
	}
	c.Release(d)
	c.Release(d) // idempotent
	c.Release(99)
	if c.Shared(d) {
		t.Fatal("released: still shared")
	}
}

func TestConcurrentReleases(t *testing.T) {
	var c Captures
	gens := make([]uint64, 100)
	for i := range gens {
		gens[i] = c.Take()
	}
	var wg sync.WaitGroup
	for _, g := range gens[1:] {
		wg.Go(func() { c.Release(g) })
	}
	wg.Wait()
	if !c.Shared(gens[len(gens)-1]) {
		t.Fatal("the first capture is open: every mark is shared")
	}
	c.Release(gens[0])
	if c.Shared(gens[len(gens)-1]) {
		t.Fatal("all released: still shared")
	}
}
