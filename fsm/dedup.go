package fsm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"time"

	"github.com/quotad/quotad/quota"
)

// dedupKey identifies one admission: the client's namespace and its request ID.
type dedupKey struct {
	client string
	id     uint64
}

type dedupRecord struct {
	key      dedupKey
	decision quota.Decision
	expires  quota.Time
	refunded bool
}

// dedupTable remembers decisions by request ID until they expire in FSM time. Records are kept
// in a FIFO: FSM time never goes backwards and every record lives equally long, so insertion
// order is expiry order and expiring is a pop from the front — deterministic on every replica.
//
// At full load the table holds a whole DedupWindow of admissions (millions of records), so
// records are stored by value in fixed-size chunks addressed by sequence number rather than
// as one heap object each: a put allocates nothing (amortized), and expiring frees whole
// chunks, which are reused.
type dedupTable struct {
	byKey  map[dedupKey]uint64 // the record's sequence number
	chunks [][]dedupRecord     // chunks[0][0] has sequence number first
	spare  []dedupRecord       // an emptied chunk kept for the next put
	first  uint64
	head   uint64 // the oldest live record
	next   uint64 // the sequence number of the next put
}

const dedupChunk = 4096

func newDedupTable() *dedupTable {
	return &dedupTable{byKey: make(map[dedupKey]uint64)}
}

func (t *dedupTable) len() int { return int(t.next - t.head) }

func (t *dedupTable) at(seq uint64) *dedupRecord {
	i := seq - t.first
	return &t.chunks[i/dedupChunk][i%dedupChunk]
}

func (t *dedupTable) get(client string, id uint64) (*dedupRecord, bool) {
	seq, ok := t.byKey[dedupKey{client, id}]
	if !ok {
		return nil, false
	}
	return t.at(seq), true
}

func (t *dedupTable) put(client string, id uint64, expires quota.Time, d quota.Decision) {
	t.add(dedupRecord{key: dedupKey{client, id}, decision: d, expires: expires})
}

func (t *dedupTable) add(r dedupRecord) {
	if n := len(t.chunks); n == 0 || len(t.chunks[n-1]) == dedupChunk {
		c := t.spare
		if c == nil {
			c = make([]dedupRecord, 0, dedupChunk)
		}
		t.spare = nil
		t.chunks = append(t.chunks, c)
	}
	last := &t.chunks[len(t.chunks)-1]
	*last = append(*last, r)
	t.byKey[r.key] = t.next
	t.next++
}

func (t *dedupTable) expire(now quota.Time) {
	for t.head < t.next {
		r := t.at(t.head)
		if r.expires > now {
			break
		}
		delete(t.byKey, r.key)
		*r = dedupRecord{}
		t.head++
		if t.head-t.first == dedupChunk {
			t.spare = t.chunks[0][:0]
			t.chunks[0] = nil
			t.chunks = t.chunks[1:]
			t.first += dedupChunk
		}
	}
}

// each calls fn for every live record, oldest first.
func (t *dedupTable) each(fn func(r *dedupRecord)) {
	for seq := t.head; seq < t.next; seq++ {
		fn(t.at(seq))
	}
}

func (t *dedupTable) hashInto(h hash.Hash64) {
	var buf []byte
	t.each(func(r *dedupRecord) {
		buf = appendRecord(buf[:0], r)
		h.Write(buf)
	})
}

const dedupFormat = 1

func (t *dedupTable) marshal() []byte {
	buf := []byte{dedupFormat}
	buf = binary.AppendUvarint(buf, uint64(t.len()))
	t.each(func(r *dedupRecord) { buf = appendRecord(buf, r) })
	return buf
}

func unmarshalDedup(data []byte) (*dedupTable, error) {
	t := newDedupTable()
	d := decoder{buf: data}
	if f := d.byte(); f != dedupFormat {
		return nil, fmt.Errorf("fsm: dedup table format %d unknown (this build reads %d)", f, dedupFormat)
	}
	n := d.uvarint()
	for i := uint64(0); i < n && d.err == nil; i++ {
		r := d.record()
		if d.err == nil {
			t.add(r)
		}
	}
	if d.err != nil {
		return nil, fmt.Errorf("fsm: corrupt dedup table: %w", d.err)
	}
	return t, nil
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

func appendRecord(b []byte, r *dedupRecord) []byte {
	b = appendString(b, r.key.client)
	b = binary.AppendUvarint(b, r.key.id)
	b = binary.AppendVarint(b, int64(r.expires))
	b = appendBool(b, r.refunded)
	d := &r.decision
	b = appendBool(b, d.Admitted)
	b = appendString(b, string(d.Reason))
	b = appendString(b, d.Scope)
	b = binary.AppendUvarint(b, d.Limit)
	b = binary.AppendUvarint(b, d.Remaining)
	b = binary.AppendVarint(b, int64(d.Window))
	b = binary.AppendVarint(b, int64(d.ResetAfter))
	b = binary.AppendVarint(b, int64(d.RetryAfter))
	b = binary.AppendUvarint(b, d.LeaseID)
	b = binary.AppendVarint(b, int64(d.LeaseTTL))
	b = appendString(b, d.Message)
	b = binary.AppendUvarint(b, d.Cost)
	b = binary.AppendUvarint(b, uint64(len(d.Charges)))
	for _, c := range d.Charges {
		b = appendString(b, c)
	}
	return b
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

func (d *decoder) record() dedupRecord {
	var r dedupRecord
	r.key.client = d.string()
	r.key.id = d.uvarint()
	r.expires = quota.Time(d.varint())
	r.refunded = d.bool()
	dc := &r.decision
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
		return r
	}
	for i := uint64(0); i < n; i++ {
		dc.Charges = append(dc.Charges, d.string())
	}
	return r
}

func putU64(b []byte, v uint64) { binary.LittleEndian.PutUint64(b, v) }
