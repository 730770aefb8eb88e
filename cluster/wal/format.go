package wal

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"time"

	"github.com/hashicorp/raft"
)

// On-disk format (all integers little-endian, every record 8-byte aligned).
//
// A segment file is named "<seq>-<base>.wal" (seq: 10 decimal digits, base: 20) and starts
// with a 64-byte header:
//
//	[0:8]   magic "QUOTAWAL"
//	[8:12]  format version (1)
//	[12:16] salt: random, seeds every CRC in this file
//	[16:24] seq: the segment's sequence number; a log's segments are consecutive
//	[24:32] base: the index of the first entry written to it when it was created
//	[32:60] zero
//	[60:64] CRC-32C of [0:60]
//
// Then records ("batches"), one per StoreLogs or DeleteRange, each written with one write and
// made durable with one fdatasync:
//
//	header (32 bytes)
//	  [0:4]   batch magic
//	  [4]     kind: 1 entries, 2 clamp
//	  [5:8]   zero
//	  [8:12]  length of the whole record, header and commit included (a multiple of 8)
//	  [12:16] count of entries (0 for a clamp record)
//	  [16:24] first index (clamp: drop the entries below it)
//	  [24:32] last index (clamp: drop the entries above it)
//	entries (kind 1), count of them, each:
//	  [0:8]   index   [8:16] term   [16:24] AppendedAt (Unix ns, 0 for the zero time)
//	  [24]    type    [25:28] zero  [28:32] len(Data)  [32:36] len(Extensions)
//	  [36:40] CRC-32C of [0:36], Data and Extensions (checked on every read)
//	  Data, Extensions, zero padding to 8 bytes
//	commit (24 bytes)
//	  [0:8] first index  [8:16] last index (the header's again)  [16:20] commit magic
//	  [20:24] CRC-32C of the whole record up to here
//
// A clamp record says "drop every entry below first and above last": [x, max] is a compaction
// (head deletion), [0, m] a conflict truncation (suffix deletion), [max, 0] deletes the whole
// log. It is how DeleteRange is made durable without rewriting anything, and because it only
// narrows what came before, replaying the records of any suffix of the segments (what is left
// after compaction removed the oldest ones, or while a removal was cut short) ends in the same
// log. A record counts only if its commit record is there and its CRC matches: a write cut
// short by a crash is recognised and dropped on open.

const (
	segHeaderSize   = 64
	batchHeaderSize = 32
	entryHeaderSize = 40
	commitSize      = 24
	formatVersion   = 1

	batchMagic  = 0x42574151 // "QAWB"
	commitMagic = 0x43574151 // "QAWC"

	kindEntries = 1
	kindClamp   = 2

	// maxRecord bounds one record (the length field is 32 bits; raft batches are far smaller).
	maxRecord = 1 << 31
)

var segMagic = [8]byte{'Q', 'U', 'O', 'T', 'A', 'W', 'A', 'L'}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func checksum(salt uint32, b ...[]byte) uint32 {
	c := salt
	for _, p := range b {
		c = crc32.Update(c, castagnoli, p)
	}
	return c
}

func pad8(n int) int { return (n + 7) &^ 7 }

type segHeader struct {
	salt      uint32
	seq, base uint64
}

func (h segHeader) encode() []byte {
	b := make([]byte, segHeaderSize)
	copy(b[0:8], segMagic[:])
	binary.LittleEndian.PutUint32(b[8:12], formatVersion)
	binary.LittleEndian.PutUint32(b[12:16], h.salt)
	binary.LittleEndian.PutUint64(b[16:24], h.seq)
	binary.LittleEndian.PutUint64(b[24:32], h.base)
	binary.LittleEndian.PutUint32(b[60:64], checksum(0, b[0:60]))
	return b
}

func decodeSegHeader(b []byte) (segHeader, error) {
	if len(b) < segHeaderSize {
		return segHeader{}, errors.New("shorter than a segment header")
	}
	if [8]byte(b[0:8]) != segMagic {
		return segHeader{}, errors.New("not a quotad WAL segment (no QUOTAWAL magic)")
	}
	if got, want := binary.LittleEndian.Uint32(b[60:64]), checksum(0, b[0:60]); got != want {
		return segHeader{}, fmt.Errorf("segment header checksum %08x, want %08x", got, want)
	}
	if v := binary.LittleEndian.Uint32(b[8:12]); v != formatVersion {
		return segHeader{}, fmt.Errorf("segment format version %d; this build reads version %d", v, formatVersion)
	}
	return segHeader{
		salt: binary.LittleEndian.Uint32(b[12:16]),
		seq:  binary.LittleEndian.Uint64(b[16:24]),
		base: binary.LittleEndian.Uint64(b[24:32]),
	}, nil
}

