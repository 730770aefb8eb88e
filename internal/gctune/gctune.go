// Package gctune keeps a Go process's heap within a fixed headroom of its live data once the
// live data is large.
//
// Why: the Go collector lets the heap grow to live × (1 + GOGC/100) before collecting, so with
// the default GOGC=100 a node holding 250 MB of quota state (a million buckets and their
// deduplication records) grows to ~500 MB resident. Lowering GOGC for good would make a node
// with a small live heap collect constantly. Instead, after every collection the Tuner sets the
// runtime's soft memory limit to live + other runtime memory + Headroom: with little live data
// GOGC governs as usual (its goal is lower than the limit), and with much live data the heap
// grows by at most Headroom between collections. Because the big tables are pointer-free, a
// collection of a large heap is cheap, so collecting every Headroom bytes costs little CPU.
//
// It never raises the limit above an explicit limit (GOMEMLIMIT or --memory-limit), and never
// lowers GOGC. It does no work between collections.
package gctune

import (
	"math"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
	"sync/atomic"
)

// Sample is what Limit needs from runtime/metrics after a collection.
type Sample struct {
	Live     uint64 // /gc/heap/live:bytes: heap marked live by the last collection
	Total    uint64 // /memory/classes/total:bytes: all memory mapped by the runtime
	Released uint64 // /memory/classes/heap/released:bytes: returned to the OS
	Objects  uint64 // /memory/classes/heap/objects:bytes: live and not-yet-swept objects
	Free     uint64 // /memory/classes/heap/free:bytes: free heap memory not returned
	Unused   uint64 // /memory/classes/heap/unused:bytes: fragmentation within spans
}

// Limit returns the soft memory limit for headroom bytes of growth over s.Live: the live heap,
// plus the runtime's memory that is not heap (stacks, metadata, ...), plus headroom, capped at
// ceiling. The runtime's limit counts Total − Released, so the non-heap part must be included
// or the limit would be below what the process needs for its live data.
func Limit(s Sample, headroom, ceiling int64) int64 {
	heap := s.Objects + s.Free + s.Unused + s.Released
	other := uint64(0)
	if s.Total > heap {
		other = s.Total - heap
	}
	lim := s.Live + other + uint64(max(headroom, 0))
	if lim > math.MaxInt64 || int64(lim) > ceiling {
		return ceiling
	}
	return int64(lim)
}

// Tuner re-sets the memory limit after every collection. Start it once per process; the zero
// value is not usable.
type Tuner struct {
	headroom int64
	ceiling  int64 // the explicit limit when started (math.MaxInt64: none)
	stopped  atomic.Bool
	samples  []metrics.Sample

	mu      sync.Mutex
	last    int64 // the limit set last
	applied int   // collections seen
}

var metricNames = []string{
	"/gc/heap/live:bytes",
	"/memory/classes/total:bytes",
	"/memory/classes/heap/released:bytes",
	"/memory/classes/heap/objects:bytes",
	"/memory/classes/heap/free:bytes",
	"/memory/classes/heap/unused:bytes",
}

// Start begins tuning with the given headroom (bytes, > 0). The explicit limit in force now
// (GOMEMLIMIT, or a debug.SetMemoryLimit made before Start) stays the ceiling.
func Start(headroom int64) *Tuner {
	t := &Tuner{headroom: headroom, ceiling: debug.SetMemoryLimit(-1)}
	for _, n := range metricNames {
		t.samples = append(t.samples, metrics.Sample{Name: n})
	}
	t.adjust()
	t.arm()
	return t
}

// Stop ends tuning and restores the explicit limit Start found.
func (t *Tuner) Stop() {
	if t.stopped.Swap(true) {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	debug.SetMemoryLimit(t.ceiling)
}

// Last returns the limit set after the latest collection and how many collections were seen.
func (t *Tuner) Last() (limit int64, collections int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.last, t.applied
}

// sentinel is collected by every GC cycle; its finalizer runs after the cycle and re-arms.
type sentinel struct{ _ [16]byte }

func (t *Tuner) arm() {
	s := &sentinel{}
	runtime.SetFinalizer(s, func(*sentinel) {
		if t.stopped.Load() {
			return
		}
		t.adjust()
		t.arm()
	})
}

func (t *Tuner) adjust() {
	metrics.Read(t.samples)
	var s Sample
	for i, p := range []*uint64{&s.Live, &s.Total, &s.Released, &s.Objects, &s.Free, &s.Unused} {
		if t.samples[i].Value.Kind() == metrics.KindUint64 {
			*p = t.samples[i].Value.Uint64()
		}
	}
	lim := Limit(s, t.headroom, t.ceiling)
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped.Load() {
		return
	}
	debug.SetMemoryLimit(lim)
	t.last = lim
	t.applied++
}
