package wal

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// payload is entry index's deterministic data (term term): 1 byte to ~3 KB, no zero bytes.
func payload(index, term uint64) []byte {
	b := make([]byte, 1+int(index*7919%3000))
	for i := range b {
		b[i] = byte(1 + (index+uint64(i)+term*31)%250)
	}
	return b
}

func entries(from, to, term uint64) []*raft.Log {
	var ls []*raft.Log
	for i := from; i <= to; i++ {
		ls = append(ls, &raft.Log{Index: i, Term: term, Type: raft.LogCommand, Data: payload(i, term),
			AppendedAt: time.Unix(1700000000, int64(i))})
	}
	return ls
}

func mustOpen(t testing.TB, dir string, opts Options) *Log {
	t.Helper()
	l, err := Open(dir, opts)
	if err != nil {
		t.Fatalf("Open(%s): %v", dir, err)
	}
	return l
}

func store(t testing.TB, l *Log, from, to, term uint64) {
	t.Helper()
	if err := l.StoreLogs(entries(from, to, term)); err != nil {
		t.Fatalf("StoreLogs [%d, %d]: %v", from, to, err)
	}
}

// expect checks that l is exactly [first, last] (0, 0: empty), every entry with its payload of
// term termOf(index).
func expect(t testing.TB, l *Log, first, last uint64, termOf func(uint64) uint64) {
	t.Helper()
	f, _ := l.FirstIndex()
	la, _ := l.LastIndex()
	if f != first || la != last {
		t.Fatalf("log is [%d, %d], want [%d, %d]", f, la, first, last)
	}
	for i := first; i <= last && last != 0; i++ {
		var e raft.Log
		if err := l.GetLog(i, &e); err != nil {
			t.Fatalf("GetLog(%d): %v", i, err)
		}
		term := termOf(i)
		if e.Index != i || e.Term != term || e.Type != raft.LogCommand || !bytes.Equal(e.Data, payload(i, term)) ||
			e.Extensions != nil || !e.AppendedAt.Equal(time.Unix(1700000000, int64(i))) {
			t.Fatalf("entry %d read back as index %d term %d type %v, %d bytes, appended %v", i, e.Index, e.Term, e.Type, len(e.Data), e.AppendedAt)
		}
	}
	var e raft.Log
	for _, i := range []uint64{first - 1, last + 1} {
		if i == 0 {
			continue
		}
		if err := l.GetLog(i, &e); !errors.Is(err, raft.ErrLogNotFound) {
			t.Fatalf("GetLog(%d) outside [%d, %d]: %v, want ErrLogNotFound", i, first, last, err)
		}
	}
}

func term1(uint64) uint64 { return 1 }

func segFiles(t testing.TB, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, "*.wal"))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestDeleteRange: prefix, suffix and whole-log deletion, each surviving a reopen; the
// segments below the first index are removed; what raft never asks is refused without a
// change.
func TestDeleteRange(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	opts := Options{SegmentSize: 32 << 10}
	l := mustOpen(t, dir, opts)
	for i := uint64(1); i <= 200; i += 5 {
		store(t, l, i, i+4, 1)
	}
	expect(t, l, 1, 200, term1)
	nseg := len(segFiles(t, dir))
	if nseg < 5 {
		t.Fatalf("%d segments for 200 entries of ~1.5 KB in 32 KB segments", nseg)
	}

	if err := l.DeleteRange(1, 150); err != nil {
		t.Fatal(err)
	}
	expect(t, l, 151, 200, term1)
	if n := len(segFiles(t, dir)); n >= nseg {
		t.Fatalf("compaction to 151 left %d of %d segments", n, nseg)
	}
	// A conflict: the suffix from 181 goes, term 2 follows.
	if err := l.DeleteRange(181, 200); err != nil {
		t.Fatal(err)
	}
	store(t, l, 181, 190, 2)
	termOf := func(i uint64) uint64 {
		if i >= 181 {
			return 2
		}
		return 1
	}
	expect(t, l, 151, 190, termOf)

	// Refused: a gap, an overlap, a hole in the middle. Nothing changes.
	for _, err := range []error{
		l.StoreLogs(entries(192, 193, 2)),
		l.StoreLogs(entries(185, 195, 2)),
		l.StoreLogs([]*raft.Log{entries(191, 191, 2)[0], entries(193, 193, 2)[0]}),
		l.DeleteRange(160, 170),
	} {
		if err == nil {
			t.Fatal("a write raft never makes was accepted")
		}
	}
	// Ranges outside the log are no-ops.
	for _, r := range [][2]uint64{{1, 100}, {300, 400}, {10, 5}} {
		if err := l.DeleteRange(r[0], r[1]); err != nil {
			t.Fatalf("DeleteRange(%d, %d): %v", r[0], r[1], err)
		}
	}
	expect(t, l, 151, 190, termOf)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}

	l = mustOpen(t, dir, opts)
	expect(t, l, 151, 190, termOf)
	// A snapshot install: the whole log goes, appends start anywhere (below the old end too).
	if err := l.DeleteRange(151, 190); err != nil {
		t.Fatal(err)
	}
	expect(t, l, 0, 0, term1)
	if n := len(segFiles(t, dir)); n != 1 {
		t.Fatalf("%d segments after deleting the whole log, want the tail only", n)
	}
	store(t, l, 170, 175, 3)
	term3 := func(uint64) uint64 { return 3 }
	expect(t, l, 170, 175, term3)
	l.Close()
	l = mustOpen(t, dir, opts)
	expect(t, l, 170, 175, term3)
	// Enough to rotate several times after the reset, then compaction and reopen again.
	for i := uint64(176); i <= 400; i += 9 {
		store(t, l, i, i+8, 3)
	}
	if err := l.DeleteRange(170, 380); err != nil {
		t.Fatal(err)
	}
	l.Close()
	l = mustOpen(t, dir, opts)
	defer l.Close()
	expect(t, l, 381, 400, term3)
}

