package quota

import (
	"bytes"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// bucketView is a stored bucket as tests see it.
type bucketView struct {
	tokens uint64
	last   Time
	debit  uint64
	lvl    *level
	rate   *rateParams // effective (adaptive) rate
}

// storedBuckets returns the engine's stored buckets by key.
func storedBuckets(e *Engine) map[string]bucketView {
	out := make(map[string]bucketView, e.buckets.live)
	e.buckets.eachLive(func(s uint32, b *bucketRec) {
		out[string(e.buckets.key(s))] = bucketView{tokens: b.tokens.get(), last: Time(b.last.get()), debit: b.debit.get(),
			lvl: e.lim.levels[b.lvl], rate: e.slotRate(s)}
	})
	return out
}

// fataler is what checkStore needs of a *testing.T or a *rapid.T.
type fataler interface {
	Helper()
	Fatalf(format string, args ...any)
}

// checkStore verifies every invariant of the engine's bucket store.
func checkStore(t fataler, e *Engine) {
	t.Helper()
	st := &e.buckets
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("store: "+format, args...)
	}
	if st.slots > uint32(len(st.chunks))*chunkSize || (len(st.chunks) > 0 && st.slots <= uint32(len(st.chunks)-1)*chunkSize) {
		fail("%d slots in %d chunks", st.slots, len(st.chunks))
	}
	if st.live > 0 && (2*st.live > len(st.index) || 2*int(st.slots) > len(st.index)) {
		fail("index of %d entries for %d live buckets, %d slots", len(st.index), st.live, st.slots)
	}
	live, keys := 0, map[string]bool{}
	for ci := range st.chunks {
		c := &st.chunks[ci]
		if ci < len(st.chunks)-1 && len(c.recs) != chunkSize {
			fail("chunk %d holds %d records", ci, len(c.recs))
		}
		if len(c.heap) != len(c.recs) {
			fail("chunk %d: %d heap entries for %d records", ci, len(c.heap), len(c.recs))
		}
		n, used := 0, 0
		for i := range c.recs {
			r := &c.recs[i]
			if r.lvl == freeLevel {
				continue
			}
			n++
			s := uint32(ci)<<chunkShift | uint32(i)
			k := st.key(s)
			used += keySize(len(k))
			if keys[string(k)] {
				fail("key %q stored twice", k)
			}
			keys[string(k)] = true
			if got, stored := find(st, k, st.hash(k)); got != s || stored != string(k) {
				fail("key %q in slot %d is found in slot %d", k, s, got)
			}
			if lv := e.lim.levels[r.lvl]; lv != e.lim.matchKey(string(k)) || lv.rate == nil {
				fail("key %q points at level %d, which is not its rate-limited level", k, r.lvl)
			}
			if int(r.pos) >= st.hlen || st.hAt(int(r.pos)).slot != s {
				fail("slot %d: heap position %d does not name it", s, r.pos)
			}
			if due := st.hAt(int(r.pos)).due; due > st.due(e.slotFullAt(s)) {
				fail("key %q: heap due %d is after its full-at unit %d", k, due, st.due(e.slotFullAt(s)))
			}
		}
		if n != c.live {
			fail("chunk %d counts %d live records, holds %d", ci, c.live, n)
		}
		if used+c.dead != len(c.arena) {
			fail("chunk %d: %d live key bytes + %d dead != arena of %d", ci, used, c.dead, len(c.arena))
		}
		live += n
	}
	if live != st.live || st.hlen != st.live {
		fail("%d live records, live %d, heap %d", live, st.live, st.hlen)
	}
	entries := 0
	for _, v := range st.index {
		if v != 0 {
			entries++
		}
	}
	if entries != st.live {
		fail("%d index entries for %d buckets", entries, st.live)
	}
	for p := 1; p < st.hlen; p++ {
		if st.hAt(p).due < st.hAt((p-1)/2).due {
			fail("heap out of order at %d", p)
		}
	}
	free := 0
	for f := st.free; f != 0; f = st.rec(f - 1).pos {
		if f-1 >= st.slots || st.rec(f-1).lvl != freeLevel {
			fail("free list names slot %d", f-1)
		}
		if free++; free > int(st.slots) {
			fail("free list loops")
		}
	}
	if free != int(st.slots)-st.live {
		fail("%d free slots listed, %d slots and %d live", free, st.slots, st.live)
	}
}

