package quota

import (
	"bytes"
	"encoding/binary"
	"hash/maphash"
	"math"
	"math/bits"
	"unsafe"

	"github.com/quotad/quotad/internal/cow"
)

// Bucket storage.
//
// A node holds up to millions of stored buckets, so they live in memory the garbage collector
// never scans (no pointers), about 78 bytes a bucket with 24-byte keys where a map of *bucket
// took ~160:
//
//   - records: 36-byte bucketRecs in chunks of chunkSize, addressed by slot number
//     (slot>>chunkShift is the chunk); freed slots are reused;
//   - keys: each chunk has a byte arena holding its buckets' keys (uvarint length, bytes).
//     An arena is append-only: growing or compacting it copies the live keys into a new one.
//     So a key's bytes never change once written, and Decision.Charges share them without a
//     copy (keyString);
//   - the key index: an open-addressing table of 4-byte entries, at most half full (8-16 bytes
//     a bucket), hashed with a random seed per engine, as Go maps are;
//   - the full-at heap: an 8-byte entry per bucket, kept in the chunks beside the records.
//
// How memory is reclaimed, so that it follows the buckets stored now rather than every key
// ever seen: a dropped bucket's slot goes on a free list and its key bytes count as dead in its
// chunk's arena. An arena is rewritten with only its live keys when it needs room for a new key,
// and at the end of a Tick or SetLimits once its dead bytes reach 4 KiB and exceed its live
// ones; an arena whose chunk empties is released at once. When fewer than half of the slots
// are in use, the records of the last chunks move down into free slots, and the chunks so
// emptied (and an index much larger than needed) are released; an empty store releases
// everything. The work is amortized over the drops that caused it.
//
// Nothing here is replicated state: slots, arenas, index and heap order differ between a
// replica and one restored from a snapshot, so nothing that reaches Hash, a snapshot or a
// decision may depend on them (the engine sorts, sums, or looks up by key).

const (
	chunkShift = 12
	chunkSize  = 1 << chunkShift
	chunkMask  = chunkSize - 1

	noSlot    = ^uint32(0)
	freeLevel = ^uint32(0) // bucketRec.lvl of a free slot

	// dueShift is the unit of heap due times: 2^20 ns, about a millisecond.
	dueShift = 20
	// rebaseAfter: once the clock is this far past the due base, the base moves up, so due
	// times up to 2^31 units (~26 days) after the clock never saturate.
	rebaseAfter = 1 << (31 + dueShift)

	// minCompact: an arena is only rewritten to shed dead bytes once they reach this much.
	minCompact = 4 << 10
)

// u64 is a uint64 kept as two uint32 halves, so bucketRec is 4-byte aligned and packs into 36
// bytes rather than 40: at a million buckets that is 4 MB.
type u64 [2]uint32

func (v *u64) get() uint64  { return uint64(v[0]) | uint64(v[1])<<32 }
func (v *u64) set(x uint64) { v[0], v[1] = uint32(x), uint32(x>>32) }

// bucketRec is one stored token bucket. An absent bucket is full: only buckets that have been
// debited and not yet refilled to capacity are stored.
type bucketRec struct {
	tokens u64 // micro-units as of last
	last   u64 // Time
	// debit is the Engine.debitSeq of the last admission that debited this bucket: a refund is
	// honoured only for that one (see Engine.Refund).
	debit u64
	key   uint32 // offset of the key in its chunk's arena
	lvl   uint32 // index in Engine.lim.levels of the level whose rate governs it; freeLevel: free slot
	pos   uint32 // position of its full-at heap entry; for a free slot, 1 + the next free slot (0: none)
}

// heapEntry says that the bucket in slot is not full before due: due is a lower bound of its
// full-at time, in dueShift units after bucketStore.base (saturating). Every stored bucket has
// exactly one entry, at bucketRec.pos.
type heapEntry struct {
	due  uint32
	slot uint32
}

// bucketChunk holds the records of chunkSize consecutive slots, the heap entries at the same
// positions, and its records' keys.
type bucketChunk struct {
	recs   []bucketRec // all but the first chunk are allocated at full size
	heap   []heapEntry // len(heap) == len(recs)
	arena  []byte
	live   int // live records
	dead   int // arena bytes of freed keys
	queued bool
	// shared is the generation of the last Capture that marked recs (0: none): while it or an
	// older capture is open, recs must be copied before a record changes (own).
	shared uint64
}

