package cluster

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"

	"github.com/quotad/quotad/cluster/wal"
)

var backends = []string{LogStoreBoltDB, LogStoreWAL}

// entryData is the deterministic payload of log entry index in these tests (term 1): 100 B to
// ~8 KB, no zero bytes, so a reader can tell any entry's content from its index.
func entryData(index uint64, term uint64) []byte {
	n := 100 + int(index*7919%8000)
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(1 + (index+uint64(i)+term*31)%250)
	}
	return b
}

type testStores struct {
	stable *raftboltdb.BoltStore
	logs   raft.LogStore
	close  func() error
}

func openTestStores(t testing.TB, dir, backend string, segmentSize int) testStores {
	t.Helper()
	s, err := tryOpenTestStores(dir, backend, segmentSize)
	if err != nil {
		t.Fatalf("open %s log store in %s: %v", backend, dir, err)
	}
	return s
}

func tryOpenTestStores(dir, backend string, segmentSize int) (testStores, error) {
	return tryOpenTestStoresWith(dir, backend, wal.Options{SegmentSize: int64(segmentSize)})
}

func tryOpenTestStoresWith(dir, backend string, opts wal.Options) (testStores, error) {
	stable, logs, w, err := openLogStoreWith(dir, backend, opts)
	if err != nil {
		return testStores{}, err
	}
	return testStores{stable: stable, logs: logs, close: func() error {
		var errs []error
		if w != nil {
			errs = append(errs, w.Close())
		}
		errs = append(errs, stable.Close())
		return errors.Join(errs...)
	}}, nil
}

func storeRange(t testing.TB, s raft.LogStore, from, to, term uint64, maxBatch int, rng *rand.Rand) {
	t.Helper()
	for i := from; i <= to; {
		n := uint64(1 + rng.IntN(maxBatch))
		var logs []*raft.Log
		for ; n > 0 && i <= to; n-- {
			logs = append(logs, &raft.Log{Index: i, Term: term, Type: raft.LogCommand, Data: entryData(i, term)})
			i++
		}
		if err := s.StoreLogs(logs); err != nil {
			t.Fatalf("StoreLogs [%d, %d]: %v", logs[0].Index, logs[len(logs)-1].Index, err)
		}
	}
}

// checkLog verifies that s holds exactly [first, last] and that every entry has its index's
// payload (term 1 up to termChange-1, term 2 from termChange on).
func checkLog(t testing.TB, s raft.LogStore, first, last, termChange uint64) {
	t.Helper()
	f, err := s.FirstIndex()
	if err != nil {
		t.Fatal(err)
	}
	l, err := s.LastIndex()
	if err != nil {
		t.Fatal(err)
	}
	if f != first || l != last {
		t.Fatalf("log holds [%d, %d], want [%d, %d]", f, l, first, last)
	}
	for i := first; i <= last && last > 0; i++ {
		term := uint64(1)
		if termChange > 0 && i >= termChange {
			term = 2
		}
		var e raft.Log
		if err := s.GetLog(i, &e); err != nil {
			t.Fatalf("GetLog(%d): %v", i, err)
		}
		if e.Index != i || e.Term != term || !bytes.Equal(e.Data, entryData(i, term)) {
			t.Fatalf("entry %d: index %d term %d, %d bytes; want term %d and its %d bytes",
				i, e.Index, e.Term, len(e.Data), term, len(entryData(i, term)))
		}
	}
	if first > 1 {
		var e raft.Log
		if err := s.GetLog(first-1, &e); !errors.Is(err, raft.ErrLogNotFound) {
			t.Fatalf("GetLog(%d) below the first index: %v, want ErrLogNotFound", first-1, err)
		}
	}
	var e raft.Log
	if err := s.GetLog(last+1, &e); !errors.Is(err, raft.ErrLogNotFound) {
		t.Fatalf("GetLog(%d) past the last index: %v, want ErrLogNotFound", last+1, err)
	}
}

