package fsm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"io"
	"math/bits"
	"slices"
	"time"

	"github.com/quotad/quotad/internal/cow"
	"github.com/quotad/quotad/quota"
)

// dedupRecord is one remembered decision: 32 bytes and pointer-free. The decision itself is
// kept in its chunk's byte arena: the fields that vary, in the layout the snapshot uses
// (appendDecision), after the index of an interned template holding the others
// (dedup_template.go). Snapshots and the state hash interleave the two, copying bytes rather
// than re-encoding; a retry or a refund decodes the result.
type dedupRecord struct {
	id      uint64
	expires quota.Time
	// fp fingerprints the request that was decided (admissionFingerprint): a request ID reused
	// for a different request is refused, not answered with this decision. 0: not known (a
	// record restored from a format 2 snapshot); never compared.
	fp     uint64
	client uint32 // index into dedupTable.clients; the top bit is the refunded flag
	off    uint32 // start of the stored decision in the chunk's arena; it ends where the next begins
}

const refundedBit = 1 << 31

// dedupChunkData holds dedupChunk consecutive records and their encoded decisions.
type dedupChunkData struct {
	recs  []dedupRecord
	arena []byte
	// shared is the generation of the last capture that marked this chunk (0: none). While it
	// or an older capture is open the chunk is not reused, and its records are copied before a
	// record changes (ownRecs says they have been since that mark). Records are only ever
	// appended past what a capture saw, and arena bytes too, so appending needs nothing.
	shared  uint64
	ownRecs bool
}

// decisionBytes is the stored form of record i's decision.
func (c *dedupChunkData) decisionBytes(i int) []byte {
	end := uint32(len(c.arena))
	if i+1 < len(c.recs) {
		end = c.recs[i+1].off
	}
	return c.arena[c.recs[i].off:end]
}

// dedupClient is one interned client ID with the number of live records that name it; an ID
// is forgotten (and its index reused) when its last record expires.
type dedupClient struct {
	id   string
	refs uint32
}

// dedupTable remembers decisions by request ID until they expire in FSM time. Records are kept
// in a FIFO: FSM time never goes backwards and every record lives equally long, so insertion
// order is expiry order and expiring is a pop from the front — deterministic on every replica.
//
// At full load the table holds a whole DedupWindow of admissions (millions of records), so it
// is built to cost little memory and no GC work: records are 24-byte pointer-free values in
// fixed-size chunks addressed by sequence number, each chunk with one pointer-free byte arena
// for the decisions (~40 bytes each), and the index is a map of pointer-free keys. A put
// allocates nothing (amortized); expiring frees whole chunks, which are reused. Client IDs
// and the fields of decisions that repeat are interned (refcounted), so a record names its
// client with 4 bytes and its template with one or two.
type dedupTable struct {
	index  dedupIndex        // (client, id) → the record's sequence number
	chunks []*dedupChunkData // chunks[0].recs[0] has sequence number first
	spare  *dedupChunkData   // an emptied chunk kept for the next put
	first  uint64
	head   uint64 // the oldest live record
	next   uint64 // the sequence number of the next put

	arenaHint int // bytes the last filled chunk's decisions took

	clients   []dedupClient
	clientIdx map[string]uint32
	freeIdx   []uint32

	templates decisionTemplates
	scratch   []byte // put's encoding of the decision it stores

	// gen changes whenever a record is added or removed: a dedupSpot from before is stale.
	gen uint64

	// caps are the open captures (snapshots, the state hash, a growing index); dedupCapture.release
	// closes one, possibly from another goroutine.
	caps *cow.Captures
}

const dedupChunk = 4096

// dedupIndex finds a record by (client, id): an open-addressing hash table (linear probing,
// backward-shift deletion, at most half full) of 8-byte slots. A slot holds 32 bits of the
// key's hash (top bit forced to 1, so 0 means empty; the low bits pick the home slot) and the
// low 32 bits of the record's sequence number — live sequence numbers span less than 2^32, so
// these identify it. A lookup compares hashes in the slots and touches a record only on a
// hash match; growing and deleting never touch records. 16–32 bytes per record and no
// pointers, where a Go map of (client, id) → sequence number took ~55.
type dedupIndex struct {
	slots []uint64
	n     int
	grow  *indexGrowth // a larger index being built on another goroutine, or nil
}