// entryLen is the encoded size of one entry.
func entryLen(l *raft.Log) int {
	return pad8(entryHeaderSize + len(l.Data) + len(l.Extensions))
}

// appendEntries appends one entries record for logs (consecutive indexes) to buf.
func appendEntries(buf []byte, salt uint32, logs []*raft.Log) ([]byte, error) {
	n := batchHeaderSize + commitSize
	for _, l := range logs {
		n += entryLen(l)
	}
	if n >= maxRecord {
		return buf, fmt.Errorf("wal: a batch of %d entries encodes to %d bytes, more than the %d a record holds", len(logs), n, maxRecord)
	}
	start := len(buf)
	buf = grow(buf, n)
	rec := buf[start:]
	first, last := logs[0].Index, logs[len(logs)-1].Index
	putBatchHeader(rec, kindEntries, n, len(logs), first, last)
	off := batchHeaderSize
	for _, l := range logs {
		e := rec[off:]
		binary.LittleEndian.PutUint64(e[0:8], l.Index)
		binary.LittleEndian.PutUint64(e[8:16], l.Term)
		var at int64
		if !l.AppendedAt.IsZero() {
			at = l.AppendedAt.UnixNano()
		}
		binary.LittleEndian.PutUint64(e[16:24], uint64(at))
		e[24] = byte(l.Type)
		binary.LittleEndian.PutUint32(e[28:32], uint32(len(l.Data)))
		binary.LittleEndian.PutUint32(e[32:36], uint32(len(l.Extensions)))
		copy(e[entryHeaderSize:], l.Data)
		copy(e[entryHeaderSize+len(l.Data):], l.Extensions)
		binary.LittleEndian.PutUint32(e[36:40], checksum(salt, e[0:36], l.Data, l.Extensions))
		off += entryLen(l)
	}
	putCommit(rec, salt, first, last)
	return buf, nil
}

// appendClamp appends a clamp record: drop the entries below first and above last.
func appendClamp(buf []byte, salt uint32, first, last uint64) []byte {
	n := batchHeaderSize + commitSize
	start := len(buf)
	buf = grow(buf, n)
	rec := buf[start:]
	putBatchHeader(rec, kindClamp, n, 0, first, last)
	putCommit(rec, salt, first, last)
	return buf
}

// grow extends buf by n zeroed bytes.
func grow(buf []byte, n int) []byte {
	l := len(buf)
	if cap(buf)-l < n {
		nb := make([]byte, l, 2*cap(buf)+n)
		copy(nb, buf)
		buf = nb
	}
	buf = buf[:l+n]
	clear(buf[l:])
	return buf
}

func putBatchHeader(rec []byte, kind byte, n, count int, first, last uint64) {
	binary.LittleEndian.PutUint32(rec[0:4], batchMagic)
	rec[4] = kind
	binary.LittleEndian.PutUint32(rec[8:12], uint32(n))
	binary.LittleEndian.PutUint32(rec[12:16], uint32(count))
	binary.LittleEndian.PutUint64(rec[16:24], first)
	binary.LittleEndian.PutUint64(rec[24:32], last)
}

func putCommit(rec []byte, salt uint32, first, last uint64) {
	c := rec[len(rec)-commitSize:]
	binary.LittleEndian.PutUint64(c[0:8], first)
	binary.LittleEndian.PutUint64(c[8:16], last)
	binary.LittleEndian.PutUint32(c[16:20], commitMagic)
	binary.LittleEndian.PutUint32(c[20:24], checksum(salt, rec[:len(rec)-4]))
}

// batchHeader is a record's header as read, before the record is verified.
type batchHeader struct {
	kind        byte
	length      int
	count       int
	first, last uint64
}