// own makes c's records safe to change: if a capture that has not been released holds them,
// they are copied first. Keys need nothing: arenas are append-only, and a capture reads only
// the bytes it saw.
func (st *bucketStore) own(c *bucketChunk) {
	if c.shared == 0 {
		return
	}
	if st.caps.Shared(c.shared) {
		c.recs = append(make([]bucketRec, 0, cap(c.recs)), c.recs...)
	}
	c.shared = 0
}

// bucketStore holds the stored buckets: records, keys, the key index and the full-at heap.
// Make one with newBucketStore.
type bucketStore struct {
	chunks []bucketChunk // values, not pointers: one dependent load less per access
	slots  uint32        // slots handed out: the high-water mark
	free   uint32        // 1 + a free slot below slots, heading a list through bucketRec.pos; 0: none
	live   int
	hlen   int // heap entries

	// index: an entry is the top bits of the key's hash (those above the mask) with slot+1 in
	// the bits under it; 0 is empty. Linear probing from hash&mask, backward-shift deletion.
	// At most half full, and len(index) >= 2*slots (slots never exceed the most buckets ever
	// stored), so slot+1 fits under the mask.
	index []uint32

	base     Time     // heap due times count from here
	compactQ []uint32 // chunks with many dead key bytes, compacted by settle
	seed     maphash.Seed

	// caps are the open captures (Engine.Capture), which share the chunks' record arrays
	// copy-on-write; Capture.Release closes one, possibly from another goroutine.
	caps *cow.Captures

	// domKeys counts the stored buckets of each domain (by level.dom), for max_keys; lvlDom
	// maps a level index to its domain's ordinal. Both follow the installed limits (setDomains).
	domKeys []int
	lvlDom  []uint32
	// parentKeys counts the stored buckets of each level with max_keys_per_parent under one
	// parent path (by parentKey: the level and the key up to its last entry); capped marks
	// those levels. An entry lives while its count is above 0. Both follow the installed
	// limits (setDomains); pkBuf is parentKey's scratch for lookups.
	parentKeys map[string]int
	capped     []bool
	pkBuf      []byte
}

// parentKey appends to b the parentKeys key of a bucket of level lvl whose key is key.
func parentKey(b []byte, lvl uint32, key []byte) []byte {
	b = binary.LittleEndian.AppendUint32(b, lvl)
	if i := bytes.LastIndexByte(key, '/'); i >= 0 {
		key = key[:i] // '/' in names is escaped: the last one ends the parent path
	}
	return append(b, key...)
}

// underParent returns how many buckets of level lvl are stored under the parent path of
// key (0 for a level without max_keys_per_parent).
func (st *bucketStore) underParent(lvl uint32, key []byte) int {
	if int(lvl) >= len(st.capped) || !st.capped[lvl] {
		return 0
	}
	st.pkBuf = parentKey(st.pkBuf[:0], lvl, key)
	return st.parentKeys[string(st.pkBuf)]
}

// countParent adds delta to the count of key's parent path at level lvl, if it is capped.
func (st *bucketStore) countParent(lvl uint32, key []byte, delta int) {
	if int(lvl) >= len(st.capped) || !st.capped[lvl] {
		return
	}
	st.pkBuf = parentKey(st.pkBuf[:0], lvl, key)
	if n := st.parentKeys[string(st.pkBuf)] + delta; n > 0 {
		st.parentKeys[string(st.pkBuf)] = n
	} else {
		delete(st.parentKeys, string(st.pkBuf))
	}
}

// setDomains installs the level → domain mapping of c and recounts the buckets per domain.
func (st *bucketStore) setDomains(c *compiled) {
	st.lvlDom = st.lvlDom[:0]
	for _, lv := range c.levels {
		st.lvlDom = append(st.lvlDom, lv.dom)
	}
	st.domKeys = make([]int, len(c.limits.Domains))
	st.capped, st.parentKeys = st.capped[:0], nil
	for _, lv := range c.levels {
		st.capped = append(st.capped, lv.maxPerParent > 0)
		if lv.maxPerParent > 0 && st.parentKeys == nil {
			st.parentKeys = make(map[string]int)
		}
	}
	st.eachLive(func(s uint32, r *bucketRec) {
		st.domKeys[st.lvlDom[r.lvl]]++
		st.countParent(r.lvl, st.key(s), 1)
	})
}