// indexGrowth is the next, twice as large index, built on another goroutine from a capture of
// the records [from, to) while the table goes on with the current one; finishGrowth swaps it
// in. Growing a large index in place stalled the apply goroutine — about 250 ms at 8M
// records here, longer on a machine with slow page faults — and a follower whose apply
// goroutine stalls answers no heartbeats (see FSM.Snapshot).
type indexGrowth struct {
	done     chan struct{}
	slots    []uint64 // read only after done is closed
	from, to uint64
	view     *dedupCapture
}

// backgroundGrowthSlots: an index at least this large grows on another goroutine; a smaller
// one grows in place, in a few milliseconds. A variable so tests can exercise the background
// path with small tables.
var backgroundGrowthSlots = 1 << 20

func dedupHash(client uint32, id uint64) uint32 {
	h := id ^ uint64(client)<<32 ^ 0x9e3779b97f4a7c15
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	return uint32(h^h>>31) | 1<<31
}

// hash is dedupHash of the record's key.
func (r *dedupRecord) hash() uint32 { return dedupHash(r.client&^refundedBit, r.id) }

// indexEntry is the slot value for record seq whose key hashes to h.
func indexEntry(h uint32, seq uint64) uint64 { return uint64(h)<<32 | uint64(uint32(seq)) }

// seqOf reconstructs the full sequence number of a slot.
func (t *dedupTable) seqOf(slot uint64) uint64 { return t.head + uint64(uint32(slot)-uint32(t.head)) }

func (t *dedupTable) recAt(seq uint64) *dedupRecord {
	c, i := t.at(seq)
	return &c.recs[i]
}

// find returns the sequence number of the record for (client, id); on a miss, the empty slot
// where its probe ended, where insertAt can put it (noSlot on a hit or if the index is empty).
func (x *dedupIndex) find(t *dedupTable, client uint32, id uint64) (seq uint64, ok bool, empty uint64) {
	if x.n == 0 {
		return 0, false, noSlot
	}
	h := dedupHash(client, id)
	mask := uint64(len(x.slots) - 1)
	for i := uint64(h) & mask; ; i = (i + 1) & mask {
		v := x.slots[i]
		if v == 0 {
			return 0, false, i
		}
		if uint32(v>>32) != h {
			continue
		}
		seq := t.seqOf(v)
		if r := t.recAt(seq); r.id == id && r.client&^refundedBit == client {
			return seq, true, noSlot
		}
	}
}

const noSlot = ^uint64(0)

// insertAt adds record seq, whose key hashes to h, at slot: the empty slot that find ended
// on, with nothing inserted or removed since. It probes again only if the index must grow.
func (x *dedupIndex) insertAt(slot uint64, h uint32, seq uint64) {
	v := indexEntry(h, seq)
	if slot == noSlot || (x.n+1)*2 > len(x.slots) {
		x.reserve(max(x.n+1, len(x.slots)))
		x.place(v)
	} else {
		x.slots[slot] = v
	}
	x.n++
}

// insert adds record seq (already in the table; its key is not in the index).
func (x *dedupIndex) insert(t *dedupTable, seq uint64) {
	if (x.n+1)*2 > len(x.slots) {
		x.reserve(max(x.n+1, len(x.slots))) // doubles
	}
	x.place(indexEntry(t.recAt(seq).hash(), seq))
	x.n++
}

func (x *dedupIndex) place(v uint64) {
	mask := uint64(len(x.slots) - 1)
	i := (v >> 32) & mask
	for x.slots[i] != 0 {
		i = (i + 1) & mask
	}
	x.slots[i] = v
}

// reserve makes room for n entries in all, so that inserting up to n rehashes nothing.
func (x *dedupIndex) reserve(n int) {
	size := indexSize(n, len(x.slots))
	if size == len(x.slots) {
		return
	}
	old := x.slots
	x.slots = make([]uint64, size)
	for _, v := range old {
		if v != 0 {
			x.place(v)
		}
	}
}

// indexSize is the number of slots for n entries in an index of at least size slots.
func indexSize(n, size int) int {
	size = max(1024, size)
	for n*2 > size {
		size *= 2
	}
	return size
}