// arenaBytes is the key memory the store holds.
func arenaBytes(e *Engine) int {
	n := 0
	for i := range e.buckets.chunks {
		n += cap(e.buckets.chunks[i].arena)
	}
	return n
}

// churnLimits: per-key buckets that refill in a second (so an idle Tick drops them) and ones
// that take a day.
func churnLimits() *Limits {
	return &Limits{Domains: []Domain{{Name: "d", Descriptors: []Node{
		{Key: "fast", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1, Burst: 2}},
		{Key: "slow", Rate: &Rate{Unit: 24 * time.Hour, RequestsPerUnit: 1, Burst: 2}},
	}}}}
}

func fastReq(i int, pad int) Request {
	return Request{Domain: "d", Descriptors: []Entry{{"fast", fmt.Sprintf("%08d-%s", i, strings.Repeat("p", pad))}}}
}

// Slots and key bytes of dropped buckets are reused: waves of new keys, each dropped before the
// next, keep the store at the size of one wave, however many keys pass through.
func TestStoreReusesSlotsAndKeyBytes(t *testing.T) {
	e := mustEngine(t, churnLimits())
	const wave = 3 * chunkSize
	now := Time(0)
	var slots uint32
	var arena int
	for w := 0; w < 9; w++ {
		for i := 0; i < wave; i++ {
			now += Time(time.Microsecond)
			if d := e.Acquire(now, fastReq(w*wave+i, w%3*20)); !d.Admitted {
				t.Fatalf("refused: %+v", d)
			}
		}
		checkStore(t, e)
		if w == 2 { // the longest keys
			slots, arena = e.buckets.slots, arenaBytes(e)
		}
		if w > 2 && (e.buckets.slots > slots || arenaBytes(e) > arena) {
			t.Fatalf("wave %d: %d slots, %d arena bytes; the first waves needed %d and %d", w, e.buckets.slots, arenaBytes(e), slots, arena)
		}
		now += Time(2 * time.Second)
		e.Tick(now)
		checkStore(t, e)
		if n := e.Stats().Buckets; n != 0 {
			t.Fatalf("wave %d: %d buckets left after they refilled", w, n)
		}
	}
}

// Dropping most buckets, scattered over the store, releases most of their memory: dead key bytes
// are compacted away and the records move down into fewer chunks.
func TestStoreShrinksAfterDrops(t *testing.T) {
	e := mustEngine(t, churnLimits())
	const n = 10 * chunkSize
	now := Time(0)
	for i := 0; i < n; i++ {
		now += Time(time.Microsecond)
		req := fastReq(i, 30)
		if i%20 == 0 { // one in twenty stays for a day
			req.Descriptors[0].Key = "slow"
		}
		e.Acquire(now, req)
	}
	checkStore(t, e)
	chunks, arena := len(e.buckets.chunks), arenaBytes(e)
	charges := e.Acquire(now, fastReq(7, 30)).Charges // must survive everything below unchanged
	want := strings.Clone(charges[0])
	now += Time(3 * time.Second)
	e.Tick(now)
	checkStore(t, e)
	if e.Stats().Buckets != n/20 {
		t.Fatalf("%d buckets left, want %d", e.Stats().Buckets, n/20)
	}
	if got := len(e.buckets.chunks); got > 2 || got >= chunks {
		t.Fatalf("%d chunks after dropping 95%% of %d buckets (had %d)", got, n, chunks)
	}
	if got := arenaBytes(e); got > arena/8 {
		t.Fatalf("%d key bytes held after dropping 95%% of the keys (had %d)", got, arena)
	}
	// What is left still works, and new keys go into the freed space.
	for i := 0; i < n; i += 20 {
		st, err := e.Status(now, "d", []Entry{{"slow", fmt.Sprintf("%08d-%s", i, strings.Repeat("p", 30))}})
		if err != nil || st[1].Remaining != 1 {
			t.Fatalf("bucket %d after the shrink: %+v %v", i, st, err)
		}
	}
	for i := 0; i < 1000; i++ {
		e.Acquire(now, fastReq(n+i, 0))
	}
	checkStore(t, e)
	if charges[0] != want {
		t.Fatalf("a Charges string changed under the store: %q, was %q", charges[0], want)
	}
}

