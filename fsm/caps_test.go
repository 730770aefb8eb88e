package fsm

import (
	"bytes"
	"io"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
	"unsafe"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	"github.com/quotad/quotad/quota"
)

// TestRequestIDConflict: a request ID reused for a different request gets request_id_conflict,
// not the first decision, and changes nothing; an identical retry still gets the original.
func TestRequestIDConflict(t *testing.T) {
	l := newLog(t)
	first := l.apply(time.Millisecond, acquire("c1", 1, "acme", 1)).Ops[0]
	if !first.Decision.Admitted {
		t.Fatalf("first: %+v", first)
	}
	variants := map[string]func(op *fsmv1.Op){
		"tenant":      func(op *fsmv1.Op) { op.GetAcquire().Admission.Descriptors[0].Value = "beta" },
		"cost":        func(op *fsmv1.Op) { op.GetAcquire().Admission.Cost = 2 },
		"domain":      func(op *fsmv1.Op) { op.GetAcquire().Admission.Domain = "other" },
		"lease_ttl":   func(op *fsmv1.Op) { op.GetAcquire().Admission.LeaseTtlMs = 1000 },
		"attempt":     func(op *fsmv1.Op) { op.GetAcquire().Admission.Attempt = 2 },
		"work_class":  func(op *fsmv1.Op) { op.GetAcquire().Admission.WorkClass = "backfill" },
		"descriptors": func(op *fsmv1.Op) { op.GetAcquire().Admission.Descriptors = nil },
	}
	for name, change := range variants {
		before := l.f.Hash()
		op := acquire("c1", 1, "acme", 1)
		change(op)
		r := l.apply(time.Millisecond, op).Ops[0]
		d := r.Decision
		if d.Admitted || r.Duplicate || d.Reason != quota.ReasonRequestIDConflict || d.LeaseID != 0 ||
			!strings.Contains(d.Message, "request_id 1 of client_id \"c1\" was already used for a different request") {
			t.Errorf("%s changed: %+v", name, r)
		}
		if after := l.f.Hash(); after.Hash != before.Hash {
			t.Errorf("%s: a conflicting reuse changed the state", name)
		}
	}
	// Equivalent spellings are the same request: cost 0 is 1, attempt 0 is 1, max_wait differs.
	same := acquire("c1", 1, "acme", 0)
	same.GetAcquire().Admission.Attempt = 1
	same.GetAcquire().Admission.MaxWaitMs = 50
	r := l.apply(2*time.Millisecond, same).Ops[0]
	if !r.Duplicate || r.Decision.LeaseID != first.Decision.LeaseID {
		t.Fatalf("identical retry: %+v, want the original %+v", r, first)
	}
	// The fingerprint survives a snapshot.
	restored := New(Options{DedupWindow: 10 * time.Second})
	if err := restored.Restore(io.NopCloser(bytes.NewReader(snapshotBytes(t, l.f)))); err != nil {
		t.Fatal(err)
	}
	if a, b := restored.Hash(), l.f.Hash(); a != b {
		t.Fatalf("restored hash %+v, want %+v", a, b)
	}
	rl := &log{t: t, f: restored, index: l.index}
	if d := rl.apply(3*time.Millisecond, acquire("c1", 1, "beta", 1)).Ops[0].Decision; d.Reason != quota.ReasonRequestIDConflict {
		t.Fatalf("restored replica, conflicting reuse: %+v", d)
	}
}