// buildIndex indexes every record of a table whose index is empty (a restored one).
// Inserting a million records in sequence order would write to random slots of a 16 MB
// table, each write a cache and TLB miss (~300 ns on a VM); inserting them grouped by the
// part of the table they hash to moves through it once, within a window of a few pages.
func (t *dedupTable) buildIndex() {
	if n := t.len(); n > 0 {
		t.index.slots, t.index.n = buildSlots(t.view(), indexSize(n, len(t.index.slots))), n
	}
}

// buildSlots returns an index of size slots holding the records of v.
func buildSlots(v *dedupCapture, size int) []uint64 {
	slots := make([]uint64, size)
	mask := uint64(size - 1)
	const groupBits = 8 // 256 groups: 64 KB of slots each with 1M records
	shift := max(bits.Len64(mask)-groupBits, 0)
	var start [1<<groupBits + 1]int // group g's entries go to vs[start[g]:start[g+1]]
	for ci := range v.chunks {
		for _, r := range v.chunks[ci].recs {
			start[(uint64(r.hash())&mask)>>shift+1]++
		}
	}
	for g := 1; g < len(start); g++ {
		start[g] += start[g-1]
	}
	vs := make([]uint64, v.n)
	seq := v.head
	for ci := range v.chunks {
		for _, r := range v.chunks[ci].recs {
			h := r.hash()
			g := (uint64(h) & mask) >> shift
			vs[start[g]] = indexEntry(h, seq)
			start[g]++
			seq++
		}
	}
	x := dedupIndex{slots: slots}
	for _, v := range vs {
		x.place(v)
	}
	return slots
}

// growIndex starts or finishes growing the index in the background; putAt calls it before it
// inserts. An index that reaches half full while its successor is still being built waits
// for it (the successor was started at three eighths, so that is rare).
func (t *dedupTable) growIndex() {
	x := &t.index
	if g := x.grow; g != nil {
		if (x.n+1)*2 > len(x.slots) {
			<-g.done
		}
		select {
		case <-g.done:
			t.finishGrowth()
		default:
		}
		return
	}
	if len(x.slots) < backgroundGrowthSlots || x.n*8 < len(x.slots)*3 {
		return
	}
	g := &indexGrowth{done: make(chan struct{}), from: t.head, to: t.next, view: t.capture()}
	size := 2 * len(x.slots)
	go func() {
		g.slots = buildSlots(g.view, size)
		close(g.done)
	}()
	x.grow = g
}

// finishGrowth swaps in the index built in the background, first bringing it up to date:
// records expired since the capture come out, records added since go in.
func (t *dedupTable) finishGrowth() {
	g := t.index.grow
	nx := dedupIndex{slots: g.slots, n: int(g.to - g.from)}
	for seq := g.from; seq < min(t.head, g.to); seq++ {
		r := g.view.rec(seq)
		nx.removeEntry(indexEntry(r.hash(), seq))
	}
	for seq := max(g.to, t.head); seq < t.next; seq++ {
		nx.place(indexEntry(t.recAt(seq).hash(), seq))
		nx.n++
	}
	t.index = nx
	g.view.release()
	t.gen++ // spots found in the old index are stale
}

// remove deletes the entry of the oldest live record t.head, whose key is (client, id)
// (records expire in order), before t.head moves past it.
func (x *dedupIndex) remove(t *dedupTable, client uint32, id uint64) {
	x.removeEntry(indexEntry(dedupHash(client, id), t.head))
}

// removeEntry deletes the slot value want (hash and sequence number) if it is there.
func (x *dedupIndex) removeEntry(want uint64) {
	mask := uint64(len(x.slots) - 1)
	i := (want >> 32) & mask
	for x.slots[i] != want {
		if x.slots[i] == 0 {
			return // not indexed (cannot happen)
		}
		i = (i + 1) & mask
	}
	// Backward-shift deletion: pull later entries of the probe run into the hole.
	for j := (i + 1) & mask; x.slots[j] != 0; j = (j + 1) & mask {
		home := (x.slots[j] >> 32) & mask
		// Move slot j into the hole i unless its home lies cyclically in (i, j].
		if (j-home)&mask >= (j-i)&mask {
			x.slots[i] = x.slots[j]
			i = j
		}
	}
	x.slots[i] = 0
	x.n--
}

func newDedupTable() *dedupTable {
	return &dedupTable{clientIdx: make(map[string]uint32), caps: new(cow.Captures)}
}

