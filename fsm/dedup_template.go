package fsm

import "encoding/binary"

// A remembered decision is stored in two parts. Most of its bytes repeat across the records
// of one level under one set of limits: Admitted, Reason, Scope, Limit, Window, LeaseTTL and
// Message. The rest vary: Remaining, ResetAfter, RetryAfter, LeaseID, Cost, Charges and
// DebitSeq. A chunk's arena keeps, for each record, the index of an interned template that
// holds the repeating fields, then the varying fields. Both parts are byte runs of the
// snapshot's layout (appendDecision), so expanding a record is interleaving them again: the
// result is exactly the bytes appendDecision wrote, or, for a restored record, the bytes the
// snapshot held. For an admission charging one bucket that is 39 bytes instead of 58.
//
// In the snapshot's layout (R repeats, V varies):
//
//	Admitted R | Reason R | Scope R | Limit R | Remaining V | Window R | ResetAfter V |
//	RetryAfter V | LeaseID V | LeaseTTL R | Message R | Cost V | Charges V | DebitSeq V
//
// so a template is three runs of bytes, and so is a record's varying part: Remaining; then
// ResetAfter, RetryAfter and LeaseID; then the rest.

// decisionTemplate is the repeating fields of some decisions: fixed[:cut1] goes before
// Remaining, fixed[cut1:cut2] before ResetAfter, fixed[cut2:] after LeaseID. refs counts the
// live records that use it; it is forgotten (and its index reused) when that reaches 0.
type decisionTemplate struct {
	fixed      string
	cut1, cut2 uint32
	refs       uint32
}

// decisionTemplates interns templates. Indexes are not replicated state: they depend on
// nothing but this replica's history of puts, and never reach a snapshot or the state hash.
type decisionTemplates struct {
	list []decisionTemplate
	idx  map[string]uint32
	free []uint32
	last uint32 // the template of the last put: consecutive puts usually share one
	key  []byte // scratch for the repeating fields of the decision being stored
}

// decisionRuns are the ends of the six runs of a decision in the snapshot's layout:
// dec[:r[0]] repeats, dec[r[0]:r[1]] varies, dec[r[1]:r[2]] repeats, dec[r[2]:r[3]] varies,
// dec[r[3]:r[4]] repeats, dec[r[4]:r[5]] varies; r[5] is the decision's length.
type decisionRuns [6]int

// splitDecision reads one decision as appendDecision writes it (checking it as skipDecision
// did) and returns its runs.
func (d *decoder) splitDecision() (r decisionRuns) {
	n := len(d.buf)
	d.bool()
	d.bytes() // Reason
	d.bytes() // Scope
	d.uvarint()
	r[0] = n - len(d.buf)
	d.uvarint() // Remaining
	r[1] = n - len(d.buf)
	d.varint() // Window
	r[2] = n - len(d.buf)
	d.varint() // ResetAfter
	d.varint() // RetryAfter
	d.uvarint()
	r[3] = n - len(d.buf)
	d.varint() // LeaseTTL
	d.bytes()  // Message
	r[4] = n - len(d.buf)
	d.uvarint() // Cost
	charges := d.uvarint()
	if charges > uint64(len(d.buf)) { // each charge takes at least one byte
		d.fail()
		return r
	}
	for i := uint64(0); i < charges && d.err == nil; i++ {
		d.bytes()
	}
	d.uvarint() // DebitSeq
	r[5] = n - len(d.buf)
	return r
}

// appendStored appends to arena the stored form of dec, a decision in the snapshot's layout
// with runs r, and takes a reference to its template.
func (ts *decisionTemplates) appendStored(arena, dec []byte, r decisionRuns) []byte {
	ts.key = append(append(append(ts.key[:0], dec[:r[0]]...), dec[r[1]:r[2]]...), dec[r[3]:r[4]]...)
	i := ts.intern(ts.key, r[0], r[0]+r[2]-r[1])
	arena = binary.AppendUvarint(arena, uint64(i))
	arena = append(arena, dec[r[0]:r[1]]...)
	arena = append(arena, dec[r[2]:r[3]]...)
	return append(arena, dec[r[4]:r[5]]...)
}

func (ts *decisionTemplates) intern(fixed []byte, cut1, cut2 int) uint32 {
	if i := ts.last; int(i) < len(ts.list) && ts.list[i].refs > 0 && ts.list[i].fixed == string(fixed) {
		ts.list[i].refs++
		return i
	}
	i, ok := ts.idx[string(fixed)]
	if !ok {
		if n := len(ts.free); n > 0 {
			i, ts.free = ts.free[n-1], ts.free[:n-1]
		} else {
			i = uint32(len(ts.list))
			ts.list = append(ts.list, decisionTemplate{})
		}
		s := string(fixed)
		ts.list[i] = decisionTemplate{fixed: s, cut1: uint32(cut1), cut2: uint32(cut2)}
		if ts.idx == nil {
			ts.idx = make(map[string]uint32)
		}
		ts.idx[s] = i
	}
	ts.list[i].refs++
	ts.last = i
	return i
}

// release drops the reference of the record stored at stored[0:].
func (ts *decisionTemplates) release(stored []byte) {
	i, _ := binary.Uvarint(stored)
	tp := &ts.list[i]
	if tp.refs--; tp.refs == 0 {
		delete(ts.idx, tp.fixed)
		*tp = decisionTemplate{}
		ts.free = append(ts.free, uint32(i))
	}
}

// appendExpanded appends the decision stored as stored, in the snapshot's layout.
func (ts *decisionTemplates) appendExpanded(b, stored []byte) []byte {
	i, n := binary.Uvarint(stored)
	tp := &ts.list[i]
	v := stored[n:]
	v1 := varintEnd(v, 0)
	v2 := varintEnd(v, varintEnd(v, varintEnd(v, v1)))
	b = append(b, tp.fixed[:tp.cut1]...)
	b = append(b, v[:v1]...)
	b = append(b, tp.fixed[tp.cut1:tp.cut2]...)
	b = append(b, v[v1:v2]...)
	b = append(b, tp.fixed[tp.cut2:]...)
	return append(b, v[v2:]...)
}

// expandedLen is the length of what appendExpanded appends.
func (ts *decisionTemplates) expandedLen(stored []byte) int {
	i, n := binary.Uvarint(stored)
	return len(stored) - n + len(ts.list[i].fixed)
}

// varintEnd returns the end of the varint at b[i:], one that was checked when stored.
func varintEnd(b []byte, i int) int {
	for b[i] >= 0x80 {
		i++
	}
	return i + 1
}