// TestLogStoreAppendReadDelete runs what raft does to a log store on real files, for both
// backends: appends in batches, reads, compaction (head DeleteRange), conflict truncation
// (tail DeleteRange) and appending a different term over it, reopen, the stable store, and
// the whole log deleted then restarted at a later index (what raft does after installing a
// snapshot into a monotonic store). The WAL uses 64 KB segments so it rotates many times.
func TestLogStoreAppendReadDelete(t *testing.T) {
	t.Parallel()
	for _, backend := range backends {
		t.Run(backend, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			rng := rand.New(rand.NewPCG(1, 2))
			s := openTestStores(t, dir, backend, 64<<10)
			storeRange(t, s.logs, 1, 300, 1, 17, rng)
			checkLog(t, s.logs, 1, 300, 0)

			if err := s.logs.DeleteRange(1, 120); err != nil { // compaction after a snapshot
				t.Fatal(err)
			}
			checkLog(t, s.logs, 121, 300, 0)
			if err := s.logs.DeleteRange(281, 300); err != nil { // a follower drops a conflicting suffix
				t.Fatal(err)
			}
			checkLog(t, s.logs, 121, 280, 0)
			storeRange(t, s.logs, 281, 310, 2, 5, rng)
			checkLog(t, s.logs, 121, 310, 281)
			if err := s.stable.SetUint64([]byte("CurrentTerm"), 2); err != nil {
				t.Fatal(err)
			}
			if err := s.stable.Set([]byte("LastVoteCand"), []byte("node1")); err != nil {
				t.Fatal(err)
			}
			if err := s.close(); err != nil {
				t.Fatal(err)
			}

			s = openTestStores(t, dir, backend, 64<<10)
			defer s.close()
			checkLog(t, s.logs, 121, 310, 281)
			if term, err := s.stable.GetUint64([]byte("CurrentTerm")); err != nil || term != 2 {
				t.Fatalf("CurrentTerm after reopen: %d, %v; want 2", term, err)
			}
			if v, err := s.stable.Get([]byte("LastVoteCand")); err != nil || string(v) != "node1" {
				t.Fatalf("LastVoteCand after reopen: %q, %v", v, err)
			}

			// A snapshot install into a monotonic store: raft deletes everything, then appends
			// from the snapshot's index + 1.
			mono := false
			if m, ok := s.logs.(raft.MonotonicLogStore); ok {
				mono = m.IsMonotonic()
			}
			if want := backend == LogStoreWAL; mono != want {
				t.Fatalf("%s IsMonotonic %v, want %v", backend, mono, want)
			}
			cache, err := raft.NewLogCache(16, s.logs)
			if err != nil {
				t.Fatal(err)
			}
			if cache.IsMonotonic() != mono {
				t.Fatalf("the LogCache hides IsMonotonic of the %s store", backend)
			}
			if err := s.logs.DeleteRange(121, 310); err != nil {
				t.Fatal(err)
			}
			checkLog(t, s.logs, 0, 0, 0)
			storeRange(t, s.logs, 1000, 1040, 2, 4, rng)
			checkLog(t, s.logs, 1000, 1040, 1)

			if backend == LogStoreWAL {
				segs, _ := filepath.Glob(filepath.Join(dir, walLogDir, "*.wal"))
				if len(segs) == 0 {
					t.Fatalf("no segment files in %s", filepath.Join(dir, walLogDir))
				}
				if _, err := os.Stat(filepath.Join(dir, boltLogFile)); !errors.Is(err, os.ErrNotExist) {
					t.Fatalf("wal backend created %s (stat: %v)", boltLogFile, err)
				}
			}
		})
	}
}

// TestWALTornTailRecovery damages the last append of a closed WAL the ways a crash during
// the write can leave it — the batch cut off, its commit frame missing, a byte of it wrong — and
// reopens: the WAL must come back with exactly the batches before it (the damaged one was never
// acknowledged), read them intact, and take new appends after them.
func TestWALTornTailRecovery(t *testing.T) {
	t.Parallel()
	const seg = 1 << 20 // one segment: no rotation, the file is the whole log
	base := t.TempDir()
	rng := rand.New(rand.NewPCG(3, 4))
	s := openTestStores(t, base, LogStoreWAL, seg)
	storeRange(t, s.logs, 1, 40, 1, 6, rng)
	if err := s.close(); err != nil {
		t.Fatal(err)
	}
	segs, err := filepath.Glob(filepath.Join(base, walLogDir, "*.wal"))
	if err != nil || len(segs) != 1 {
		t.Fatalf("segment files %v, %v; want one", segs, err)
	}
	before, err := os.ReadFile(segs[0])
	if err != nil {
		t.Fatal(err)
	}
	// The last batch: entries 41..45 in one append.
	s = openTestStores(t, base, LogStoreWAL, seg)
	storeRange(t, s.logs, 41, 45, 1, 1000, rng)
	if err := s.close(); err != nil {
		t.Fatal(err)
	}
	after, err := os.ReadFile(segs[0])
	if err != nil {
		t.Fatal(err)
	}
	start, end := -1, -1
	for i := range after {
		if i >= len(before) || after[i] != before[i] {
			if start < 0 {
				start = i
			}
			end = i + 1
		}
	}
	if start < 0 || end-start < 5*100 {
		t.Fatalf("the last append changed bytes [%d, %d) of the segment; want a batch of 5 entries", start, end)
	}
	t.Logf("last batch at bytes [%d, %d) of %s", start, end, filepath.Base(segs[0]))

	for _, tc := range []struct {
		name     string
		damage   func(b []byte)
		wantLast uint64
	}{
		{"intact", func([]byte) {}, 45},
		{"cut mid-batch", func(b []byte) { clear(b[start+(end-start)/2 : end]) }, 40},
		{"commit frame missing", func(b []byte) { clear(b[end-8 : end]) }, 40},
		{"only the first bytes written", func(b []byte) { clear(b[start+1 : end]) }, 40},
		{"byte flipped in the batch", func(b []byte) { b[start+(end-start)/3] ^= 0x5a }, 40},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			copyDir(t, base, dir)
			b := bytes.Clone(after)
			tc.damage(b)
			if err := os.WriteFile(filepath.Join(dir, walLogDir, filepath.Base(segs[0])), b, 0o644); err != nil {
				t.Fatal(err)
			}
			s := openTestStores(t, dir, LogStoreWAL, seg)
			checkLog(t, s.logs, 1, tc.wantLast, 0)
			storeRange(t, s.logs, tc.wantLast+1, tc.wantLast+10, 1, 3, rng)
			if err := s.close(); err != nil {
				t.Fatal(err)
			}
			s = openTestStores(t, dir, LogStoreWAL, seg)
			defer s.close()
			checkLog(t, s.logs, 1, tc.wantLast+10, 0)
		})
	}
}