// TestDedupFormat2Restores: a snapshot whose dedup section has no fingerprints (format 2, the
// previous build's) restores; its records answer retries as before and are never conflicts.
func TestDedupFormat2Restores(t *testing.T) {
	old, err := os.ReadFile("testdata/snapshot_dedup2.golden")
	if err != nil {
		t.Fatal(err)
	}
	f := New(Options{DedupWindow: 10 * time.Second})
	if err := f.Restore(io.NopCloser(bytes.NewReader(old))); err != nil {
		t.Fatal(err)
	}
	if f.Stats().DedupEntries == 0 {
		t.Fatal("no dedup records restored")
	}
	for seq := f.dedup.head; seq < f.dedup.next; seq++ {
		if fp := f.dedup.fingerprint(seq); fp != 0 {
			t.Fatalf("record %d restored from format 2 has fingerprint %x", seq, fp)
		}
	}
	// Written again, the section is format 3.
	if b := snapshotBytes(t, f); !bytes.Contains(b, []byte{dedupFormat}) {
		t.Fatal("no format 3 section")
	}
}

func TestOversizedClientIDIsInvalid(t *testing.T) {
	l := newLog(t)
	before := l.f.Hash()
	d := l.apply(0, acquire(strings.Repeat("c", quota.MaxFieldBytes+1), 1, "acme", 1)).Ops[0].Decision
	if d.Reason != quota.ReasonInvalid || !strings.Contains(d.Message, "client_id is 257 bytes; the limit is 256") {
		t.Fatalf("%+v", d)
	}
	op := acquire("c1", 2, "acme", 1)
	op.GetAcquire().Admission.WorkClass = strings.Repeat("w", 4<<20)
	if d := l.apply(0, op).Ops[0].Decision; d.Reason != quota.ReasonInvalid || !strings.Contains(d.Message, "work_class is 4194304 bytes") {
		t.Fatalf("4 MB work class: %+v", d)
	}
	if l.f.Hash().Hash != before.Hash || l.f.Stats().DedupEntries != 0 {
		t.Fatal("an invalid admission changed the state")
	}
}

// TestDedupBytesPerRecord reports the live heap of the dedup table per remembered admission
// (records, decisions, index) at 300K records: run with -v to see it.
func TestDedupBytesPerRecord(t *testing.T) {
	if testing.Short() {
		t.Skip("fills 300K records")
	}
	const n = 300_000
	f := bucketsFSM(t, n)
	full := liveHeap()
	f.mu.Lock()
	f.dedup = newDedupTable()
	f.mu.Unlock()
	noDedup := liveHeap()
	perRecord := float64(full-noDedup) / n
	t.Logf("dedup table: %.1f B/record (record struct %d B)", perRecord, recordSize)
	if perRecord > 400 {
		t.Fatalf("%.1f B per dedup record", perRecord)
	}
	runtime.KeepAlive(f)
}

const recordSize = 32

func TestRecordSize(t *testing.T) {
	if got := int(unsafeSizeof(dedupRecord{})); got != recordSize {
		t.Fatalf("dedupRecord is %d bytes, want %d", got, recordSize)
	}
}

func unsafeSizeof(r dedupRecord) uintptr { return unsafe.Sizeof(r) }

// TestTooManyKeysLeavesNoState: a too_many_keys denial is not remembered (like invalid), so
// a flood of invented keys leaves nothing behind, not even dedup records.
func TestTooManyKeysLeavesNoState(t *testing.T) {
	l := newLog(t)
	lim := *testLimits
	lim.Domains = []quota.Domain{testLimits.Domains[0]}
	lim.Domains[0].MaxKeys = 2 // the ceiling and one tenant
	if r := l.apply(0, setLimits(t, &lim)); r.Ops[0].Other.Err != nil {
		t.Fatal(r.Ops[0].Other.Err)
	}
	if d := l.apply(time.Millisecond, acquire("c", 1, "a", 1)).Ops[0].Decision; !d.Admitted {
		t.Fatalf("first tenant: %+v", d)
	}
	before := l.f.Stats()
	if d := l.apply(time.Millisecond, acquire("c", 2, "b", 1)).Ops[0].Decision; d.Reason != quota.ReasonTooManyKeys {
		t.Fatalf("second tenant: %+v", d)
	}
	if after := l.f.Stats(); after != before {
		t.Fatalf("a too_many_keys denial left state: %+v -> %+v", before, after)
	}
}
