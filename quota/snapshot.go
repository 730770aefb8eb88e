package quota

import (
	"cmp"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/quotad/quotad/internal/cow"
)

// snapshotFormat is the leading byte of MarshalBinary's output. Bump it on any layout change and
// keep decoding the old layouts. Format 2 appends adaptive rates and retry budgets; a state
// without either is still written as format 1, so older nodes can read it.
const (
	snapshotFormat  byte = 2
	snapshotFormat1 byte = 1
	// snapshotFormat3 is format 2 followed by the refund section: the debit counter and each
	// bucket's last debit (in bucket order). Written once anything was debited.
	snapshotFormat3 byte = 3
	// snapshotFormat4 is format 3 followed by the lease owners: a count, then (lease ID,
	// owner) for every live lease that has an owner, by ID. Written once a lease has one.
	snapshotFormat4 byte = 4
	// snapshotFormat5 is format 4 (its owners section possibly empty) followed by the share
	// section (shares_snapshot.go). Written once a share holder exists.
	snapshotFormat5 byte = 5
)

// hashFormat versions the Hash layout. New state is folded in only when present, so the hash of
// a state without it is unchanged across this build and the previous one.
const hashFormat = 1

// The state hash. Fixed constants, no per-process seed (unlike hash/maphash), so every replica
// and every build computes the same value.
const (
	hashSeed   = 0x9e3779b97f4a7c15
	hashPrime1 = 0xbf58476d1ce4e5b9
	hashPrime2 = 0x94d049bb133111eb
)

// mix is the splitmix64 finalizer: a bijection that spreads every input bit over the output.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= hashPrime1
	x ^= x >> 27
	x *= hashPrime2
	x ^= x >> 31
	return x
}

// hashState folds values into a running 64-bit hash.
type hashState uint64

func (h hashState) u64(v uint64) hashState { return hashState(mix(uint64(h) ^ v + hashSeed)) }

// str folds s eight bytes at a time, length first so ("ab","c") and ("a","bc") differ.
func (h hashState) str(s string) hashState { return hashStr(h, s) }

// bytes is str for bytes.
func (h hashState) bytes(b []byte) hashState { return hashStr(h, b) }

func hashStr[S ~string | ~[]byte](h hashState, s S) hashState {
	h = h.u64(uint64(len(s)))
	for len(s) >= 8 {
		h = h.u64(uint64(s[0]) | uint64(s[1])<<8 | uint64(s[2])<<16 | uint64(s[3])<<24 |
			uint64(s[4])<<32 | uint64(s[5])<<40 | uint64(s[6])<<48 | uint64(s[7])<<56)
		s = s[8:]
	}
	var tail uint64
	for i := len(s) - 1; i >= 0; i-- {
		tail = tail<<8 | uint64(s[i])
	}
	return h.u64(tail)
}

// Hash is a deterministic 64-bit digest of the whole replicated state: clock, limits (version and
// content), lease counter, stored buckets, leases and pauses. Replicas that applied the same
// commands have equal hashes; MarshalBinary/UnmarshalBinary preserve it.
//
// Collections are combined as a sum of per-element hashes, which does not depend on the order
// of map iteration and needs no sort (Hash stays O(n) with a million buckets). It is a
// divergence detector, not a cryptographic digest.
func (e *Engine) Hash() uint64 {
	var bucketSum, leaseSum, pauseSum uint64
	st := &e.buckets
	st.eachLive(func(s uint32, b *bucketRec) {
		bucketSum += uint64(hashState(hashSeed).bytes(st.key(s)).u64(b.tokens.get()).u64(b.last.get()).u64(b.debit.get()))
	})
	for id, l := range e.leases {
		h := hashState(hashSeed).u64(id).u64(uint64(l.expiry)).u64(uint64(l.ttl)).u64(uint64(len(l.keys)))
		for _, k := range l.keys {
			h = h.str(k)
		}
		if l.owner != "" { // folded in only when present: unowned leases hash as before
			h = h.str(l.owner)
		}
		leaseSum += uint64(h)
	}
	for k, until := range e.pauses {
		pauseSum += uint64(hashState(hashSeed).str(k).u64(uint64(until)))
	}
	h := hashState(hashSeed).u64(hashFormat).
		u64(uint64(e.clock)).
		u64(e.lim.limits.Version).
		u64(e.lim.digest).
		u64(e.leaseSeq).
		u64(e.debitSeq).
		u64(uint64(st.live)).u64(bucketSum).
		u64(uint64(len(e.leases))).u64(leaseSum).
		u64(uint64(len(e.pauses))).u64(pauseSum)
	if len(e.adapt) > 0 || len(e.retries) > 0 {
		var adaptSum, retrySum uint64
		for k, a := range e.adapt {
			adaptSum += uint64(hashState(hashSeed).str(k).u64(uint64(a.lvl.idx)).u64(a.base).
				u64(uint64(a.since)).u64(uint64(a.lastDecrease)))
		}
		for d, st := range e.retries {
			retrySum += uint64(hashState(hashSeed).str(d).u64(st.tokens).u64(uint64(st.last)))
		}
		h = h.u64(uint64(len(e.adapt))).u64(adaptSum).u64(uint64(len(e.retries))).u64(retrySum)
	}
	if len(e.sh.holders) > 0 || len(e.sh.lends) > 0 {
		h = e.hashShares(h) // folded in only when present: states without shares hash as before
	}
	return uint64(h)
}