// TestWALGetLogBelowFirstIndex: after a compaction, entries below FirstIndex are gone for
// raft, also while they are still in the WAL's tail segment (as with BoltDB, so a lagging
// follower gets the snapshot).
func TestWALGetLogBelowFirstIndex(t *testing.T) {
	t.Parallel()
	s := openTestStores(t, t.TempDir(), LogStoreWAL, 4<<20)
	defer s.close()
	storeRange(t, s.logs, 1, 100, 1, 10, rand.New(rand.NewPCG(7, 8)))
	if err := s.logs.DeleteRange(1, 50); err != nil {
		t.Fatal(err)
	}
	checkLog(t, s.logs, 51, 100, 0)
	var e raft.Log
	if err := s.logs.GetLog(10, &e); !errors.Is(err, raft.ErrLogNotFound) {
		t.Fatalf("GetLog(10) after DeleteRange(1, 50): %v, want ErrLogNotFound", err)
	}
}

func copyDir(t *testing.T, from, to string) {
	t.Helper()
	err := filepath.WalkDir(from, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(from, path)
		if d.IsDir() {
			return os.MkdirAll(filepath.Join(to, rel), 0o755)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(to, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// Environment of the writer process (TestLogStoreWriterProcess) that the crash tests start
// from the test binary and kill.
const (
	childEnv = "QUOTAD_LOGSTORE_WRITER" // backend,dir: be the writer
	// crashEnv = point:n makes the WAL writer SIGKILL itself the n-th time it reaches point
	// (wal.Options.CrashHook).
	crashEnv = "QUOTAD_WAL_CRASH"
)

// writerState is what the parent knows from a writer's output: each line is printed before
// (truncate, reset) or after (acked) the operation it names, so mustHave is a lower bound on
// the last index that must survive any crash (0: nothing is owed, the log may be empty).
type writerState struct {
	mustHave uint64 // the log must hold [first, mustHave] with first <= mustHave
	lines    int
}

func (w *writerState) read(line string) error {
	verb, arg, _ := strings.Cut(line, " ")
	n, err := strconv.ParseUint(arg, 10, 64)
	if err != nil {
		return fmt.Errorf("writer printed %q", line)
	}
	switch verb {
	case "acked": // StoreLogs up to n returned
		if w.mustHave != 0 && n <= w.mustHave {
			return fmt.Errorf("writer acknowledged %d after %d", n, w.mustHave)
		}
		w.mustHave = n
	case "truncate": // about to delete the suffix after n (a conflict)
		w.mustHave = min(w.mustHave, n)
	case "reset": // about to delete the whole log (a snapshot install), then append from n
		w.mustHave = 0
	default:
		return fmt.Errorf("writer printed %q", line)
	}
	w.lines++
	return nil
}

// runWriter starts the writer process on dir with extra environment, reads its output into st
// and kills it after killAfter lines (0: let it run until it dies by itself, as a crash hook
// makes it). It returns the number of lines read and whether the process died by SIGKILL.
func runWriter(t *testing.T, backend, dir string, env []string, killAfter int, st *writerState) (lines int, killed bool) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestLogStoreWriterProcess$", "-test.v=false")
	cmd.Env = append(append(os.Environ(), childEnv+"="+backend+","+dir), env...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if err := st.read(sc.Text()); err != nil {
			_ = cmd.Process.Kill()
			t.Fatal(err)
		}
		if lines++; lines == killAfter {
			_ = cmd.Process.Signal(syscall.SIGKILL)
		}
	}
	err = cmd.Wait()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
			return lines, true
		}
	}
	t.Fatalf("writer exited after %d lines without being killed: %v\n%s", lines, err, stderr.String())
	return lines, false
}

// checkAfterCrash reopens dir and checks it against what the writer acknowledged: every entry
// up to mustHave is there, every entry has its payload, and the log is contiguous.
func checkAfterCrash(t *testing.T, backend, dir string, st *writerState, what string) {
	t.Helper()
	s := openTestStores(t, dir, backend, 256<<10)
	defer s.close()
	first, _ := s.logs.FirstIndex()
	last, _ := s.logs.LastIndex()
	if st.mustHave > 0 && (last < st.mustHave || first > st.mustHave) {
		t.Fatalf("%s: the log is [%d, %d], but the writer had acknowledged everything up to %d", what, first, last, st.mustHave)
	}
	checkLog(t, s.logs, first, last, 0)
	t.Logf("%s: log [%d, %d], owed up to %d", what, first, last, st.mustHave)
	st.mustHave = last
}

// TestLogStoreSurvivesKill9 kills a separate process that writes to a real log store what raft
// writes (batches of 1–8 entries of up to 8 KB; a compaction every 40 batches; a conflict
// truncation of a few entries every 97; every 331 the whole log deleted and appends going on
// 500 indexes later, as after a snapshot install; 256 KB WAL segments, so rotations happen
// too) with SIGKILL at a random point, five times in a row, each time reopening the store:
// every append the writer saw acknowledged must be there with its exact payload, and the next
// writer continues after the last entry. The writer is almost always inside a write
// (fsync-bound), so most kills land mid-operation. A killed process leaves its writes in the
// page cache, so this checks what a process crash leaves (operations cut short between their
// steps); what a power loss leaves (a torn write on disk) is TestWALTornTailRecovery's and
// the wal package's fuzz test's. TestWALCrashPoints kills at each step on purpose.
func TestLogStoreSurvivesKill9(t *testing.T) {
	t.Parallel()
	for _, backend := range backends {
		t.Run(backend, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 5))
			var st writerState
			for round := range 5 {
				killAfter := 30 + rng.IntN(400) // lines (mostly acknowledged batches) before the kill
				lines, _ := runWriter(t, backend, dir, nil, killAfter, &st)
				checkAfterCrash(t, backend, dir, &st, fmt.Sprintf("round %d (killed after %d lines)", round, lines))
			}
		})
	}
}