func (t *dedupTable) len() int { return int(t.next - t.head) }

func (t *dedupTable) at(seq uint64) (*dedupChunkData, int) {
	i := seq - t.first
	return t.chunks[i/dedupChunk], int(i % dedupChunk)
}

// lookup returns the sequence number of the record for (client, id).
func (t *dedupTable) lookup(client string, id uint64) (uint64, bool) {
	seq, ok, _ := t.find(client, id)
	return seq, ok
}

// dedupSpot is where a lookup that missed would put (client, id): putAt can then skip looking
// the client up and probing the index again. It is only valid until the table changes.
type dedupSpot struct {
	gen   uint64 // dedupTable.gen when found
	slot  uint64 // the empty index slot the probe ended on, or noSlot
	ci    uint32 // the client's index, when known
	hash  uint32 // dedupHash(ci, id), when known
	known bool   // the client is interned
}

// find is lookup that, on a miss, also says where putAt would put the record.
func (t *dedupTable) find(client string, id uint64) (seq uint64, ok bool, at dedupSpot) {
	at = dedupSpot{gen: t.gen, slot: noSlot}
	ci, known := t.clientIdx[client]
	if !known {
		return 0, false, at
	}
	at.ci, at.known, at.hash = ci, true, dedupHash(ci, id)
	seq, ok, at.slot = t.index.find(t, ci, id)
	return seq, ok, at
}

// decision decodes the remembered decision of record seq.
func (t *dedupTable) decision(seq uint64) quota.Decision {
	c, i := t.at(seq)
	var buf [128]byte
	d := decoder{buf: t.templates.appendExpanded(buf[:0], c.decisionBytes(i))}
	return d.decision()
}

// fingerprint returns the fingerprint of the request record seq decided (0: not known).
func (t *dedupTable) fingerprint(seq uint64) uint64 {
	c, i := t.at(seq)
	return c.recs[i].fp
}

func (t *dedupTable) refunded(seq uint64) bool {
	c, i := t.at(seq)
	return c.recs[i].client&refundedBit != 0
}

func (t *dedupTable) setRefunded(seq uint64) {
	c, i := t.at(seq)
	if !c.ownRecs && t.caps.Shared(c.shared) {
		c.recs = append(make([]dedupRecord, 0, dedupChunk), c.recs...)
		c.ownRecs = true
	}
	c.recs[i].client |= refundedBit
}

// get returns the remembered decision for (client, id).
func (t *dedupTable) get(client string, id uint64) (quota.Decision, bool) {
	seq, ok := t.lookup(client, id)
	if !ok {
		return quota.Decision{}, false
	}
	return t.decision(seq), true
}

func (t *dedupTable) put(client string, id uint64, expires quota.Time, d quota.Decision) {
	t.putAt(dedupSpot{}, client, id, 0, expires, &d)
}

// putAt remembers d, the decision of the request fingerprinted fp, for (client, id), which is
// not in the table. at is what find returned for them; a stale or zero spot costs only the
// lookups it would have saved.
func (t *dedupTable) putAt(at dedupSpot, client string, id, fp uint64, expires quota.Time, d *quota.Decision) {
	t.growIndex() // may swap the index: a spot found before is then stale (gen)
	var runs decisionRuns
	t.scratch, runs = appendDecisionRuns(t.scratch[:0], d)
	c := t.last()
	off := len(c.arena)
	c.arena = t.templates.appendStored(c.arena, t.scratch, runs)
	if at.gen != t.gen || !at.known {
		t.push(c, client, id, fp, expires, false, off)
		t.index.insert(t, t.next-1)
		return
	}
	t.clients[at.ci].refs++
	t.pushInterned(c, at.ci, id, fp, expires, false, off)
	t.index.insertAt(at.slot, at.hash, t.next-1)
}

// last returns the chunk the next record goes into.
func (t *dedupTable) last() *dedupChunkData {
	if n := len(t.chunks); n > 0 && len(t.chunks[n-1].recs) < dedupChunk {
		return t.chunks[n-1]
	}
	if n := len(t.chunks); n > 0 {
		// Size the next arena like the one just filled, so it rarely grows (growth by append
		// would leave up to half of it unused).
		t.arenaHint = len(t.chunks[n-1].arena)
	}
	c := t.spare
	if c == nil {
		c = &dedupChunkData{recs: make([]dedupRecord, 0, dedupChunk), arena: make([]byte, 0, t.arenaHint+t.arenaHint/32)}
	}
	t.spare = nil
	t.chunks = append(t.chunks, c)
	return c
}