// MarshalBinary encodes the whole state: a format byte, the limits as JSON, the clock, the lease
// counter, then buckets (sorted by key, keys prefix-compressed), leases (sorted by ID) and pauses
// (sorted by key), all as varints. The output is a function of the state alone.
// With a million buckets it takes about half a second, mostly sorting keys.
func (e *Engine) MarshalBinary() ([]byte, error) { return e.AppendBinary(nil) }

// AppendBinary appends what MarshalBinary returns to buf (encoding.BinaryAppender), so a caller
// that frames the state (the FSM's snapshot) can write it in place without another copy.
func (e *Engine) AppendBinary(buf []byte) ([]byte, error) {
	c, err := e.capture()
	if err != nil {
		return nil, err
	}
	return c.AppendBinary(buf), nil
}

// A Capture is the engine's state as of one instant, to be encoded later (AppendBinary)
// while the engine goes on changing: the FSM captures on its apply goroutine and encodes on
// the snapshot goroutine, so a snapshot of a million buckets stalls applies for a capture,
// not for the half second the encoding takes.
//
// Capturing copies the small parts of the state (limits, leases, pauses, adaptive rates, retry
// budgets: encoded at once) and shares the buckets: the chunks' record arrays copy-on-write,
// their key arenas as they are (append-only). It costs O(chunks) plus the small parts. Until
// Release, the first change to a chunk's records after the capture copies that chunk (~147 KB).
type Capture struct {
	st       bucketStore // chunks only: headers copied, arrays shared
	head     []byte      // format byte, limits, clock, lease counter
	tail     []byte      // leases, pauses; then adaptive rates and retry budgets (format 2, 3)
	owners   []byte      // lease owners (format 4)
	shares   []byte      // share holders and lends (format 5)
	format   byte
	debitSeq uint64
	clock    Time
	gen      uint64
	caps     *cow.Captures
}

// Capture captures the state for a later AppendBinary. It is a command in the sense that the
// engine's next changes pay for it (copying chunks): call Release once the capture is encoded.
// Like every command it must not run concurrently with other methods.
func (e *Engine) Capture() (*Capture, error) {
	c, err := e.capture()
	if err != nil {
		return nil, err
	}
	st := &e.buckets
	if st.caps == nil {
		st.caps = new(cow.Captures)
	}
	c.gen, c.caps = st.caps.Take(), st.caps
	for i := range st.chunks {
		st.chunks[i].shared = c.gen
	}
	return c, nil
}

// Release says the capture will not be read again, so the engine may change the records it
// shares in place. It is safe to call from any goroutine, and more than once.
func (c *Capture) Release() {
	if c.caps != nil {
		c.caps.Release(c.gen)
	}
}

