package wal

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// recover rebuilds the log from the segment files (Open, before anyone else sees l).
func (l *Log) recover() error {
	ents, err := os.ReadDir(l.dir)
	if err != nil {
		return fmt.Errorf("wal: list %s: %w", l.dir, err)
	}
	type found struct{ seq, base uint64 }
	var segs []found
	removedTmp := false
	for _, e := range ents {
		name := e.Name()
		switch {
		case strings.HasSuffix(name, ".wal.tmp"):
			// A segment creation cut short before its rename: nothing was ever written to it.
			if err := os.Remove(filepath.Join(l.dir, name)); err != nil {
				return fmt.Errorf("wal: remove unfinished segment %s: %w", filepath.Join(l.dir, name), err)
			}
			l.log.Warn("removed an unfinished segment file", "file", filepath.Join(l.dir, name))
			removedTmp = true
		case strings.HasSuffix(name, ".wal"):
			seq, base, ok := parseSegName(name)
			if !ok {
				return fmt.Errorf("%w: %s is not a segment file name (<seq>-<first index>.wal)", ErrCorrupt, filepath.Join(l.dir, name))
			}
			segs = append(segs, found{seq, base})
		}
	}
	if removedTmp {
		if err := l.d.Sync(); err != nil {
			return fmt.Errorf("wal: sync %s: %w", l.dir, err)
		}
	}
	slices.SortFunc(segs, func(a, b found) int {
		switch {
		case a.seq < b.seq:
			return -1
		case a.seq > b.seq:
			return 1
		}
		return 0
	})
	for i := 1; i < len(segs); i++ {
		if segs[i].seq != segs[i-1].seq+1 {
			return fmt.Errorf("%w: segment %d is missing from %s (between %s and %s)", ErrCorrupt, segs[i-1].seq+1, l.dir,
				segName(segs[i-1].seq, segs[i-1].base), segName(segs[i].seq, segs[i].base))
		}
	}
	for i, sg := range segs {
		path := filepath.Join(l.dir, segName(sg.seq, sg.base))
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			return fmt.Errorf("wal: open %s: %w", path, err)
		}
		s := &segment{seq: sg.seq, base: sg.base, path: path, f: f}
		l.segs = append(l.segs, s) // closed by closeFiles if recovery fails
		if err := l.scan(s, i == len(segs)-1); err != nil {
			return err
		}
	}
	l.locs = slices.Clone(l.locs)
	// A compaction cut short by a crash may have left segments that hold no entry any more.
	dead := l.deadHead()
	l.segs = l.segs[len(dead):]
	if err := l.removeSegments(dead); err != nil {
		return fmt.Errorf("wal: remove segments left by an unfinished compaction: %w", l.broken)
	}
	return nil
}