// push appends the record whose decision was just written at c.arena[off:]; the caller
// indexes it.
func (t *dedupTable) push(c *dedupChunkData, client string, id, fp uint64, expires quota.Time, refunded bool, off int) {
	t.pushInterned(c, t.intern(client), id, fp, expires, refunded, off)
}

// pushInterned is push for a client already interned (and counted) as ci.
func (t *dedupTable) pushInterned(c *dedupChunkData, ci uint32, id, fp uint64, expires quota.Time, refunded bool, off int) {
	r := dedupRecord{id: id, expires: expires, fp: fp, client: ci, off: uint32(off)}
	if refunded {
		r.client |= refundedBit
	}
	c.recs = append(c.recs, r)
	t.next++
	t.gen++
}

func (t *dedupTable) intern(client string) uint32 {
	if ci, ok := t.clientIdx[client]; ok {
		t.clients[ci].refs++
		return ci
	}
	var ci uint32
	if n := len(t.freeIdx); n > 0 {
		ci = t.freeIdx[n-1]
		t.freeIdx = t.freeIdx[:n-1]
	} else {
		ci = uint32(len(t.clients))
		t.clients = append(t.clients, dedupClient{})
	}
	t.clients[ci] = dedupClient{id: client, refs: 1}
	t.clientIdx[client] = ci
	return ci
}

func (t *dedupTable) release(ci uint32) {
	c := &t.clients[ci]
	if c.refs--; c.refs == 0 {
		delete(t.clientIdx, c.id)
		*c = dedupClient{}
		t.freeIdx = append(t.freeIdx, ci)
	}
}

func (t *dedupTable) expire(now quota.Time) {
	for t.head < t.next {
		c, i := t.at(t.head)
		r := &c.recs[i]
		if r.expires > now {
			break
		}
		ci := r.client &^ refundedBit
		t.index.remove(t, ci, r.id)
		t.release(ci)
		t.templates.release(c.arena[r.off:])
		t.head++
		t.gen++
		if t.head-t.first == dedupChunk {
			if !t.caps.Shared(c.shared) { // else a capture may still read it
				*c = dedupChunkData{recs: c.recs[:0], arena: c.arena[:0]}
				t.spare = c
			}
			t.chunks[0] = nil
			t.chunks = t.chunks[1:]
			t.first += dedupChunk
		}
	}
}

// hashInto feeds the captured records to the state hash, oldest first, each as the snapshot
// writes it.
func (v *dedupCapture) hashInto(h hash.Hash64) {
	var buf []byte
	for ci := range v.chunks {
		c := &v.chunks[ci]
		for i := range c.recs {
			r := &c.recs[i]
			buf = appendRecordHead(buf[:0], v.clients[r.client&^refundedBit].id, r)
			buf = v.templates.appendExpanded(buf, c.decisionBytes(i))
			h.Write(buf)
		}
	}
}

// dedupFormat 2 added Decision.DebitSeq (refunds); format 3 the request fingerprint (8 bytes,
// little-endian, after the refunded flag). Format 2 sections are still read (their records
// have no fingerprint: fp 0). Format 1 came only from development builds before the first
// release; it is refused with a message rather than misread.
const (
	dedupFormat  = 3
	dedupFormat2 = 2
)

// dedupCapture is the table's records as of one instant, for a snapshot to encode while the
// table goes on changing: the chunks' headers (the arrays are shared: see dedupChunkData.shared)
// and copies of the client and template lists, whose entries are reused once unreferenced.
type dedupCapture struct {
	chunks    []dedupChunkData // the first starts at the oldest live record
	n         uint64
	head      uint64 // sequence number of the first record
	first     uint64 // of the first chunk's first slot
	clients   []dedupClient
	templates decisionTemplates
	gen       uint64
	caps      *cow.Captures
}