func newBucketStore() bucketStore {
	return bucketStore{seed: maphash.MakeSeed(), caps: new(cow.Captures)}
}

// rec returns the record of slot s, to change it. Paths that only read use peek: a read-only
// method may run concurrently with others, and rec may copy the chunk (own).
func (st *bucketStore) rec(s uint32) *bucketRec {
	c := &st.chunks[s>>chunkShift]
	if c.shared != 0 {
		st.own(c)
	}
	return &c.recs[s&chunkMask]
}

// peek returns the record of slot s, only to read it.
func (st *bucketStore) peek(s uint32) *bucketRec {
	return &st.chunks[s>>chunkShift].recs[s&chunkMask]
}

// key returns the key of the bucket in slot s; it is valid until the store next changes.
func (st *bucketStore) key(s uint32) []byte {
	c := &st.chunks[s>>chunkShift]
	return arenaKey(c.arena, c.recs[s&chunkMask].key)
}

// keyString returns the key of the bucket in slot s as a string sharing the arena's bytes,
// which is safe because those bytes are never written again (see the arena above); the string
// keeps the arena alive for as long as it is held.
func (st *bucketStore) keyString(s uint32) string {
	k := st.key(s)
	return unsafe.String(unsafe.SliceData(k), len(k))
}

func arenaKey(arena []byte, off uint32) []byte {
	n, w := uint64(arena[off]), 1
	if n >= 0x80 {
		n, w = binary.Uvarint(arena[off:])
	}
	start := int(off) + w
	return arena[start : start+int(n)]
}

// hash and hashString hash a key for the index. The seed is random per engine, as a Go map's
// is, so keys cannot be crafted to collide; nothing observable depends on it.
func (st *bucketStore) hash(k []byte) uint32       { return uint32(maphash.Bytes(st.seed, k)) }
func (st *bucketStore) hashString(k string) uint32 { return uint32(maphash.String(st.seed, k)) }

// find returns the slot of the bucket stored under key (whose hash is h), or noSlot, and the
// stored key as a string sharing the arena's bytes (see keyString).
func find[K ~string | ~[]byte](st *bucketStore, key K, h uint32) (uint32, string) {
	idx := st.index
	if len(idx) == 0 {
		return noSlot, ""
	}
	mask := uint32(len(idx) - 1)
	top := h &^ mask
	for i := h & mask; ; i = (i + 1) & mask {
		v := idx[i]
		if v == 0 {
			return noSlot, ""
		}
		if v&^mask == top {
			s := v&mask - 1
			c := &st.chunks[s>>chunkShift]
			off := c.recs[s&chunkMask].key
			// Most keys are shorter than 128 bytes: a one-byte length to compare first.
			if n := c.arena[off]; n < 0x80 {
				if k := c.arena[off+1 : off+1+uint32(n)]; int(n) == len(key) && string(k) == string(key) {
					return s, unsafe.String(unsafe.SliceData(k), len(k))
				}
			} else if k := arenaKey(c.arena, off); string(k) == string(key) {
				return s, unsafe.String(unsafe.SliceData(k), len(k))
			}
		}
	}
}

func (st *bucketStore) indexAdd(s, h uint32) {
	mask := uint32(len(st.index) - 1)
	i := h & mask
	for st.index[i] != 0 {
		i = (i + 1) & mask
	}
	st.index[i] = h&^mask | (s + 1)
}

// indexDel removes slot s, whose key is still in place, from the index.
func (st *bucketStore) indexDel(s uint32) {
	idx := st.index
	mask := uint32(len(idx) - 1)
	h := st.hash(st.key(s))
	want := h&^mask | (s + 1)
	i := h & mask
	for idx[i] != want {
		i = (i + 1) & mask
	}
	// Shift back every later entry of the cluster that may move into the hole, i.e. whose home
	// is not in (i, j].
	for j := i; ; {
		j = (j + 1) & mask
		v := idx[j]
		if v == 0 {
			break
		}
		home := st.hash(st.key(v&mask-1)) & mask
		if (j-home)&mask >= (j-i)&mask {
			idx[i] = v
			i = j
		}
	}
	idx[i] = 0
}