// capture builds a Capture without marking the chunks shared: it is only safe to encode
// before the engine changes (AppendBinary), unless Capture marks them.
func (e *Engine) capture() (*Capture, error) {
	js, err := json.Marshal(e.lim.limits)
	if err != nil {
		return nil, fmt.Errorf("quota: marshal limits: %w", err)
	}
	c := &Capture{st: bucketStore{chunks: slices.Clone(e.buckets.chunks), live: e.buckets.live},
		debitSeq: e.debitSeq, clock: e.clock}
	c.format = snapshotFormat1
	if len(e.adapt) > 0 || len(e.retries) > 0 {
		c.format = snapshotFormat
	}
	if e.debitSeq > 0 {
		c.format = snapshotFormat3
	}
	if owners := e.appendOwners(nil); owners != nil {
		c.format, c.owners = snapshotFormat4, owners
	}
	if len(e.sh.holders) > 0 || len(e.sh.lends) > 0 {
		c.format, c.shares = snapshotFormat5, e.appendShares(nil)
		if c.owners == nil {
			c.owners = binary.AppendUvarint(nil, 0)
		}
	}
	buf := make([]byte, 0, 32+len(js))
	buf = append(buf, c.format)
	buf = binary.AppendUvarint(buf, uint64(len(js)))
	buf = append(buf, js...)
	buf = binary.AppendVarint(buf, int64(e.clock))
	c.head = binary.AppendUvarint(buf, e.leaseSeq)
	c.tail = e.appendTail(nil, c.format)
	return c, nil
}

// appendOwners appends the owners section of format 4, or returns buf unchanged (nil if it
// was) when no lease has an owner.
func (e *Engine) appendOwners(buf []byte) []byte {
	var ids []uint64
	for id, l := range e.leases {
		if l.owner != "" {
			ids = append(ids, id)
		}
	}
	if len(ids) == 0 {
		return buf
	}
	slices.Sort(ids)
	buf = binary.AppendUvarint(buf, uint64(len(ids)))
	for _, id := range ids {
		buf = binary.AppendUvarint(buf, id)
		buf = appendString(buf, e.leases[id].owner)
	}
	return buf
}