// TestWALCrashPoints kills the WAL writer process exactly at each step of its durable
// operations — a record written but not yet synced (append, clamp), a new segment synced
// under its temporary name, renamed, the directory synced, a segment removed by compaction
// or a whole-log delete — at the n-th time it gets there, then reopens: nothing acknowledged
// may be lost, the log must be consistent, and a new writer must be able to go on appending
// (it runs until killed again) and reopen.
func TestWALCrashPoints(t *testing.T) {
	t.Parallel()
	points := []string{"append:written", "clamp:written", "segment:synced", "segment:renamed",
		"segment:dir-synced", "segment:removed"}
	for _, point := range points {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			var st writerState
			for i, n := range []int{1, 3, 7} {
				runWriter(t, LogStoreWAL, dir, []string{fmt.Sprintf("%s=%s:%d", crashEnv, point, n)}, 0, &st)
				checkAfterCrash(t, LogStoreWAL, dir, &st, fmt.Sprintf("killed at %s #%d", point, n))
				// A writer without the crash point goes on from there.
				runWriter(t, LogStoreWAL, dir, nil, 20+10*i, &st)
				checkAfterCrash(t, LogStoreWAL, dir, &st, "then killed at random")
			}
		})
	}
}

// TestLogStoreWriterProcess is the writer process of the crash tests (it skips unless started
// by one). It prints "acked N" after each StoreLogs up to N returned, "truncate M" before
// deleting the suffix after M, "reset J" before deleting the whole log and going on at J.
func TestLogStoreWriterProcess(t *testing.T) {
	spec := os.Getenv(childEnv)
	if spec == "" {
		t.Skip("the writer process of the log store crash tests")
	}
	backend, dir, _ := strings.Cut(spec, ",")
	opts := wal.Options{SegmentSize: 256 << 10}
	if c := os.Getenv(crashEnv); c != "" {
		i := strings.LastIndexByte(c, ':')
		point := c[:i]
		n, _ := strconv.Atoi(c[i+1:])
		hits := 0
		opts.CrashHook = func(p string) {
			if p == point {
				if hits++; hits == n {
					_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
					select {}
				}
			}
		}
	}
	s, err := tryOpenTestStoresWith(dir, backend, opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, "writer:", err)
		os.Exit(2)
	}
	fail := func(what string, err error) {
		fmt.Fprintf(os.Stderr, "writer: %s: %v\n", what, err)
		os.Exit(2)
	}
	last, _ := s.logs.LastIndex()
	rng := rand.New(rand.NewPCG(uint64(os.Getpid()), 6))
	deadline := time.Now().Add(60 * time.Second)
	for b := 1; time.Now().Before(deadline); b++ {
		n := 1 + rng.IntN(8)
		logs := make([]*raft.Log, n)
		for i := range logs {
			last++
			logs[i] = &raft.Log{Index: last, Term: 1, Type: raft.LogCommand, Data: entryData(last, 1)}
		}
		if err := s.logs.StoreLogs(logs); err != nil {
			fail("StoreLogs", err)
		}
		fmt.Fprintf(os.Stdout, "acked %d\n", last) // os.Stdout is unbuffered
		first, _ := s.logs.FirstIndex()
		switch {
		case b%331 == 0: // a snapshot install: everything goes, appends go on further up
			fmt.Fprintf(os.Stdout, "reset %d\n", last+500)
			if err := s.logs.DeleteRange(first, last); err != nil {
				fail("DeleteRange (all)", err)
			}
			last += 499
		case b%97 == 0 && last > first+20: // a conflict: drop a few entries at the end
			keep := last - uint64(1+rng.IntN(20))
			fmt.Fprintf(os.Stdout, "truncate %d\n", keep)
			if err := s.logs.DeleteRange(keep+1, last); err != nil {
				fail("DeleteRange (suffix)", err)
			}
			last = keep
		case b%40 == 0 && last > first+100: // compaction after a snapshot
			if err := s.logs.DeleteRange(first, last-100); err != nil {
				fail("DeleteRange (prefix)", err)
			}
		}
	}
	os.Exit(3) // never killed: the parent reports it
}