// view returns the records as they are now, sharing everything: valid only until the table
// changes (capture makes one that stays valid).
func (t *dedupTable) view() *dedupCapture {
	v := &dedupCapture{n: uint64(t.len()), head: t.head, first: t.first, clients: t.clients, templates: decisionTemplates{list: t.templates.list}}
	if t.head == t.next {
		return v
	}
	v.chunks = make([]dedupChunkData, 0, len(t.chunks))
	for i, c := range t.chunks {
		h := dedupChunkData{recs: c.recs, arena: c.arena}
		if i == 0 {
			h.recs = h.recs[t.head-t.first:]
		}
		v.chunks = append(v.chunks, h)
	}
	return v
}

// capture returns a view that stays valid while the table changes, until release: O(chunks +
// clients + templates), where encoding is O(records).
func (t *dedupTable) capture() *dedupCapture {
	v := t.view()
	v.clients = slices.Clone(t.clients)
	v.templates.list = slices.Clone(t.templates.list)
	v.gen, v.caps = t.caps.Take(), t.caps
	for _, c := range t.chunks {
		c.shared, c.ownRecs = v.gen, false
	}
	return v
}

// rec returns captured record seq, one of [head, head+n).
func (v *dedupCapture) rec(seq uint64) *dedupRecord {
	i := seq - v.first
	ci, ri := i/dedupChunk, i%dedupChunk
	if ci == 0 {
		ri -= v.head - v.first // the first chunk starts at head
	}
	return &v.chunks[ci].recs[ri]
}

// release says the capture will not be read again. Safe from any goroutine, more than once.
func (v *dedupCapture) release() {
	if v.caps != nil {
		v.caps.Release(v.gen)
	}
}

// sectionSize is the exact length of what appendTo appends: a snapshot allocates the section
// once at its final size instead of growing it by doubling (which touches up to three times
// its size in fresh memory).
func (t *dedupTable) sectionSize() int { return t.view().sectionSize() }

// appendTo appends the table's snapshot section.
func (t *dedupTable) appendTo(buf []byte) []byte { return t.view().appendTo(buf) }

func (v *dedupCapture) sectionSize() int {
	n := 1 + uvarintLen(v.n)
	for ci := range v.chunks {
		c := &v.chunks[ci]
		for i := range c.recs {
			r := &c.recs[i]
			n += recordHeadLen(v.clients[r.client&^refundedBit].id, r) + v.templates.expandedLen(c.decisionBytes(i))
		}
	}
	return n
}

func (v *dedupCapture) appendTo(buf []byte) []byte {
	buf = append(buf, dedupFormat)
	buf = binary.AppendUvarint(buf, v.n)
	for ci := range v.chunks {
		buf = v.appendChunk(buf, &v.chunks[ci])
	}
	return buf
}

func (v *dedupCapture) appendChunk(buf []byte, c *dedupChunkData) []byte {
	for i := range c.recs {
		r := &c.recs[i]
		buf = appendRecordHead(buf, v.clients[r.client&^refundedBit].id, r)
		buf = v.templates.appendExpanded(buf, c.decisionBytes(i))
	}
	return buf
}

// writeTo writes what appendTo would append to w, a chunk at a time through buf (reused), so
// a section of hundreds of megabytes never sits in memory whole.
func (v *dedupCapture) writeTo(w io.Writer, buf []byte) error {
	buf = append(buf[:0], dedupFormat)
	buf = binary.AppendUvarint(buf, v.n)
	for ci := range v.chunks {
		buf = v.appendChunk(buf, &v.chunks[ci])
		if len(buf) >= 256<<10 || ci == len(v.chunks)-1 {
			if _, err := w.Write(buf); err != nil {
				return err
			}
			buf = buf[:0]
		}
	}
	if len(v.chunks) == 0 {
		_, err := w.Write(buf)
		return err
	}
	return nil
}

// dedupReadPiece is how much of a dedup section a restore reads at a time.
const dedupReadPiece = 256 << 10