// rebuildIndex rebuilds the index for the live records, with at least size entries.
func (st *bucketStore) rebuildIndex(size int) {
	n := 16
	for n < size || n < 2*int(st.slots) || n < 2*(st.live+1) {
		n *= 2
	}
	if n == len(st.index) {
		clear(st.index)
	} else {
		st.index = make([]uint32, n)
	}
	st.eachLive(func(s uint32, _ *bucketRec) { st.indexAdd(s, st.hash(st.key(s))) })
}

// reserve sizes an empty store's index and first chunk for n buckets, so that filling it (a
// restore) allocates each once.
func (st *bucketStore) reserve(n int) {
	if n == 0 || st.slots > 0 {
		return
	}
	st.rebuildIndex(2 * (n + 1))
	m := min(n, chunkSize)
	st.chunks = append(st.chunks, bucketChunk{recs: make([]bucketRec, 0, m), heap: make([]heapEntry, 0, m)})
}

// eachLive calls fn for every stored bucket, in slot order.
func (st *bucketStore) eachLive(fn func(s uint32, r *bucketRec)) {
	for ci := range st.chunks {
		c := &st.chunks[ci]
		if c.live == 0 {
			continue
		}
		for i := range c.recs {
			if r := &c.recs[i]; r.lvl != freeLevel {
				fn(uint32(ci)<<chunkShift|uint32(i), r) // only to read: see rec
			}
		}
	}
}

// add stores a new bucket under key (hash h), which must not be stored yet, and returns its
// slot. The caller sets its state and then gives it a heap entry (push).
func (st *bucketStore) add(key []byte, h uint32, lvl uint32) uint32 {
	if 2*(st.live+1) > len(st.index) {
		st.rebuildIndex(2 * len(st.index))
	}
	s := st.alloc()
	c := &st.chunks[s>>chunkShift]
	c.live++
	st.live++
	st.putKey(c, s, key)
	r := &c.recs[s&chunkMask]
	*r = bucketRec{key: r.key, lvl: lvl}
	st.domKeys[st.lvlDom[lvl]]++
	st.countParent(lvl, key, 1)
	st.indexAdd(s, h)
	return s
}

func (st *bucketStore) alloc() uint32 {
	if st.free != 0 {
		s := st.free - 1
		st.free = st.peek(s).pos
		return s
	}
	s := st.slots
	ci := int(s >> chunkShift)
	if ci == len(st.chunks) {
		var c bucketChunk
		if ci > 0 { // the first chunk grows; the others would fill up anyway
			c.recs, c.heap = make([]bucketRec, 0, chunkSize), make([]heapEntry, 0, chunkSize)
		}
		st.chunks = append(st.chunks, c)
	}
	c := &st.chunks[ci]
	st.own(c)
	if len(c.recs) == cap(c.recs) {
		n := min(chunkSize, max(8, 2*len(c.recs)))
		c.recs = append(make([]bucketRec, 0, n), c.recs...)
		c.heap = append(make([]heapEntry, 0, n), c.heap...)
	}
	c.recs = c.recs[:len(c.recs)+1]
	c.heap = c.heap[:len(c.heap)+1]
	c.recs[len(c.recs)-1] = bucketRec{lvl: freeLevel}
	st.slots++
	return s
}

func keySize(n int) int {
	if n < 0x80 {
		return 1 + n
	}
	return (bits.Len(uint(n))+6)/7 + n
}

// putKey appends key to c's arena as slot s's key, first making room if needed.
func (st *bucketStore) putKey(c *bucketChunk, s uint32, key []byte) {
	st.own(c)
	need := keySize(len(key))
	if len(c.arena)+need > cap(c.arena) {
		// Room for the keys of the chunk's free slots at the average key size so far, so a
		// filling chunk is rewritten about once; dead keys are dropped on the way.
		liveBytes := len(c.arena) - c.dead
		room := cap(c.recs) - c.live // free slots besides this one (live counts it)
		want := liveBytes + need + (liveBytes+need)/c.live*(room)
		st.moveArena(c, max(64, want+want/32))
	}
	off := len(c.arena)
	if off+need > math.MaxUint32 {
		panic("quota: the keys of one bucket chunk exceed 4 GiB")
	}
	c.arena = binary.AppendUvarint(c.arena, uint64(len(key)))
	c.arena = append(c.arena, key...)
	c.recs[s&chunkMask].key = uint32(off)
}