// BenchmarkLogStoreAppend is one StoreLogs of one entry at a time, fsync on, as the leader
// and each follower do for a serial decision — the raw cost of the backends on this disk.
// wal-grow is the WAL without preallocated segments (wal.Options.NoPreallocate).
//
//	go test ./cluster -run X -bench LogStoreAppend -benchtime 2s
func BenchmarkLogStoreAppend(b *testing.B) {
	for _, size := range []int{1 << 10, 20 << 10} {
		for _, v := range []struct {
			name, backend string
			opts          wal.Options
		}{
			{LogStoreBoltDB, LogStoreBoltDB, wal.Options{}},
			{LogStoreWAL, LogStoreWAL, wal.Options{}},
			{"wal-grow", LogStoreWAL, wal.Options{NoPreallocate: true}},
		} {
			b.Run(fmt.Sprintf("%s/%dKB", v.name, size>>10), func(b *testing.B) {
				s, err := tryOpenTestStoresWith(b.TempDir(), v.backend, v.opts)
				if err != nil {
					b.Fatal(err)
				}
				defer s.close()
				data := make([]byte, size)
				var index uint64
				b.SetBytes(int64(size))
				for b.Loop() {
					index++
					if err := s.logs.StoreLogs([]*raft.Log{{Index: index, Term: 1, Type: raft.LogCommand, Data: data}}); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// TestHashicorpWALDataDirRefused: a data dir written by the hashicorp/raft-wal variant of
// --raft-log-store wal (an earlier development build) is refused with what to do, untouched.
func TestHashicorpWALDataDirRefused(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, walLogDir), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{hashicorpWALMeta, "00000000000000000001-0000000000000001.wal"} {
		if err := os.WriteFile(filepath.Join(dir, walLogDir, name), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	_, err := tryOpenTestStores(dir, LogStoreWAL, 1<<20)
	if !errors.Is(err, ErrLogStoreMismatch) {
		t.Fatalf("open: %v, want ErrLogStoreMismatch", err)
	}
	for _, want := range []string{"hashicorp/raft-wal", "wal-meta.db", "empty --data-dir", dir} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not say %q: %v", want, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, walStable)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused open created %s", walStable)
	}
}
