package fsm

import (
	"bytes"
	"encoding/binary"
	"flag"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

var rewrite = flag.Bool("rewrite", false, "rewrite testdata/snapshot.golden from this build (only for a deliberate format change)")

// goldenHistory applies a fixed history that leaves every kind of remembered decision in the
// dedup table (admitted with and without leases, refunded, rate- and concurrency-limited),
// expired records in front of live ones, several clients, and leases and debits in the engine.
func goldenHistory(t *testing.T) *log {
	l := newLog(t)
	l.version = 1 // the history the golden file was written from: its waiting admissions are refused, not scheduled
	clients := []string{"c0", "client-1", "c2", "a-much-longer-client-identifier-3"}
	var leases []uint64
	for i := uint64(1); i <= 300; i++ {
		ts := time.Duration(i) * 50 * time.Millisecond
		c := clients[i%uint64(len(clients))]
		ops := []*fsmv1.Op{acquire(c, i, []string{"acme", "beta", "gamma"}[i%3], 1+i%2)}
		if i%4 == 0 {
			w := acquire(c, 1000+i, "acme", 1)
			w.GetAcquire().Admission.MaxWaitMs = 100 // a waiting denial is not remembered
			ops = append(ops, w)
		}
		if len(leases) > 1 && i%3 != 0 {
			ops = append(ops, &fsmv1.Op{Op: &fsmv1.Op_Release{Release: &fsmv1.Release{LeaseId: leases[0]}}})
			leases = leases[1:]
		}
		if i%5 == 0 {
			ops = append(ops, &fsmv1.Op{Op: &fsmv1.Op_Refund{Refund: &fsmv1.Refund{ClientId: clients[(i-1)%uint64(len(clients))], RequestId: i - 1}}})
		}
		if d := l.apply(ts, ops...).Ops[0].Decision; d.LeaseID != 0 {
			leases = append(leases, d.LeaseID)
		}
	}
	return l
}

// TestSnapshotGolden: a snapshot file written by the first build of this format restores, and
// this build writes the same history into exactly the same bytes.
func TestSnapshotGolden(t *testing.T) {
	const path = "testdata/snapshot.golden"
	l := goldenHistory(t)
	got := snapshotBytes(t, l.f)
	if *rewrite {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("this build writes a %d-byte snapshot of the golden history, different from the %d bytes of %s", len(got), len(want), path)
	}
	restored := New(Options{DedupWindow: 10 * time.Second})
	if err := restored.Restore(io.NopCloser(bytes.NewReader(want))); err != nil {
		t.Fatal(err)
	}
	if a, b := restored.Hash(), l.f.Hash(); a != b {
		t.Fatalf("restored hash %+v, want %+v", a, b)
	}
	if again := snapshotBytes(t, restored); !bytes.Equal(again, want) {
		t.Fatal("a restored replica snapshots into different bytes")
	}
}

// oneBufferSnapshot writes f's snapshot file the way the first build of the format did: one
// buffer, each decision re-encoded from its decoded value rather than copied.
func oneBufferSnapshot(t *testing.T, f *FSM) []byte {
	t.Helper()
	b := appendSnapshotHeader(nil, f.applied, int64(f.lastSweep))
	b, start := beginSection(b)
	b, err := f.engine.AppendBinary(b)
	if err != nil {
		t.Fatal(err)
	}
	endSection(b, start)
	b, start = beginSection(b)
	tb := f.dedup
	b = append(b, dedupFormat)
	b = binary.AppendUvarint(b, uint64(tb.len()))
	for seq := tb.head; seq < tb.next; seq++ {
		r := tb.recAt(seq)
		b = appendRecordHead(b, tb.clients[r.client&^refundedBit].id, r)
		d := tb.decision(seq)
		b = appendDecision(b, &d)
	}
	endSection(b, start)
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, crcTable))
}