// The index grows with the store, and every key stays findable through growth and deletes.
func TestStoreIndexGrowth(t *testing.T) {
	e := mustEngine(t, churnLimits())
	sizes := map[int]bool{}
	for i := 0; i < 5*chunkSize; i++ {
		req := fastReq(i, i%7)
		req.Descriptors[0].Key = "slow"
		e.Acquire(Time(i), req)
		sizes[len(e.buckets.index)] = true
		if i&(i-1) == 0 || i%997 == 0 {
			checkStore(t, e)
		}
	}
	if len(sizes) < 8 {
		t.Fatalf("the index took only the sizes %v", sizes)
	}
	checkStore(t, e)
}

// SetLimits re-points every bucket at its level in the new limits (by index), clamps and drops
// buckets by key, and a level that changes index but not rate keeps the balance exactly.
func TestStoreSetLimitsRepoints(t *testing.T) {
	a := &Limits{Domains: []Domain{{Name: "d", Descriptors: []Node{
		{Key: "k", Rate: &Rate{Unit: time.Hour, RequestsPerUnit: 100}},
		{Key: "gone", Rate: &Rate{Unit: time.Hour, RequestsPerUnit: 100}},
	}}}}
	b := &Limits{Domains: []Domain{{Name: "d", Descriptors: []Node{
		{Key: "new", Rate: &Rate{Unit: time.Hour, RequestsPerUnit: 3}}, // shifts k's index
		{Key: "k", Value: "v7", Rate: &Rate{Unit: time.Hour, RequestsPerUnit: 5}},
		{Key: "k", Rate: &Rate{Unit: time.Hour, RequestsPerUnit: 100}},
	}}}}
	e := mustEngine(t, a)
	for i := 0; i < 3000; i++ {
		e.Acquire(Time(i), Request{Domain: "d", Descriptors: []Entry{{"k", fmt.Sprintf("v%d", i)}}, Cost: 10})
		e.Acquire(Time(i), Request{Domain: "d", Descriptors: []Entry{{"gone", fmt.Sprintf("v%d", i)}}})
	}
	before := storedBuckets(e)
	if err := e.SetLimits(5000, b); err != nil {
		t.Fatal(err)
	}
	checkStore(t, e)
	after := storedBuckets(e)
	if len(after) != 3000 {
		t.Fatalf("%d buckets after SetLimits, want the 3000 under k", len(after))
	}
	for k, v := range after {
		if v.lvl != e.lim.matchKey(k) {
			t.Fatalf("%q points at the wrong level", k)
		}
		if k == "d/k=v7" {
			if v.tokens != 5*microPerUnit || v.last != 5000 { // 90 of 100 held, clamped to the new capacity
				t.Fatalf("%q: %+v, want clamped to 5 units at 5000", k, v)
			}
			continue
		}
		if old := before[k]; v.tokens != old.tokens || v.last != old.last {
			t.Fatalf("%q: balance moved from %+v to %+v although its rate did not change", k, old, v)
		}
	}
	// And back: the v7 bucket returns to the per-value level, "new" had no buckets.
	if err := e.SetLimits(6000, a); err != nil {
		t.Fatal(err)
	}
	checkStore(t, e)
}

// Far-future times: the heap's due base moves with the clock, and Tick still drops exactly the
// full buckets across many rebases.
func TestStoreDueRebase(t *testing.T) {
	e := mustEngine(t, &Limits{Domains: []Domain{{Name: "d", Descriptors: []Node{
		{Key: "k", Rate: &Rate{Unit: 30 * 24 * time.Hour, RequestsPerUnit: 2, Burst: 4}},
	}}}})
	now := Time(1) << 61
	for step := 0; step < 40; step++ {
		for i := 0; i < 50; i++ {
			e.Acquire(now, Request{Domain: "d", Descriptors: []Entry{{"k", fmt.Sprintf("v%d-%d", step, i)}}, Cost: uint64(i%4 + 1)})
		}
		now += Time(7*24*time.Hour) + Time(step)*Time(time.Hour)
		want := 0
		for _, b := range storedBuckets(e) {
			if tokens, _ := b.rate.refill(b.tokens, b.last, now); tokens < b.rate.capMicro {
				want++
			}
		}
		e.Tick(now)
		checkStore(t, e)
		if e.buckets.live != want {
			t.Fatalf("step %d: %d buckets stored, %d not full", step, e.buckets.live, want)
		}
		if uint64(e.clock-e.buckets.base) >= rebaseAfter {
			t.Fatalf("due base %d too far behind the clock %d", e.buckets.base, e.clock)
		}
	}
}