// appendTail appends the parts of the state after the buckets: leases and pauses, and for
// format 2 and 3 adaptive rates and retry budgets.
func (e *Engine) appendTail(buf []byte, format byte) []byte {
	ids := make([]uint64, 0, len(e.leases))
	for id := range e.leases {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	buf = binary.AppendUvarint(buf, uint64(len(ids)))
	for _, id := range ids {
		l := e.leases[id]
		buf = binary.AppendUvarint(buf, id)
		buf = binary.AppendVarint(buf, int64(l.expiry))
		buf = binary.AppendVarint(buf, int64(l.ttl))
		buf = binary.AppendUvarint(buf, uint64(len(l.keys)))
		for _, k := range l.keys {
			buf = appendString(buf, k)
		}
	}

	pk := make([]string, 0, len(e.pauses))
	for k := range e.pauses {
		pk = append(pk, k)
	}
	slices.Sort(pk)
	buf = binary.AppendUvarint(buf, uint64(len(pk)))
	for _, k := range pk {
		buf = appendString(buf, k)
		buf = binary.AppendVarint(buf, int64(e.pauses[k]))
	}
	if format == snapshotFormat1 {
		return buf
	}

	ak := make([]string, 0, len(e.adapt))
	for k := range e.adapt {
		ak = append(ak, k)
	}
	slices.Sort(ak)
	buf = binary.AppendUvarint(buf, uint64(len(ak)))
	for _, k := range ak {
		a := e.adapt[k]
		buf = appendString(buf, k)
		buf = binary.AppendUvarint(buf, uint64(a.lvl.idx))
		buf = binary.AppendUvarint(buf, a.base)
		buf = binary.AppendVarint(buf, int64(a.since))
		buf = binary.AppendVarint(buf, int64(a.lastDecrease))
	}
	rk := make([]string, 0, len(e.retries))
	for d := range e.retries {
		rk = append(rk, d)
	}
	slices.Sort(rk)
	buf = binary.AppendUvarint(buf, uint64(len(rk)))
	for _, d := range rk {
		st := e.retries[d]
		buf = appendString(buf, d)
		buf = binary.AppendUvarint(buf, st.tokens)
		buf = binary.AppendVarint(buf, int64(st.last))
	}
	return buf
}

// AppendBinary appends the captured state as Engine.MarshalBinary would have returned it at
// the capture. It only reads what the capture holds, so it may run concurrently with the
// engine's commands (not with another AppendBinary of the same capture).
func (c *Capture) AppendBinary(buf []byte) []byte {
	st := &c.st
	bs := st.sortedBuckets()

	// About 24 bytes a bucket with prefix-compressed keys; more if keys differ early.
	buf = slices.Grow(buf, len(c.head)+len(c.tail)+len(bs)*24)
	buf = append(buf, c.head...)
	buf = binary.AppendUvarint(buf, uint64(len(bs)))
	var prev []byte
	for _, x := range bs {
		key := arenaKey(st.chunks[x.slot>>chunkShift].arena, x.off)
		b := st.peek(x.slot)
		shared := commonPrefix(prev, key)
		buf = binary.AppendUvarint(buf, uint64(shared))
		buf = binary.AppendUvarint(buf, uint64(len(key)-shared))
		buf = append(buf, key[shared:]...)
		buf = binary.AppendUvarint(buf, uint64(b.lvl))
		buf = binary.AppendUvarint(buf, b.tokens.get())
		buf = binary.AppendUvarint(buf, uint64(c.clock-Time(b.last.get()))) // negative (wrapped) if last > clock
		prev = key
	}
	buf = append(buf, c.tail...)
	if c.format >= snapshotFormat3 {
		buf = binary.AppendUvarint(buf, c.debitSeq)
		for _, x := range bs {
			buf = binary.AppendUvarint(buf, st.peek(x.slot).debit.get())
		}
	}
	buf = append(buf, c.owners...)
	return append(buf, c.shares...)
}

func appendString(buf []byte, s string) []byte {
	buf = binary.AppendUvarint(buf, uint64(len(s)))
	return append(buf, s...)
}

// sortedKey names a stored bucket for sorting by key. pfx holds 7 key bytes from the current
// depth (big-endian, zero-padded) and then how many bytes of the key are left there, at most
// 8 (meaning more follow): comparing pfx compares the keys by those bytes, a key that ends
// first sorts first.
type sortedKey struct {
	pfx  uint64
	slot uint32
	off  uint32 // of the key in its chunk's arena
}

// sortedBuckets returns the stored buckets sorted by key. Keys share long prefixes (domain,
// descriptor keys), so it sorts by integers holding 7 key bytes at a time, going deeper only
// within runs that tie: few comparisons ever read the keys.
func (st *bucketStore) sortedBuckets() []sortedKey {
	bs := make([]sortedKey, 0, st.live)
	st.eachLive(func(s uint32, b *bucketRec) { bs = append(bs, sortedKey{slot: s, off: b.key}) })
	st.sortKeys(bs, 0)
	return bs
}

func (st *bucketStore) sortKeys(bs []sortedKey, depth int) {
	for len(bs) > 1 {
		same := true
		for i := range bs {
			bs[i].pfx = keyPrefix(arenaKey(st.chunks[bs[i].slot>>chunkShift].arena, bs[i].off), depth)
			same = same && bs[i].pfx == bs[0].pfx
		}
		if !same || bs[0].pfx&0xff < 8 { // all ending here would be equal keys: never stored
			break
		}
		depth += 7 // all share these bytes and continue
	}
	if len(bs) <= 1 {
		return
	}
	slices.SortFunc(bs, func(x, y sortedKey) int { return cmp.Compare(x.pfx, y.pfx) })
	for i := 0; i < len(bs); {
		j := i + 1
		for j < len(bs) && bs[j].pfx == bs[i].pfx {
			j++
		}
		if j-i > 1 && bs[i].pfx&0xff == 8 {
			st.sortKeys(bs[i:j], depth+7)
		}
		i = j
	}
}

func keyPrefix(k []byte, depth int) uint64 {
	var p uint64
	for i := 0; i < 7 && depth+i < len(k); i++ {
		p |= uint64(k[depth+i]) << (56 - 8*i)
	}
	return p | uint64(min(len(k)-depth, 8))
}

func commonPrefix(a, b []byte) int {
	n := min(len(a), len(b))
	for i := 0; i < n; i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// UnmarshalBinary replaces the whole state with one encoded by MarshalBinary. On error (wrapping
// ErrBadSnapshot) the engine is unchanged.
func (e *Engine) UnmarshalBinary(data []byte) error {
	n, err := decodeSnapshot(data)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrBadSnapshot, err)
	}
	*e = *n
	return nil
}