// TestOpenRefusesInteriorDamage: damage a crash cannot cause is an error naming the file and
// offset, and Open changes nothing: a bad record followed by a good one, a missing segment, a
// damaged end of a segment that is not the last, a damaged segment header.
func TestOpenRefusesInteriorDamage(t *testing.T) {
	t.Parallel()
	build := func(t *testing.T) (dir string, recs [][2]int64) {
		dir = t.TempDir()
		l := mustOpen(t, dir, Options{SegmentSize: 64 << 10})
		for i := uint64(1); i <= 120; i += 4 {
			start := int64(segHeaderSize)
			if tl := l.tail(); tl != nil {
				start = tl.end
			}
			store(t, l, i, i+3, 1)
			recs = append(recs, [2]int64{start, l.tail().end})
		}
		if err := l.Close(); err != nil {
			t.Fatal(err)
		}
		return dir, recs
	}
	damage := func(t *testing.T, path string, off int64) {
		t.Helper()
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		b := make([]byte, 1)
		f.ReadAt(b, off)
		b[0] ^= 0x40
		if _, err := f.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
	}
	refused := func(t *testing.T, dir string, want ...string) {
		t.Helper()
		before := snapshotDir(t, dir)
		_, err := Open(dir, Options{SegmentSize: 64 << 10})
		if !errors.Is(err, ErrCorrupt) {
			t.Fatalf("Open: %v, want ErrCorrupt", err)
		}
		for _, w := range want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("error does not say %q: %v", w, err)
			}
		}
		if after := snapshotDir(t, dir); after != before {
			t.Errorf("the refused Open changed the files")
		}
	}

	t.Run("bad record before good ones", func(t *testing.T) {
		dir, recs := build(t)
		segs := segFiles(t, dir)
		tail := segs[len(segs)-1]
		second := recs[len(recs)-2][0] // the tail's last but one record
		if second >= recs[len(recs)-1][0] {
			t.Fatal("the last two records are not in one segment")
		}
		damage(t, tail, second+batchHeaderSize+20)
		refused(t, dir, filepath.Base(tail), fmt.Sprintf("offset %d", second), "a valid record follows")
	})
	t.Run("damage in an earlier segment", func(t *testing.T) {
		dir, _ := build(t)
		first := segFiles(t, dir)[0]
		damage(t, first, segHeaderSize+batchHeaderSize+5)
		refused(t, dir, filepath.Base(first), fmt.Sprintf("offset %d", segHeaderSize))
	})
	t.Run("last record of an earlier segment", func(t *testing.T) {
		dir, _ := build(t)
		segs := segFiles(t, dir)
		l := mustOpen(t, dir, Options{SegmentSize: 64 << 10})
		var lastRec int64 // the first segment's last entry
		for _, lc := range l.locs {
			if lc.seg == l.segs[0] {
				lastRec = lc.off
			}
		}
		l.Close()
		damage(t, segs[0], lastRec+3)
		refused(t, dir, filepath.Base(segs[0]), "not the last segment")
	})
	t.Run("missing segment", func(t *testing.T) {
		dir, _ := build(t)
		segs := segFiles(t, dir)
		if len(segs) < 3 {
			t.Fatalf("%d segments", len(segs))
		}
		if err := os.Remove(segs[1]); err != nil {
			t.Fatal(err)
		}
		refused(t, dir, "segment 2 is missing", filepath.Base(segs[0]), filepath.Base(segs[2]))
	})
	t.Run("segment header", func(t *testing.T) {
		dir, _ := build(t)
		segs := segFiles(t, dir)
		damage(t, segs[len(segs)-1], 20)
		refused(t, dir, filepath.Base(segs[len(segs)-1]), "header checksum")
	})
	t.Run("renamed segment", func(t *testing.T) {
		dir, _ := build(t)
		segs := segFiles(t, dir)
		last := segs[len(segs)-1]
		seq, base, _ := parseSegName(filepath.Base(last))
		if err := os.Rename(last, filepath.Join(dir, segName(seq, base+1))); err != nil {
			t.Fatal(err)
		}
		refused(t, dir, "its header says")
	})
}