// Tick drops a bucket that becomes full within the same heap unit (about a millisecond) as
// a Tick that did not find it full yet.
func TestStoreTickWithinOneDueUnit(t *testing.T) {
	e := mustEngine(t, oneBucket(1000, time.Second, 1)) // full again 1ms after a debit
	e.Acquire(0, Request{Domain: "d"})
	for now := Time(0); now <= Time(time.Millisecond); now += 100 * Time(time.Microsecond) {
		e.Tick(now)
		checkStore(t, e)
		if full := now >= Time(time.Millisecond); (e.Stats().Buckets == 0) != full {
			t.Fatalf("at %v: %d buckets", time.Duration(now), e.Stats().Buckets)
		}
	}
}

// The store under random histories: every invariant holds after every command, and a snapshot
// taken at any point restores into a store with the same contents.
func TestStoreInvariantsProperty(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		e := NewEngine()
		if err := e.SetLimits(0, churnLimits()); err != nil {
			t.Fatal(err)
		}
		alt := churnLimits()
		alt.Domains[0].Descriptors[0].Rate.RequestsPerUnit = 3
		alt.Domains[0].Descriptors = alt.Domains[0].Descriptors[:1] // slow buckets go
		var now Time
		var admitted []Decision
		var captures []pendingCapture
		for i, n := 0, rapid.IntRange(1, 25).Draw(t, "n"); i < n; i++ {
			switch rapid.IntRange(0, 11).Draw(t, "op") {
			case 10:
				captures = append(captures, capture(t, e))
			case 11:
				if len(captures) > 0 {
					// Released captures are no longer read; the engine may write in place.
					j := rapid.IntRange(0, len(captures)-1).Draw(t, "release")
					captures[j].check(t)
					captures[j].c.Release()
					captures = slices.Delete(captures, j, j+1)
				}
			case 0:
				now += Time(rapid.Int64Range(0, int64(3*time.Second)).Draw(t, "idle"))
				e.Tick(now)
			case 1:
				l := churnLimits()
				if rapid.Bool().Draw(t, "alt") {
					l = alt
				}
				if err := e.SetLimits(now, l); err != nil {
					t.Fatal(err)
				}
			case 2:
				if len(admitted) > 0 {
					d := admitted[rapid.IntRange(0, len(admitted)-1).Draw(t, "refund")]
					e.Refund(now, d.Charges, 1, d.DebitSeq)
				}
			default:
				// Bursts of keys, so that chunks fill, and keys of all sizes.
				for j, m := 0, rapid.IntRange(1, 600).Draw(t, "burst"); j < m; j++ {
					now += Time(rapid.Int64Range(0, int64(time.Millisecond)).Draw(t, "dt"))
					req := fastReq(rapid.IntRange(0, 20000).Draw(t, "key"), rapid.IntRange(0, 150).Draw(t, "pad"))
					if rapid.IntRange(0, 3).Draw(t, "slow") == 0 {
						req.Descriptors[0].Key = "slow"
					}
					if d := e.Acquire(now, req); d.Admitted && j%10 == 0 {
						admitted = append(admitted, d)
					}
				}
			}
			checkStore(t, e)
		}
		for _, c := range captures {
			c.check(t)
		}
		data, err := e.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		r := NewEngine()
		if err := r.UnmarshalBinary(data); err != nil {
			t.Fatal(err)
		}
		checkStore(t, r)
		again, _ := r.MarshalBinary()
		if !bytes.Equal(data, again) || r.Hash() != e.Hash() {
			t.Fatal("snapshot round trip changed the store")
		}
	})
}

// The snapshot's key sort (7 bytes at a time) orders keys exactly as bytes.Compare, whatever
// their shared prefixes and lengths around the 7-byte steps.
func TestSortedBucketsOrder(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		e := NewEngine()
		if err := e.SetLimits(0, churnLimits()); err != nil {
			t.Fatal(err)
		}
		stems := []string{"", "a", "ab\x00", "abcdefg", "abcdefgh", "abcdefghijklmn", "abcdefghijklmno"}
		for i, n := 0, rapid.IntRange(1, 300).Draw(t, "n"); i < n; i++ {
			v := rapid.SampledFrom(stems).Draw(t, "stem") + rapid.StringMatching(`[a\x00\xff]{0,9}`).Draw(t, "tail")
			e.Acquire(0, Request{Domain: "d", Descriptors: []Entry{{"slow", v}}})
		}
		var got []string
		for _, x := range e.buckets.sortedBuckets() {
			got = append(got, string(e.buckets.key(x.slot)))
		}
		for i := 1; i < len(got); i++ {
			if got[i-1] >= got[i] {
				t.Fatalf("keys out of order: %q before %q", got[i-1], got[i])
			}
		}
		if len(got) != e.Stats().Buckets {
			t.Fatalf("%d keys sorted, %d stored", len(got), e.Stats().Buckets)
		}
	})
}