// readDedup decodes a dedup section of size bytes from r. It reads the section in pieces of
// about piece bytes (more only for a record that does not fit one) rather than whole: each
// decision is copied into the table's own arenas anyway, so a buffer of the whole section
// would be tens of megabytes of fresh memory for nothing. It reads no further than the last
// record; bytes after it in the section are the caller's to skip (they were always ignored).
func readDedup(r io.Reader, size uint64, piece int) (*dedupTable, error) {
	in := sectionReader{r: r, left: size, buf: make([]byte, 0, min(size, uint64(max(piece, 1))))}
	// Each part is decoded from the bytes read so far; one that runs out of them is decoded
	// again after in.more has read the next piece.
	var format byte
	for {
		d := in.decoder()
		format = d.byte()
		if in.done(&d) != errRetry {
			break // format is 0 if the section is empty or unreadable
		}
	}
	if format != dedupFormat && format != dedupFormat2 {
		return nil, fmt.Errorf("fsm: dedup table format %d unknown (this build reads %d and %d)", format, dedupFormat2, dedupFormat)
	}
	var n uint64
	for {
		d := in.decoder()
		n = d.uvarint()
		if err := in.done(&d); err != errRetry {
			if err != nil {
				return nil, err
			}
			break
		}
	}
	t := newDedupTable()
	var intern internTable
	for i := uint64(0); i < n; {
		d := in.decoder()
		client := d.bytes()
		id := d.uvarint()
		expires := quota.Time(d.varint())
		refunded := d.bool()
		var fp uint64
		if format == dedupFormat {
			fp = d.fixed64()
		}
		decision := d.buf
		runs := d.splitDecision()
		if err := in.done(&d); err == errRetry {
			continue
		} else if err != nil {
			return nil, err
		}
		c := t.last()
		off := len(c.arena)
		c.arena = t.templates.appendStored(c.arena, decision, runs)
		t.push(c, intern.get(client), id, fp, expires, refunded, off)
		i++
	}
	t.buildIndex()
	return t, nil
}

// sectionReader reads a section of a file in pieces into one buffer: buf[pos:] are the bytes
// read and not decoded yet, left the bytes of the section not read yet.
type sectionReader struct {
	r    io.Reader
	left uint64
	buf  []byte
	pos  int
}

// decoder returns a decoder of the bytes read and not decoded yet.
func (s *sectionReader) decoder() decoder { return decoder{buf: s.buf[s.pos:]} }

// errRetry: the part being decoded did not fit in the bytes read so far; more were read.
var errRetry = errors.New("read more")

// done ends decoding a part with d: it returns nil and consumes the part if d decoded it,
// errRetry if d ran out of bytes and more could be read, and otherwise the error.
func (s *sectionReader) done(d *decoder) error {
	if d.err == nil {
		s.pos = len(s.buf) - len(d.buf)
		return nil
	}
	if s.left == 0 {
		return fmt.Errorf("fsm: corrupt dedup table: %w", d.err)
	}
	if err := s.more(); err != nil {
		return err
	}
	return errRetry
}