// snapshotDir describes dir's files (names, sizes, contents' CRC) to compare.
func snapshotDir(t *testing.T, dir string) string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var sb strings.Builder
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&sb, "%s:%d:%08x ", e.Name(), len(b), checksum(0, b))
	}
	return sb.String()
}

// TestTornTail: the last record cut short or damaged anywhere (with nothing valid after it) is
// a write a crash cut short: Open drops it and cuts it off the file, appends go where the next
// Open finds them.
func TestTornTail(t *testing.T) {
	t.Parallel()
	for _, prealloc := range []bool{true, false} {
		for _, cut := range []string{"half", "commit", "flip", "header-only"} {
			t.Run(fmt.Sprintf("prealloc=%v/%s", prealloc, cut), func(t *testing.T) {
				t.Parallel()
				dir := t.TempDir()
				opts := Options{SegmentSize: 1 << 20, NoPreallocate: !prealloc}
				l := mustOpen(t, dir, opts)
				store(t, l, 1, 10, 1)
				start := l.tail().end
				store(t, l, 11, 15, 1)
				end := l.tail().end
				l.Close()
				path := segFiles(t, dir)[0]
				b, _ := os.ReadFile(path)
				switch cut {
				case "half":
					if prealloc {
						clear(b[(start+end)/2 : end])
					} else {
						b = b[:(start+end)/2]
					}
				case "commit":
					clear(b[end-commitSize : end])
				case "flip":
					b[(start+end)/2] ^= 1
				case "header-only":
					clear(b[start+batchHeaderSize : end])
				}
				if err := os.WriteFile(path, b, 0o644); err != nil {
					t.Fatal(err)
				}
				l = mustOpen(t, dir, opts)
				expect(t, l, 1, 10, term1)
				if fi, _ := os.Stat(path); !prealloc && fi.Size() != start {
					t.Fatalf("the torn record is still in the file: size %d, valid end %d", fi.Size(), start)
				}
				store(t, l, 11, 20, 1)
				l.Close()
				l = mustOpen(t, dir, opts)
				defer l.Close()
				expect(t, l, 1, 20, term1)
			})
		}
	}
}

// TestConcurrentReads: readers running alongside appends, compactions, truncations and whole
// log deletions (run with -race) never see an entry with the wrong content.
func TestConcurrentReads(t *testing.T) {
	t.Parallel()
	l := mustOpen(t, t.TempDir(), Options{SegmentSize: 64 << 10})
	defer l.Close()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	errc := make(chan error, 4)
	for r := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := uint64(r); ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				first, _ := l.FirstIndex()
				last, _ := l.LastIndex()
				if last == 0 {
					continue
				}
				i := first + n%(last-first+1)
				var e raft.Log
				err := l.GetLog(i, &e)
				if errors.Is(err, raft.ErrLogNotFound) {
					continue // deleted meanwhile
				}
				if err != nil || e.Index != i || !bytes.Equal(e.Data, payload(i, e.Term)) {
					errc <- fmt.Errorf("GetLog(%d): %v (index %d, term %d, %d bytes)", i, err, e.Index, e.Term, len(e.Data))
					return
				}
			}
		}()
	}
	var last uint64
	for b := 1; b <= 600; b++ {
		n := uint64(1 + b%7)
		store(t, l, last+1, last+n, uint64(1+b%3))
		last += n
		first, _ := l.FirstIndex()
		switch {
		case b%101 == 0:
			if err := l.DeleteRange(first, last); err != nil {
				t.Fatal(err)
			}
			last += 50
		case b%23 == 0 && last-first > 10:
			if err := l.DeleteRange(last-5, last); err != nil {
				t.Fatal(err)
			}
			last -= 6
		case b%10 == 0 && last-first > 60:
			if err := l.DeleteRange(first, last-50); err != nil {
				t.Fatal(err)
			}
		}
	}
	close(stop)
	wg.Wait()
	select {
	case err := <-errc:
		t.Fatal(err)
	default:
	}
}