// matchKeyBytes, which SetLimits uses to re-point buckets without allocating, agrees with
// matchKey on every key, well-formed or not.
func TestMatchKeyBytesAgrees(t *testing.T) {
	c, err := compileLimits(goldenLimits(true), 1)
	if err != nil {
		t.Fatal(err)
	}
	rapid.Check(t, func(t *rapid.T) {
		key := rapid.StringMatching(`(api|p|c%2F%25%3D|x)(/(tenant|consumer|op|endpoint|k|path%25%2F%3Dx)=(vip|t3|write|e1|a%2Fb|%4|%zz|=|))*`).Draw(t, "key")
		got, _ := c.matchKeyBytes([]byte(key), nil)
		if want := c.matchKey(key); got != want {
			t.Fatalf("%q: matchKeyBytes %v, matchKey %v", key, got, want)
		}
	})
}

// pendingCapture is a Capture and what MarshalBinary returned when it was taken.
type pendingCapture struct {
	c    *Capture
	want []byte
}

func capture(t fataler, e *Engine) pendingCapture {
	want, err := e.MarshalBinary()
	if err != nil {
		t.Fatalf("MarshalBinary: %v", err)
	}
	c, err := e.Capture()
	if err != nil {
		t.Fatalf("Capture: %v", err)
	}
	return pendingCapture{c, want}
}

// check fails unless the capture still encodes the state it captured.
func (p pendingCapture) check(t fataler) {
	if got := p.c.AppendBinary(nil); !bytes.Equal(got, p.want) {
		t.Fatalf("a capture encodes %d bytes that differ from the %d of the state it captured", len(got), len(p.want))
	}
}

// A capture is encoded on another goroutine while commands change every chunk it shares (run
// with -race: a write to a shared record array would be reported), and encodes exactly the
// state it captured. Captures released before the next change cost no copies.
func TestCaptureConcurrentWithCommands(t *testing.T) {
	e := mustEngine(t, churnLimits())
	now := Time(0)
	const n = 4 * chunkSize
	for i := 0; i < n; i++ {
		now += Time(time.Microsecond)
		e.Acquire(now, fastReq(i, i%40))
	}
	for round := 0; round < 3; round++ {
		p := capture(t, e)
		done := make(chan []byte)
		go func() { done <- p.c.AppendBinary(nil) }()
		// Debit every bucket, add new ones, drop most (shrink, arena compaction), change limits.
		for i := 0; i < n; i++ {
			now += Time(time.Microsecond)
			e.Acquire(now, fastReq(i+round*n/2, i%40))
		}
		now += Time(3 * time.Second)
		e.Tick(now)
		alt := churnLimits()
		alt.Domains[0].Descriptors[0].Rate.RequestsPerUnit = 3
		if err := e.SetLimits(now, alt); err != nil {
			t.Fatal(err)
		}
		if got := <-done; !bytes.Equal(got, p.want) {
			t.Fatalf("round %d: the capture encoded a state that changed after it was taken", round)
		}
		p.check(t)
		checkStore(t, e)
		p.c.Release()
		p.c.Release() // idempotent
		for i := range e.buckets.chunks {
			if e.buckets.caps.Shared(e.buckets.chunks[i].shared) {
				t.Fatalf("chunk %d still marked shared with capture %d after its release", i, e.buckets.chunks[i].shared)
			}
		}
	}
	// After a release, a change copies nothing: the record arrays stay where they were.
	p := capture(t, e)
	p.c.Release()
	before := make([]*bucketRec, len(e.buckets.chunks))
	for i := range e.buckets.chunks {
		if len(e.buckets.chunks[i].recs) > 0 {
			before[i] = &e.buckets.chunks[i].recs[0]
		}
	}
	for i := 0; i < n; i++ {
		e.Acquire(now, fastReq(i, i%40))
	}
	for i := range before {
		if before[i] != nil && i < len(e.buckets.chunks) && len(e.buckets.chunks[i].recs) > 0 && &e.buckets.chunks[i].recs[0] != before[i] {
			t.Fatalf("chunk %d was copied after its capture was released", i)
		}
	}
}