// more reads the next piece after the bytes not decoded yet, moving them to the front of the
// buffer (and growing it if they fill it). The section must have bytes left.
func (s *sectionReader) more() error {
	n := copy(s.buf[:cap(s.buf)], s.buf[s.pos:])
	s.buf, s.pos = s.buf[:n], 0
	if n == cap(s.buf) { // a record longer than a piece
		s.buf = slices.Grow(s.buf, max(n, 64))
	}
	k := int(min(uint64(cap(s.buf)-n), s.left))
	got, err := io.ReadFull(s.r, s.buf[n:n+k])
	s.buf = s.buf[:n+got]
	s.left -= uint64(got)
	if err != nil {
		return fmt.Errorf("fsm: snapshot dedup section truncated: %w", err)
	}
	return nil
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

func appendBool(b []byte, v bool) []byte {
	if v {
		return append(b, 1)
	}
	return append(b, 0)
}

// appendRecordHead and appendDecision together write one record of the snapshot's dedup
// section (format 3); recordHeadLen is the length of what appendRecordHead appends.
func recordHeadLen(client string, r *dedupRecord) int {
	return uvarintLen(uint64(len(client))) + len(client) + uvarintLen(r.id) + varintLen(int64(r.expires)) + 1 + 8
}

func uvarintLen(v uint64) int { return (bits.Len64(v|1) + 6) / 7 }

func varintLen(v int64) int { return uvarintLen(uint64(v<<1) ^ uint64(v>>63)) }

func appendRecordHead(b []byte, client string, r *dedupRecord) []byte {
	b = appendString(b, client)
	b = binary.AppendUvarint(b, r.id)
	b = binary.AppendVarint(b, int64(r.expires))
	b = appendBool(b, r.client&refundedBit != 0)
	return binary.LittleEndian.AppendUint64(b, r.fp)
}

func appendDecision(b []byte, d *quota.Decision) []byte {
	b, _ = appendDecisionRuns(b, d)
	return b
}

// appendDecisionRuns is appendDecision, also returning the runs of what it appended (as
// splitDecision would find them).
func appendDecisionRuns(b []byte, d *quota.Decision) ([]byte, decisionRuns) {
	var r decisionRuns
	start := len(b)
	b = appendBool(b, d.Admitted)
	b = appendString(b, string(d.Reason))
	b = appendString(b, d.Scope)
	b = binary.AppendUvarint(b, d.Limit)
	r[0] = len(b) - start
	b = binary.AppendUvarint(b, d.Remaining)
	r[1] = len(b) - start
	b = binary.AppendVarint(b, int64(d.Window))
	r[2] = len(b) - start
	b = binary.AppendVarint(b, int64(d.ResetAfter))
	b = binary.AppendVarint(b, int64(d.RetryAfter))
	b = binary.AppendUvarint(b, d.LeaseID)
	r[3] = len(b) - start
	b = binary.AppendVarint(b, int64(d.LeaseTTL))
	b = appendString(b, d.Message)
	r[4] = len(b) - start
	b = binary.AppendUvarint(b, d.Cost)
	b = binary.AppendUvarint(b, uint64(len(d.Charges)))
	for _, c := range d.Charges {
		b = appendString(b, c)
	}
	b = binary.AppendUvarint(b, d.DebitSeq)
	r[5] = len(b) - start
	return b, r
}

var errShort = errors.New("truncated")

// decoder reads what the append* functions wrote; the first error sticks.
type decoder struct {
	buf []byte
	err error
}

func (d *decoder) byte() byte {
	if d.err != nil || len(d.buf) < 1 {
		d.fail()
		return 0
	}
	v := d.buf[0]
	d.buf = d.buf[1:]
	return v
}

func (d *decoder) fail() {
	if d.err == nil {
		d.err = errShort
	}
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.buf)
	if n <= 0 {
		d.fail()
		return 0
	}
	d.buf = d.buf[n:]
	return v
}

func (d *decoder) varint() int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.buf)
	if n <= 0 {
		d.fail()
		return 0
	}
	d.buf = d.buf[n:]
	return v
}

func (d *decoder) string() string {
	n := d.uvarint()
	if d.err != nil || uint64(len(d.buf)) < n {
		d.fail()
		return ""
	}
	s := string(d.buf[:n])
	d.buf = d.buf[n:]
	return s
}

func (d *decoder) bool() bool { return d.byte() == 1 }

func (d *decoder) fixed64() uint64 {
	if d.err != nil || len(d.buf) < 8 {
		d.fail()
		return 0
	}
	v := binary.LittleEndian.Uint64(d.buf)
	d.buf = d.buf[8:]
	return v
}

// bytes reads a length-prefixed string without copying it.
func (d *decoder) bytes() []byte {
	n := d.uvarint()
	if d.err != nil || uint64(len(d.buf)) < n {
		d.fail()
		return nil
	}
	b := d.buf[:n:n]
	d.buf = d.buf[n:]
	return b
}

// decision reads what appendDecision wrote.
func (d *decoder) decision() quota.Decision {
	var dc quota.Decision
	dc.Admitted = d.bool()
	dc.Reason = quota.Reason(d.string())
	dc.Scope = d.string()
	dc.Limit = d.uvarint()
	dc.Remaining = d.uvarint()
	dc.Window = time.Duration(d.varint())
	dc.ResetAfter = time.Duration(d.varint())
	dc.RetryAfter = time.Duration(d.varint())
	dc.LeaseID = d.uvarint()
	dc.LeaseTTL = time.Duration(d.varint())
	dc.Message = d.string()
	dc.Cost = d.uvarint()
	n := d.uvarint()
	if n > uint64(len(d.buf)) { // each charge takes at least one byte
		d.fail()
		return dc
	}
	for i := uint64(0); i < n; i++ {
		dc.Charges = append(dc.Charges, d.string())
	}
	dc.DebitSeq = d.uvarint()
	return dc
}

func putU64(b []byte, v uint64) { binary.LittleEndian.PutUint64(b, v) }