// TestLockedDir: a second Open of the same directory fails while the first holds it.
func TestLockedDir(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	l := mustOpen(t, dir, Options{})
	if _, err := Open(dir, Options{}); err == nil || !strings.Contains(err.Error(), "another process") {
		t.Fatalf("second Open: %v", err)
	}
	l.Close()
	mustOpen(t, dir, Options{}).Close()
}

// FuzzRecovery writes acknowledged batches to a segment, then damages its tail the ways the
// fuzzer chooses — bytes after the last record (a write cut short that reached the disk in
// part) and bytes flipped in the records — and reopens. Open must never panic, and must either
// refuse with ErrCorrupt (when a damaged record is followed by an intact one, or the header is
// damaged) or come back with exactly the batches before the first damaged one, and take and
// keep appends after them.
//
//	go test ./cluster/wal -run X -fuzz FuzzRecovery -fuzztime 60s
func FuzzRecovery(f *testing.F) {
	f.Add(uint8(5), []byte{}, []byte{})
	f.Add(uint8(5), []byte{0x51, 0x41, 0x57, 0x42, 1, 0, 0, 0, 64}, []byte{})
	f.Add(uint8(3), []byte{1, 2, 3}, []byte{0xff, 0xff, 0x10})
	f.Add(uint8(9), []byte{}, []byte{0, 0, 0x80, 1, 2, 4})
	f.Fuzz(func(t *testing.T, nBatches uint8, appended []byte, flips []byte) {
		n := 1 + int(nBatches%12)
		dir := t.TempDir()
		opts := Options{SegmentSize: 1 << 20}
		l := mustOpen(t, dir, opts)
		var recs [][2]int64 // each batch's record [start, end)
		var idx uint64
		for b := range n {
			start := int64(segHeaderSize)
			if tl := l.tail(); tl != nil {
				start = tl.end
			}
			k := uint64(1 + b%4)
			store(t, l, idx+1, idx+k, 1)
			idx += k
			recs = append(recs, [2]int64{start, l.tail().end})
		}
		l.Close()
		path := segFiles(t, dir)[0]
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		end := recs[n-1][1]
		if len(appended) > 4096 {
			appended = appended[:4096]
		}
		copy(b[end:], appended)
		orig := bytes.Clone(b[:end])
		for i := 0; i+3 <= len(flips) && i < 30; i += 3 {
			b[int64(binary.LittleEndian.Uint16(flips[i:]))%end] ^= flips[i+2] | 1
		}
		// Flips may cancel out: what counts is which bytes differ.
		headerDamaged := !bytes.Equal(b[:segHeaderSize], orig[:segHeaderSize])
		damaged := map[int]bool{} // batches with a changed byte
		for j, r := range recs {
			damaged[j] = !bytes.Equal(b[r[0]:r[1]], orig[r[0]:r[1]])
		}
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
		firstBad := n
		for j := range n {
			if damaged[j] {
				firstBad = j
				break
			}
		}
		intactAfter := false
		for j := firstBad + 1; j < n; j++ {
			if !damaged[j] {
				intactAfter = true
			}
		}

		l, err = Open(dir, opts)
		if headerDamaged || intactAfter {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Open after damage to the header (%v) or to batch %d of %d with an intact one after it: %v, want ErrCorrupt",
					headerDamaged, firstBad, n, err)
			}
			return
		}
		if err != nil {
			t.Fatalf("Open with batches %d.. of %d damaged (and %d bytes after the end): %v", firstBad, n, len(appended), err)
		}
		var want uint64 // last index of batch firstBad-1
		for j := range firstBad {
			want += uint64(1 + j%4)
		}
		first := uint64(1)
		if want == 0 {
			first = 0
		}
		expect(t, l, first, want, term1)
		store(t, l, want+1, want+3, 1)
		l.Close()
		l = mustOpen(t, dir, opts)
		defer l.Close()
		expect(t, l, 1, want+3, term1)
	})
}

// BenchmarkOpen is the recovery of a log of 20,000 entries of 1 KB in batches of 8 (21 MB in
// three 8 MiB segments, the tail mostly preallocated zeros): every record read and verified,
// the index rebuilt.
//
//	go test ./cluster/wal -run X -bench Open -benchtime 10x
func BenchmarkOpen(b *testing.B) {
	dir := b.TempDir()
	l := mustOpen(b, dir, Options{SegmentSize: 8 << 20})
	data := make([]byte, 1024)
	for i := uint64(1); i <= 20000; i += 8 {
		var ls []*raft.Log
		for j := i; j < i+8; j++ {
			ls = append(ls, &raft.Log{Index: j, Term: 1, Data: data})
		}
		if err := l.StoreLogs(ls); err != nil {
			b.Fatal(err)
		}
	}
	l.Close()
	b.ResetTimer()
	for b.Loop() {
		l := mustOpen(b, dir, Options{SegmentSize: 8 << 20})
		l.Close()
	}
}