type decoder struct {
	data []byte
	off  int
	err  error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("at byte %d: %s", d.off, fmt.Sprintf(format, args...))
	}
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.data[d.off:])
	if n <= 0 {
		d.fail("bad uvarint")
		return 0
	}
	d.off += n
	return v
}

func (d *decoder) varint() int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.data[d.off:])
	if n <= 0 {
		d.fail("bad varint")
		return 0
	}
	d.off += n
	return v
}

func (d *decoder) bytes(n uint64) []byte {
	if d.err != nil {
		return nil
	}
	if n > uint64(len(d.data)-d.off) {
		d.fail("length %d runs past the end", n)
		return nil
	}
	b := d.data[d.off : d.off+int(n)]
	d.off += int(n)
	return b
}

// count reads a collection length and bounds it by the bytes left (each element takes at least
// minBytes), so corrupt input cannot make us allocate without limit.
func (d *decoder) count(minBytes int) int {
	n := d.uvarint()
	if d.err == nil && n > uint64((len(d.data)-d.off)/minBytes) {
		d.fail("count %d exceeds the remaining input", n)
		return 0
	}
	return int(n)
}

func decodeSnapshot(data []byte) (*Engine, error) {
	if len(data) == 0 {
		return nil, fmt.Errorf("empty input")
	}
	format := data[0]
	if format < snapshotFormat1 || format > snapshotFormat5 {
		return nil, fmt.Errorf("unknown format %d (this build reads formats 1 to 5); upgrade this node", format)
	}
	d := &decoder{data: data, off: 1}
	js := d.bytes(d.uvarint())
	if d.err != nil {
		return nil, d.err
	}
	var l Limits
	if err := json.Unmarshal(js, &l); err != nil {
		return nil, fmt.Errorf("limits: %v", err)
	}
	lim, err := compileLimits(&l, l.Version)
	if err != nil {
		return nil, fmt.Errorf("limits: %v", err)
	}
	e := NewEngine()
	e.lim = lim
	e.buckets.setDomains(lim)
	e.clock = Time(d.varint())
	e.leaseSeq = d.uvarint()

	nb := d.count(5)
	st := &e.buckets
	st.reserve(nb)
	var key []byte
	for i := 0; i < nb && d.err == nil; i++ {
		shared := d.uvarint()
		suffix := d.bytes(d.uvarint())
		if shared > uint64(len(key)) {
			d.fail("bucket #%d: shared prefix %d longer than the previous key", i, shared)
			break
		}
		// MarshalBinary writes keys in strictly ascending order with the longest shared
		// prefix, so the next key differs at byte `shared` and is greater there: checking
		// that catches duplicates without a look-up.
		if i > 0 && (len(suffix) == 0 || (shared < uint64(len(key)) && suffix[0] <= key[shared])) {
			d.fail("bucket #%d: key not in ascending order (duplicated or out of order)", i)
			break
		}
		key = append(key[:shared], suffix...)
		idx := d.uvarint()
		tokens := d.uvarint()
		age := d.uvarint()
		if d.err != nil {
			break
		}
		var rate *rateParams
		if idx < uint64(len(lim.levels)) {
			rate = lim.levels[idx].rate
			if lim.levels[idx].override {
				rate, _ = overrideKeyRate(key)
			}
		}
		if rate == nil {
			d.fail("bucket %q: level %d has no rate", key, idx)
			break
		}
		lv := lim.levels[idx]
		// last = clock-age must not wrap. A negative age (two's complement) is a bucket whose
		// refill runs ahead of the clock after a scheduled grant (Request.ScheduleWithin).
		if ahead := -int64(age); tokens > rate.capMicro || (int64(age) >= 0 && age > uint64(e.clock)+1<<63) ||
			(int64(age) < 0 && (ahead <= 0 || ahead > math.MaxInt64-int64(e.clock))) {
			d.fail("bucket %q: balance %d or age %d out of range", key, tokens, int64(age))
			break
		}
		// Buckets take slots 0, 1, 2, ... in snapshot order (format 3's debits rely on it).
		b := st.rec(st.add(key, st.hash(key), lv.idx))
		b.tokens.set(tokens)
		b.last.set(uint64(e.clock - Time(age)))
	}

	nl := d.count(4)
	for i := 0; i < nl && d.err == nil; i++ {
		l := &lease{id: d.uvarint(), expiry: Time(d.varint()), ttl: time.Duration(d.varint())}
		nk := d.count(1)
		l.keys = make([]string, 0, nk)
		for j := 0; j < nk && d.err == nil; j++ {
			l.keys = append(l.keys, string(d.bytes(d.uvarint())))
		}
		if d.err != nil {
			break
		}
		if _, dup := e.leases[l.id]; dup || l.id == 0 || l.id > e.leaseSeq {
			d.fail("lease %d duplicated or beyond the lease counter %d", l.id, e.leaseSeq)
			break
		}
		e.addLease(l)
	}

	np := d.count(2)
	for i := 0; i < np && d.err == nil; i++ {
		k := string(d.bytes(d.uvarint()))
		e.pauses[k] = Time(d.varint())
	}
	if format >= snapshotFormat {
		decodePolicy(d, e, lim)
	}
	if format >= snapshotFormat3 {
		e.debitSeq = d.uvarint()
		for s := uint32(0); s < uint32(st.live) && d.err == nil; s++ {
			debit := d.uvarint()
			if debit > e.debitSeq {
				d.fail("bucket %q: debit %d beyond the debit counter %d", st.key(s), debit, e.debitSeq)
				break
			}
			st.rec(s).debit.set(debit)
		}
	}
	if format >= snapshotFormat4 {
		no := d.count(2)
		for i := 0; i < no && d.err == nil; i++ {
			id := d.uvarint()
			owner := string(d.bytes(d.uvarint()))
			l := e.leases[id]
			if d.err == nil && (l == nil || l.owner != "" || owner == "") {
				d.fail("lease owner #%d: lease %d unknown, owned twice, or owner empty", i, id)
			}
			if d.err == nil {
				l.owner = owner
			}
		}
	}
	if format >= snapshotFormat5 {
		decodeShares(d, e)
	}
	if d.err == nil && d.off != len(data) {
		d.fail("%d trailing bytes", len(data)-d.off)
	}
	if d.err != nil {
		return nil, d.err
	}
	e.rebuildFullAt()
	if format >= snapshotFormat5 {
		e.rebuildLends()
	}
	return e, nil
}