// TestSnapshotMatchesOneBuffer: the sections written apart, presized, are byte for byte the
// file the one-buffer encoding writes, for the golden history and for a table of several
// chunks whose oldest live record is inside a chunk.
func TestSnapshotMatchesOneBuffer(t *testing.T) {
	l := goldenHistory(t)
	if got, want := snapshotBytes(t, l.f), oneBufferSnapshot(t, l.f); !bytes.Equal(got, want) {
		t.Fatalf("golden history: snapshot of %d bytes differs from the one-buffer encoding (%d bytes)", len(got), len(want))
	}
	f := bucketsFSM(t, 3*dedupChunk+100)
	f.dedup.expire(f.dedup.recAt(f.dedup.head+dedupChunk+7).expires - 1)
	if got, want := snapshotBytes(t, f), oneBufferSnapshot(t, f); !bytes.Equal(got, want) {
		t.Fatalf("%d records: snapshot of %d bytes differs from the one-buffer encoding (%d bytes)", f.dedup.len(), len(got), len(want))
	}
}

// TestPersistAfterLaterApplies: Persist writes the state as of Snapshot, whatever was applied
// since — while Persist runs (go test -race checks that it reads nothing shared) and after
// expiry recycled the chunks the snapshot was taken from and refunds flagged its records.
func TestPersistAfterLaterApplies(t *testing.T) {
	l := goldenHistory(t)
	want := snapshotBytes(t, l.f)
	snap, err := l.f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	var sink memSink
	done := make(chan error, 1)
	go func() { done <- snap.Persist(&sink) }()
	for i := uint64(1); i <= 50; i++ {
		l.apply(time.Duration(20+i)*time.Second, acquire("c0", 5000+i, "acme", 1),
			&fsmv1.Op{Op: &fsmv1.Op_Refund{Refund: &fsmv1.Refund{ClientId: "c0", RequestId: 5000 + i - 1}}})
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(sink.Bytes(), want) {
		t.Fatal("the persisted snapshot changed with applies after Snapshot")
	}
}

// TestRestoreRefusesDamagedFiles: a snapshot cut short anywhere, with any byte changed, or
// with bytes after its checksum is refused, and the state is left alone.
func TestRestoreRefusesDamagedFiles(t *testing.T) {
	good, err := os.ReadFile("testdata/snapshot.golden")
	if err != nil {
		t.Fatal(err)
	}
	l := newLog(t)
	l.apply(time.Millisecond, acquire("c1", 1, "acme", 1))
	before := l.f.Hash()
	refused := func(what string, data []byte) {
		t.Helper()
		if err := l.f.Restore(io.NopCloser(bytes.NewReader(data))); err == nil {
			t.Fatalf("%s: restored", what)
		}
	}
	// Every position in the header, around the dedup section's start and at the end; every
	// 13th elsewhere.
	dedupAt := snapshotHeader + int(binary.LittleEndian.Uint64(good[snapshotHeader-8:]))
	for n := 0; n < len(good); n++ {
		if n > snapshotHeader+8 && (n < dedupAt-8 || n > dedupAt+24) && n < len(good)-16 && n%13 != 0 {
			continue
		}
		refused(fmt.Sprintf("cut to %d bytes", n), good[:n])
		bad := bytes.Clone(good)
		bad[n] ^= 0x5a
		refused(fmt.Sprintf("byte %d changed", n), bad)
	}
	refused("a byte after the checksum", append(bytes.Clone(good), 0))
	if l.f.Hash() != before {
		t.Fatal("a refused snapshot changed the state")
	}
}

// reframe replaces the dedup section of a snapshot file and recomputes the checksum.
func reframe(file []byte, dedup []byte) []byte {
	engineLen := binary.LittleEndian.Uint64(file[snapshotHeader-8:])
	b := bytes.Clone(file[:snapshotHeader+engineLen])
	b = binary.LittleEndian.AppendUint64(b, uint64(len(dedup)))
	b = append(b, dedup...)
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, crcTable))
}

// TestRestoreDedupSection: a dedup section that does not decode is refused even with a valid
// checksum; bytes after its last record are ignored, as they always were.
func TestRestoreDedupSection(t *testing.T) {
	good, err := os.ReadFile("testdata/snapshot.golden")
	if err != nil {
		t.Fatal(err)
	}
	l := goldenHistory(t)
	section := l.f.dedup.appendTo(nil)
	f := New(Options{})
	for _, bad := range [][]byte{nil, {dedupFormat}, {dedupFormat + 1, 0}, section[:len(section)-1]} {
		if err := f.Restore(io.NopCloser(bytes.NewReader(reframe(good, bad)))); err == nil {
			t.Fatalf("a dedup section of %d bytes (%x...) was restored", len(bad), bad[:min(len(bad), 4)])
		}
	}
	if err := f.Restore(io.NopCloser(bytes.NewReader(reframe(good, append(bytes.Clone(section), 1, 2, 3))))); err != nil {
		t.Fatal(err)
	}
	if a, b := f.Hash(), l.f.Hash(); a != b {
		t.Fatalf("restored hash %+v, want %+v", a, b)
	}
}