// moveArena copies c's live keys into a new arena of capacity size. The old one is left as it
// is: strings may still share it (keyString).
func (st *bucketStore) moveArena(c *bucketChunk, size int) {
	st.own(c)
	old := c.arena
	c.arena = make([]byte, 0, size)
	for i := range c.recs {
		if r := &c.recs[i]; r.lvl != freeLevel && len(old) > 0 {
			k := arenaKey(old, r.key)
			r.key = uint32(len(c.arena))
			c.arena = binary.AppendUvarint(c.arena, uint64(len(k)))
			c.arena = append(c.arena, k...)
		}
	}
	c.dead = 0
}

// drop removes the bucket in slot s, whose heap entry is already gone.
func (st *bucketStore) drop(s uint32) {
	st.indexDel(s)
	st.release(s)
}

// release frees slot s and its key without touching the index (the caller rebuilds it).
func (st *bucketStore) release(s uint32) {
	ci := s >> chunkShift
	c := &st.chunks[ci]
	st.own(c)
	r := &c.recs[s&chunkMask]
	c.dead += keySize(len(arenaKey(c.arena, r.key)))
	st.domKeys[st.lvlDom[r.lvl]]--
	st.countParent(r.lvl, arenaKey(c.arena, r.key), -1)
	c.live--
	st.live--
	r.lvl, r.pos = freeLevel, st.free
	st.free = s + 1
	switch {
	case c.live == 0:
		c.arena, c.dead = nil, 0
	case !c.queued && c.dead >= minCompact && c.dead > len(c.arena)-c.dead:
		c.queued = true
		st.compactQ = append(st.compactQ, ci)
	}
}

// settle reclaims memory after drops: it rewrites arenas that are mostly dead keys, moves
// records down when less than half of the slots are in use, and empties an empty store.
func (st *bucketStore) settle() {
	if st.live == 0 {
		if st.slots > 0 {
			*st = bucketStore{base: st.base, seed: st.seed, caps: st.caps, lvlDom: st.lvlDom, domKeys: st.domKeys,
				capped: st.capped, parentKeys: st.parentKeys}
		}
		return
	}
	for _, ci := range st.compactQ {
		c := &st.chunks[ci]
		c.queued = false
		if liveBytes := len(c.arena) - c.dead; c.dead > liveBytes {
			st.moveArena(c, liveBytes+liveBytes/16)
		}
	}
	st.compactQ = st.compactQ[:0]
	if len(st.chunks) > 2 && 2*st.live < int(st.slots) {
		st.shrink()
	}
}

// shrink moves the records of the last chunks into free slots of the first ones and releases
// the emptied chunks, and the index too when it is four times the size it needs.
func (st *bucketStore) shrink() {
	keep := (st.live+chunkSize-1)/chunkSize + 1 // one chunk of room, so churn does not shrink and grow
	if keep >= len(st.chunks) {
		return
	}
	limit := uint32(keep) << chunkShift
	// Free slots below limit, lowest first.
	var dst []uint32
	for ci := 0; ci < keep; ci++ {
		c := &st.chunks[ci]
		for i := range c.recs {
			if c.recs[i].lvl == freeLevel {
				dst = append(dst, uint32(ci)<<chunkShift|uint32(i))
			}
		}
	}
	for ci := keep; ci < len(st.chunks); ci++ {
		c := &st.chunks[ci]
		for i := range c.recs {
			src := c.recs[i]
			if src.lvl == freeLevel {
				continue
			}
			from, to := uint32(ci)<<chunkShift|uint32(i), dst[0]
			dst = dst[1:]
			// Re-point the index and heap entries, then move the record and its key.
			st.repoint(from, to)
			st.hAt(int(src.pos)).slot = to
			dc := &st.chunks[to>>chunkShift]
			dc.live++
			st.putKey(dc, to, arenaKey(c.arena, src.key))
			src.key = dc.recs[to&chunkMask].key
			dc.recs[to&chunkMask] = src
		}
	}
	clear(st.chunks[keep:])
	st.chunks = st.chunks[:keep]
	st.slots = limit
	// The free list: what is left of dst, lowest first.
	st.free = 0
	for i := len(dst) - 1; i >= 0; i-- {
		st.rec(dst[i]).pos = st.free
		st.free = dst[i] + 1
	}
	if len(st.index) >= 8*int(st.slots) && len(st.index) > 16 {
		st.rebuildIndex(0)
	}
}