// decodePolicy reads format 2's adaptive rates and retry budgets.
func decodePolicy(d *decoder, e *Engine, lim *compiled) {
	na := d.count(4)
	for i := 0; i < na && d.err == nil; i++ {
		k := string(d.bytes(d.uvarint()))
		idx := d.uvarint()
		a := &adaptState{base: d.uvarint(), since: Time(d.varint()), lastDecrease: Time(d.varint())}
		if d.err != nil {
			return
		}
		if idx >= uint64(len(lim.levels)) || lim.levels[idx].adaptive == nil || lim.matchKey(k) != lim.levels[idx] {
			d.fail("adaptive %q: level %d is not its adaptive level", k, idx)
			return
		}
		a.lvl = lim.levels[idx]
		if p := a.lvl.adaptive; a.base < p.floor || a.base > p.ceil {
			d.fail("adaptive %q: rate %d outside [%d, %d]", k, a.base, p.floor, p.ceil)
			return
		}
		if _, dup := e.adapt[k]; dup {
			d.fail("adaptive %q appears twice", k)
			return
		}
		e.adapt[k] = a
	}
	nr := d.count(3)
	for i := 0; i < nr && d.err == nil; i++ {
		dom := string(d.bytes(d.uvarint()))
		st := &retryState{tokens: d.uvarint(), last: Time(d.varint())}
		if d.err != nil {
			return
		}
		root := lim.domains[dom]
		if root == nil || root.retry == nil || st.tokens > root.retry.capMicro {
			d.fail("retry budget %q: no such budget, or balance %d above its capacity", dom, st.tokens)
			return
		}
		if _, dup := e.retries[dom]; dup {
			d.fail("retry budget %q appears twice", dom)
			return
		}
		e.retries[dom] = st
	}
}