// TestPersistLargeStateAfterChanges: with several chunks of buckets and dedup records, a
// snapshot persisted after the state changed everywhere it shares (buckets debited and dropped,
// records refunded, the captured dedup chunks expired and new records written), and one
// persisted while those changes are applied (go test -race), both write the captured state.
func TestPersistLargeStateAfterChanges(t *testing.T) {
	t.Run("index grows in place", testPersistLargeStateAfterChanges)
	t.Run("index grows in the background", func(t *testing.T) {
		// The growing index's capture and the snapshot's overlap and are released in either order.
		defer func(v int) { backgroundGrowthSlots = v }(backgroundGrowthSlots)
		backgroundGrowthSlots = 1024
		testPersistLargeStateAfterChanges(t)
	})
}

func testPersistLargeStateAfterChanges(t *testing.T) {
	const n = 3*dedupChunk + 100
	f := bucketsFSM(t, n)
	var index uint64 = 1 << 20
	ts := int64(time.Hour + time.Second) // within the dedup window of the populating admissions
	applyData := func(data []byte) {
		index++
		f.ApplyBatch([]*raft.Log{{Index: index, Term: 1, Type: raft.LogCommand, Data: data}})
	}
	apply := func(ops ...*fsmv1.Op) {
		data, err := Encode(&fsmv1.Command{Ts: ts, Ops: ops})
		if err != nil {
			t.Fatal(err)
		}
		applyData(data)
	}
	change := func(round int) {
		for i := 0; i < n; i += 7 {
			// Refund an admission in a captured dedup chunk, debit its bucket again.
			apply(&fsmv1.Op{Op: &fsmv1.Op_Refund{Refund: &fsmv1.Refund{ClientId: "bench-populate", RequestId: uint64(i + 1)}}},
				&fsmv1.Op{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{ClientId: fmt.Sprintf("r%d", round), Admission: &quotadv1.Admission{
					RequestId: uint64(i + 1), Domain: "buckets", Cost: 1, Attempt: 1,
					Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: fmt.Sprintf("t%07d", i)}},
				}}}})
		}
		// Everything expires and refills: chunks are recycled and buckets dropped.
		ts += int64(time.Hour)
		applyData(f.EncodeTick(ts, 0))
		for i := 0; i < dedupChunk+10; i++ {
			apply(&fsmv1.Op{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{ClientId: fmt.Sprintf("n%d", round), Admission: &quotadv1.Admission{
				RequestId: uint64(i + 1), Domain: "buckets", Cost: 1, Attempt: 1,
				Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: fmt.Sprintf("u%07d", i)}},
			}}}})
		}
	}

	want := snapshotBytes(t, f)
	snap, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	change(0)
	var sink memSink
	if err := snap.Persist(&sink); err != nil {
		t.Fatal(err)
	}
	snap.Release()
	if !bytes.Equal(sink.Bytes(), want) {
		t.Fatalf("the snapshot persisted after changes (%d bytes) is not the state captured (%d bytes)", sink.Len(), len(want))
	}

	want = snapshotBytes(t, f)
	if snap, err = f.Snapshot(); err != nil {
		t.Fatal(err)
	}
	sink.Reset()
	done := make(chan error, 1)
	go func() { done <- snap.Persist(&sink) }()
	change(1)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	snap.Release()
	if !bytes.Equal(sink.Bytes(), want) {
		t.Fatal("the snapshot persisted during changes is not the state captured")
	}
	// And it restores to the state it captured.
	g := New(Options{})
	if err := g.Restore(io.NopCloser(bytes.NewReader(want))); err != nil {
		t.Fatal(err)
	}
	if got := snapshotBytes(t, g); !bytes.Equal(got, want) {
		t.Fatal("restoring the snapshot and taking another gives different bytes")
	}
}