// parseBatchHeader reads the fixed header at the start of b; ok is false if it cannot be the
// header of a record (wrong magic, kind, length or counts): the end of the written part of a
// segment, or damage.
func parseBatchHeader(b []byte) (h batchHeader, ok bool) {
	if len(b) < batchHeaderSize || binary.LittleEndian.Uint32(b[0:4]) != batchMagic || b[5]|b[6]|b[7] != 0 {
		return h, false
	}
	h = batchHeader{
		kind:   b[4],
		length: int(binary.LittleEndian.Uint32(b[8:12])),
		count:  int(binary.LittleEndian.Uint32(b[12:16])),
		first:  binary.LittleEndian.Uint64(b[16:24]),
		last:   binary.LittleEndian.Uint64(b[24:32]),
	}
	if h.length < batchHeaderSize+commitSize || h.length%8 != 0 {
		return h, false
	}
	switch h.kind {
	case kindEntries:
		if h.first == 0 || h.last < h.first || h.last-h.first+1 != uint64(h.count) ||
			h.count > (h.length-batchHeaderSize-commitSize)/entryHeaderSize {
			return h, false
		}
	case kindClamp:
		if h.count != 0 || h.length != batchHeaderSize+commitSize {
			return h, false
		}
	default:
		return h, false
	}
	return h, true
}

// verifyRecord checks a whole record (rec is exactly h.length bytes): the commit record, its
// CRC, and that the entries fill it exactly with consecutive indexes. It returns the offset
// (within rec) and length of each entry.
func verifyRecord(rec []byte, h batchHeader, salt uint32, spans []span) ([]span, bool) {
	c := rec[len(rec)-commitSize:]
	if binary.LittleEndian.Uint64(c[0:8]) != h.first || binary.LittleEndian.Uint64(c[8:16]) != h.last ||
		binary.LittleEndian.Uint32(c[16:20]) != commitMagic ||
		binary.LittleEndian.Uint32(c[20:24]) != checksum(salt, rec[:len(rec)-4]) {
		return spans, false
	}
	off, end := batchHeaderSize, len(rec)-commitSize
	for i := range h.count {
		if end-off < entryHeaderSize {
			return spans, false
		}
		e := rec[off:]
		if binary.LittleEndian.Uint64(e[0:8]) != h.first+uint64(i) {
			return spans, false
		}
		n := pad8(entryHeaderSize + int(binary.LittleEndian.Uint32(e[28:32])) + int(binary.LittleEndian.Uint32(e[32:36])))
		if n > end-off {
			return spans, false
		}
		spans = append(spans, span{off: int64(off), n: uint32(n)})
		off += n
	}
	return spans, off == end
}

type span struct {
	off int64
	n   uint32
}

// decodeEntry decodes one entry (b is its encoded bytes, which the caller hands over: Data and
// Extensions point into it) into l, checking its CRC.
func decodeEntry(b []byte, salt uint32, l *raft.Log) error {
	if len(b) < entryHeaderSize {
		return errors.New("entry shorter than its header")
	}
	dn, xn := int(binary.LittleEndian.Uint32(b[28:32])), int(binary.LittleEndian.Uint32(b[32:36]))
	if entryHeaderSize+dn+xn > len(b) {
		return errors.New("entry lengths exceed the entry")
	}
	data := b[entryHeaderSize : entryHeaderSize+dn : entryHeaderSize+dn]
	ext := b[entryHeaderSize+dn : entryHeaderSize+dn+xn : entryHeaderSize+dn+xn]
	if got, want := binary.LittleEndian.Uint32(b[36:40]), checksum(salt, b[0:36], data, ext); got != want {
		return fmt.Errorf("entry checksum %08x, want %08x", got, want)
	}
	l.Index = binary.LittleEndian.Uint64(b[0:8])
	l.Term = binary.LittleEndian.Uint64(b[8:16])
	l.AppendedAt = time.Time{}
	if at := int64(binary.LittleEndian.Uint64(b[16:24])); at != 0 {
		l.AppendedAt = time.Unix(0, at)
	}
	l.Type = raft.LogType(b[24])
	// Empty stays nil, as raft-boltdb's decoding gives it.
	l.Data, l.Extensions = nil, nil
	if dn > 0 {
		l.Data = data
	}
	if xn > 0 {
		l.Extensions = ext
	}
	return nil
}
