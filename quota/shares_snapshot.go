package quota

import (
	"encoding/binary"
	"slices"
	"time"
)

// sharesFormat versions the share section of snapshots (format 5) and its part of Hash.
const sharesFormat = 1

// appendShares appends the share section: a version, the holders sorted by key (with their
// paths and grants), then the lendable buckets' central-demand state sorted by key. Charged
// sums, holder counts per owner, flows and the event heap are derived on restore.
func (e *Engine) appendShares(buf []byte) []byte {
	buf = binary.AppendUvarint(buf, sharesFormat)
	hs := e.sortedHolders()
	buf = binary.AppendUvarint(buf, uint64(len(hs)))
	for _, h := range hs {
		buf = appendString(buf, h.key.Owner)
		buf = appendString(buf, h.key.ID)
		buf = binary.AppendUvarint(buf, h.key.Incarnation)
		buf = binary.AppendUvarint(buf, h.seq)
		buf = binary.AppendUvarint(buf, h.ackSeq)
		buf = appendBool(buf, h.active)
		buf = binary.AppendVarint(buf, int64(h.dropAt))
		buf = binary.AppendUvarint(buf, uint64(len(h.paths)))
		for i := range h.paths {
			p := &h.paths[i]
			buf = appendString(buf, p.domain)
			buf = binary.AppendUvarint(buf, uint64(len(p.entries)))
			for _, en := range p.entries {
				buf = appendString(buf, en.Key)
				buf = appendString(buf, en.Value)
			}
			buf = appendString(buf, p.key)
			buf = binary.AppendUvarint(buf, p.demand)
			buf = binary.AppendUvarint(buf, p.maxCost)
			buf = appendString(buf, string(p.status))
			buf = appendString(buf, p.message)
			buf = binary.AppendUvarint(buf, uint64(len(p.levels)))
			for j := range p.levels {
				buf = appendString(buf, p.levels[j])
				buf = appendString(buf, p.scopes[j])
			}
			buf = binary.AppendUvarint(buf, p.weight)
		}
		buf = binary.AppendUvarint(buf, uint64(len(h.grants)))
		for _, g := range h.grants {
			buf = binary.AppendUvarint(buf, g.seq)
			buf = binary.AppendVarint(buf, int64(g.start))
			buf = binary.AppendVarint(buf, int64(g.term))
			buf = binary.AppendUvarint(buf, uint64(len(g.levels)))
			for _, l := range g.levels {
				buf = appendString(buf, l.key)
				buf = binary.AppendUvarint(buf, l.r)
				buf = binary.AppendUvarint(buf, l.b)
				buf = binary.AppendUvarint(buf, l.initial)
				buf = appendBool(buf, l.first)
				buf = binary.AppendUvarint(buf, l.fallback)
			}
		}
	}
	keys := sortedKeys(e.sh.lends)
	buf = binary.AppendUvarint(buf, uint64(len(keys)))
	for _, k := range keys {
		ls := e.sh.lends[k]
		buf = appendString(buf, k)
		buf = binary.AppendVarint(buf, int64(ls.cwin))
		buf = binary.AppendUvarint(buf, ls.ccost)
		buf = binary.AppendUvarint(buf, ls.cdemand)
		buf = binary.AppendUvarint(buf, ls.maxCost)
	}
	return buf
}

func appendBool(buf []byte, b bool) []byte {
	if b {
		return append(buf, 1)
	}
	return append(buf, 0)
}

func (e *Engine) sortedHolders() []*holder {
	hs := make([]*holder, 0, len(e.sh.holders))
	for _, h := range e.sh.holders {
		hs = append(hs, h)
	}
	slices.SortFunc(hs, func(a, b *holder) int { return a.key.compare(b.key) })
	return hs
}

func (d *decoder) str() string { return string(d.bytes(d.uvarint())) }

func (d *decoder) boolean() bool {
	b := d.bytes(1)
	if d.err == nil && b[0] > 1 {
		d.fail("bad bool %d", b[0])
	}
	return d.err == nil && b[0] == 1
}