// scan reads segment s's records in order and applies them to the log. In the tail, a damaged
// end with no valid record after it is a write cut short and is cut off the file.
func (l *Log) scan(s *segment, tail bool) error {
	fi, err := s.f.Stat()
	if err != nil {
		return fmt.Errorf("wal: stat %s: %w", s.path, err)
	}
	size := fi.Size()
	hb := make([]byte, segHeaderSize)
	if _, err := s.f.ReadAt(hb, 0); err != nil {
		return fmt.Errorf("%w: %s: read the segment header: %v", ErrCorrupt, s.path, err)
	}
	h, err := decodeSegHeader(hb)
	if err != nil {
		return fmt.Errorf("%w: %s: %v", ErrCorrupt, s.path, err)
	}
	if h.seq != s.seq || h.base != s.base {
		return fmt.Errorf("%w: %s: its header says segment %d from index %d", ErrCorrupt, s.path, h.seq, h.base)
	}
	s.salt = h.salt
	if l.last != 0 && s.base != l.last+1 {
		return fmt.Errorf("%w: %s starts at index %d, but the segments before it end at %d", ErrCorrupt, s.path, s.base, l.last)
	}
	off := int64(segHeaderSize)
	var rec []byte
	var spans []span
	for firstRecord := true; ; firstRecord = false {
		h, ok := readRecord(s.f, off, size, s.salt, &rec, &spans)
		if !ok {
			break
		}
		switch h.kind {
		case kindEntries:
			if l.last != 0 && h.first != l.last+1 {
				return fmt.Errorf("%w: %s at offset %d: entries [%d, %d] do not follow the log's last index %d", ErrCorrupt, s.path, off, h.first, h.last, l.last)
			}
			if firstRecord && h.first != s.base {
				return fmt.Errorf("%w: %s at offset %d: the segment's first entries start at %d, not at its first index %d", ErrCorrupt, s.path, off, h.first, s.base)
			}
			if l.last == 0 {
				l.first = h.first
			}
			for _, sp := range spans {
				l.locs = append(l.locs, loc{seg: s, off: off + sp.off, n: sp.n})
			}
			l.last = h.last
		case kindClamp:
			l.clamp(h.first, h.last)
		}
		off += int64(h.length)
	}
	s.end = off
	if off >= size {
		return nil
	}
	// Not a valid record at off: the end of what was written (zeros), a write cut short, or
	// damage. Only the first two are possible if no valid record follows.
	zero, next, err := scanRest(s.f, off, size, s.salt)
	if err != nil {
		return fmt.Errorf("wal: read %s: %w", s.path, err)
	}
	switch {
	case next >= 0:
		return fmt.Errorf("%w: %s: the record at offset %d is damaged, but a valid record follows at offset %d; "+
			"a crash cannot cause that, so this is damage to acknowledged entries (the file is left as it is)", ErrCorrupt, s.path, off, next)
	case zero:
		return nil
	case !tail:
		return fmt.Errorf("%w: %s: damaged bytes after its last valid record at offset %d, but it is not the last segment, "+
			"to which a crash could have cut a write short", ErrCorrupt, s.path, off)
	}
	// A write cut short: never acknowledged (the fdatasync had not returned). Cut it off, so
	// the next append is where Open looks for it.
	l.log.Warn("dropping the unfinished end of the log's last segment (a write cut short by a crash)",
		"file", s.path, "offset", off, "bytes", size-off)
	if err := s.f.Truncate(off); err != nil {
		return fmt.Errorf("wal: truncate %s at %d: %w", s.path, off, err)
	}
	if !l.opts.NoPreallocate && off < l.opts.SegmentSize {
		if _, err := preallocate(s.f, l.opts.SegmentSize); err != nil {
			return fmt.Errorf("wal: preallocate %s: %w", s.path, err)
		}
	}
	if err := s.f.Sync(); err != nil {
		return fmt.Errorf("wal: sync %s: %w", s.path, err)
	}
	return nil
}

// readRecord reads and verifies the record at off; ok is false if there is no valid one.
func readRecord(f *os.File, off, size int64, salt uint32, rec *[]byte, spans *[]span) (batchHeader, bool) {
	if size-off < batchHeaderSize+commitSize {
		return batchHeader{}, false
	}
	var hb [batchHeaderSize]byte
	if _, err := f.ReadAt(hb[:], off); err != nil {
		return batchHeader{}, false
	}
	h, ok := parseBatchHeader(hb[:])
	if !ok || int64(h.length) > size-off {
		return h, false
	}
	if cap(*rec) < h.length {
		*rec = make([]byte, h.length)
	}
	b := (*rec)[:h.length]
	if _, err := f.ReadAt(b, off); err != nil {
		return h, false
	}
	*spans, ok = verifyRecord(b, h, salt, (*spans)[:0])
	return h, ok
}

// scanRest reads [off, size) of f: whether it is all zeros, and the offset of the first valid
// record in it after off (-1 if none). Records start at multiples of 8.
func scanRest(f *os.File, off, size int64, salt uint32) (zero bool, next int64, err error) {
	zero, next = true, -1
	const chunk = 1 << 20
	buf := make([]byte, chunk)
	var rec []byte
	var spans []span
	for pos := off; pos < size; pos += chunk {
		n := min(int64(chunk), size-pos)
		b := buf[:n]
		if _, err := f.ReadAt(b, pos); err != nil && !errors.Is(err, io.EOF) {
			return false, -1, err
		}
		if zero && !allZero(b) {
			zero = false
		}
		if zero {
			continue
		}
		for i := int64(0); i+4 <= n; i += 8 {
			p := pos + i
			if p == off || binary.LittleEndian.Uint32(b[i:]) != batchMagic {
				continue
			}
			if _, ok := readRecord(f, p, size, salt, &rec, &spans); ok {
				return false, p, nil
			}
		}
	}
	return zero, -1, nil
}

// zeros is compared against: bytes.Equal is vectorized (the unused part of a preallocated
// segment, up to 64 MiB, is checked on every open).
var zeros = make([]byte, 1<<20)

func allZero(b []byte) bool {
	for len(b) > 0 {
		n := min(len(b), len(zeros))
		if !bytes.Equal(b[:n], zeros[:n]) {
			return false
		}
		b = b[n:]
	}
	return true
}