// repoint changes the index entry of the bucket in slot from to name slot to.
func (st *bucketStore) repoint(from, to uint32) {
	idx := st.index
	mask := uint32(len(idx) - 1)
	h := st.hash(st.key(from))
	want := h&^mask | (from + 1)
	i := h & mask
	for idx[i] != want {
		i = (i + 1) & mask
	}
	idx[i] = h&^mask | (to + 1)
}

// Full-at heap: a binary min-heap by due over positions [0, hlen), kept in the chunks.

func (st *bucketStore) hAt(p int) *heapEntry {
	return &st.chunks[p>>chunkShift].heap[p&chunkMask]
}

func (st *bucketStore) hPut(p int, x heapEntry) {
	*st.hAt(p) = x
	st.rec(x.slot).pos = uint32(p)
}

func (st *bucketStore) up(p int, x heapEntry) {
	for p > 0 {
		q := (p - 1) / 2
		y := *st.hAt(q)
		if y.due <= x.due {
			break
		}
		st.hPut(p, y)
		p = q
	}
	st.hPut(p, x)
}

func (st *bucketStore) down(p int, x heapEntry) {
	n := st.hlen
	for {
		l := 2*p + 1
		if l >= n {
			break
		}
		m, y := l, *st.hAt(l)
		if r := l + 1; r < n {
			if z := *st.hAt(r); z.due < y.due {
				m, y = r, z
			}
		}
		if x.due <= y.due {
			break
		}
		st.hPut(p, y)
		p = m
	}
	st.hPut(p, x)
}

// push gives slot s its heap entry.
func (st *bucketStore) push(s uint32, due uint32) {
	st.hlen++
	st.up(st.hlen-1, heapEntry{due, s})
}

// top returns the entry with the least due; the heap must not be empty.
func (st *bucketStore) top() heapEntry { return *st.hAt(0) }

// pop removes the top entry.
func (st *bucketStore) pop() {
	st.hlen--
	if st.hlen > 0 {
		st.down(0, *st.hAt(st.hlen))
	}
}

// setDue moves slot s's heap entry to due.
func (st *bucketStore) setDue(s uint32, due uint32) {
	p := int(st.peek(s).pos)
	x := st.hAt(p)
	switch old := x.due; {
	case due < old:
		st.up(p, heapEntry{due, s})
	case due > old:
		st.down(p, heapEntry{due, s})
	}
}

// heapify orders positions [0, hlen) into a heap, fixing every record's pos.
func (st *bucketStore) heapify() {
	for p := 0; p < st.hlen; p++ {
		st.rec(st.hAt(p).slot).pos = uint32(p)
	}
	for p := st.hlen/2 - 1; p >= 0; p-- {
		st.down(p, *st.hAt(p))
	}
}

// due converts a time to heap units after base, rounding down (so a due is a lower bound).
func (st *bucketStore) due(t Time) uint32 {
	if t <= st.base {
		return 0
	}
	return uint32(min(uint64(t-st.base)>>dueShift, math.MaxUint32))
}

// rebase moves base up by whole units so that now is less than rebaseAfter past it. Subtracting
// the same amount from every due keeps them lower bounds and keeps the heap ordered.
func (st *bucketStore) rebase(now Time) {
	if now <= st.base || uint64(now-st.base) < rebaseAfter {
		return
	}
	units := uint64(now-st.base) >> dueShift
	st.base += Time(units << dueShift)
	for p := 0; p < st.hlen; p++ {
		x := st.hAt(p)
		x.due = uint32(uint64(x.due) - min(uint64(x.due), units))
	}
}