// decodeShares reads the share section into e.sh (holders, events, central demand); the
// caller rebuilds the charged sums (rebuildLends) once the buckets are in place.
func decodeShares(d *decoder, e *Engine) {
	if v := d.uvarint(); d.err == nil && v != sharesFormat {
		d.fail("share section version %d; this build reads %d", v, sharesFormat)
		return
	}
	nh := d.count(8)
	var prev *holder
	for i := 0; i < nh && d.err == nil; i++ {
		h := &holder{key: HolderKey{Owner: d.str(), ID: d.str(), Incarnation: d.uvarint()}}
		h.seq, h.ackSeq = d.uvarint(), d.uvarint()
		h.active = d.boolean()
		h.dropAt = Time(d.varint())
		np := d.count(8)
		for j := 0; j < np && d.err == nil; j++ {
			p := holderPath{domain: d.str()}
			ne := d.count(2)
			for k := 0; k < ne && d.err == nil; k++ {
				p.entries = append(p.entries, Entry{Key: d.str(), Value: d.str()})
			}
			p.key, p.demand, p.maxCost = d.str(), d.uvarint(), d.uvarint()
			p.status, p.message = ShareStatus(d.str()), d.str()
			nl := d.count(2)
			for k := 0; k < nl && d.err == nil; k++ {
				p.levels = append(p.levels, d.str())
				p.scopes = append(p.scopes, d.str())
			}
			p.weight = d.uvarint()
			switch p.status {
			case ShareLent, ShareCentral, ShareTooSmall, ShareInvalid:
			default:
				d.fail("holder path status %q", p.status)
			}
			h.paths = append(h.paths, p)
		}
		ng := d.count(4)
		for j := 0; j < ng && d.err == nil; j++ {
			g := &grant{seq: d.uvarint(), start: Time(d.varint()), term: time.Duration(d.varint())}
			nl := d.count(6)
			for k := 0; k < nl && d.err == nil; k++ {
				l := grantLevel{key: d.str(), r: d.uvarint(), b: d.uvarint(), initial: d.uvarint(), first: d.boolean(), fallback: d.uvarint()}
				if n := len(g.levels); n > 0 && g.levels[n-1].key >= l.key {
					d.fail("grant levels not sorted by key")
				}
				g.levels = append(g.levels, l)
			}
			if n := len(h.grants); d.err == nil && (g.seq > h.seq || (n > 0 && h.grants[n-1].seq >= g.seq) || g.term <= 0) {
				d.fail("holder grant %d out of order, beyond its seq %d, or without a term", g.seq, h.seq)
			}
			h.grants = append(h.grants, g)
		}
		if d.err != nil {
			return
		}
		if h.key.ID == "" || (prev != nil && prev.key.compare(h.key) >= 0) {
			d.fail("share holders not sorted, duplicated or without an ID")
			return
		}
		prev = h
		e.sh.holders[h.key] = h
		e.sh.owners[h.key.Owner]++
		for _, g := range h.grants {
			e.sh.events.push(shareEvent{at: e.chargedUntil(g), key: h.key, seq: g.seq})
		}
		if len(h.grants) == 0 && h.dropAt != 0 {
			e.sh.events.push(shareEvent{at: h.dropAt, key: h.key, drop: true})
		}
	}
	nl := d.count(5)
	for i := 0; i < nl && d.err == nil; i++ {
		ls := &lendState{key: d.str(), cwin: Time(d.varint()), ccost: d.uvarint(), cdemand: d.uvarint(), maxCost: d.uvarint()}
		if d.err == nil && e.sh.lends[ls.key] != nil {
			d.fail("lend %q appears twice", ls.key)
		}
		e.sh.lends[ls.key] = ls
	}
}

// hashShares folds the share state into h: holders (with paths and grants) and the lendable
// buckets' sums and central demand, as order-free sums of per-element hashes.
func (e *Engine) hashShares(h hashState) hashState {
	var hsum, lsum uint64
	for _, x := range e.sh.holders {
		y := hashState(hashSeed).str(x.key.Owner).str(x.key.ID).u64(x.key.Incarnation).
			u64(x.seq).u64(x.ackSeq).u64(uint64(x.dropAt)).u64(uint64(len(x.paths))).u64(uint64(len(x.grants)))
		if x.active {
			y = y.u64(1)
		}
		for i := range x.paths {
			p := &x.paths[i]
			y = y.str(p.key).u64(p.demand).u64(p.maxCost).str(string(p.status)).u64(uint64(len(p.levels))).u64(p.weight)
		}
		for _, g := range x.grants {
			y = y.u64(g.seq).u64(uint64(g.start)).u64(uint64(g.term)).u64(uint64(len(g.levels)))
			for _, l := range g.levels {
				y = y.str(l.key).u64(l.r).u64(l.b).u64(l.initial).u64(l.fallback)
				if l.first {
					y = y.u64(1)
				}
			}
		}
		hsum += uint64(y)
	}
	for k, ls := range e.sh.lends {
		lsum += uint64(hashState(hashSeed).str(k).u64(ls.sumR).u64(ls.sumB).u64(uint64(ls.refs)).
			u64(uint64(ls.cwin)).u64(ls.ccost).u64(ls.cdemand).u64(ls.maxCost))
	}
	return h.u64(sharesFormat).u64(uint64(len(e.sh.holders))).u64(hsum).u64(uint64(len(e.sh.lends))).u64(lsum)
}
