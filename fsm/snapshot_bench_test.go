package fsm

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"runtime"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/quota"
)

// bucketsLimits is the bench tool's "buckets" domain: one small bucket per tenant, so every
// admission of a new tenant adds a bucket, and every admission is remembered.
var bucketsLimits = &quota.Limits{Domains: []quota.Domain{{
	Name:    "buckets",
	MaxKeys: 4 << 20, // the default 100000 would refuse most of them (too_many_keys)
	Descriptors: []quota.Node{{
		Key:  "tenant",
		Rate: &quota.Rate{Unit: time.Hour, RequestsPerUnit: 10},
	}},
}}}

// bucketsFSM returns an FSM that admitted n requests of one client, each into its own bucket
// (1024 admissions per entry, 10 µs of FSM time apart), as the bench tool's snapshot step does.
func bucketsFSM(tb testing.TB, n int) *FSM {
	tb.Helper()
	f := New(Options{})
	lj, err := json.Marshal(bucketsLimits)
	if err != nil {
		tb.Fatal(err)
	}
	var index uint64
	apply := func(ts int64, ops []*fsmv1.Op) {
		data, err := Encode(&fsmv1.Command{Ts: ts, Ops: ops})
		if err != nil {
			tb.Fatal(err)
		}
		index++
		f.ApplyBatch([]*raft.Log{{Index: index, Term: 1, Type: raft.LogCommand, Data: data}})
	}
	ts := int64(time.Hour)
	apply(ts, []*fsmv1.Op{{Op: &fsmv1.Op_SetLimits{SetLimits: &fsmv1.SetLimits{LimitsJson: lj}}}})
	const perEntry = 1024
	for i := 0; i < n; i += perEntry {
		ops := make([]*fsmv1.Op, 0, perEntry)
		for j := i; j < min(i+perEntry, n); j++ {
			ops = append(ops, &fsmv1.Op{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{ClientId: "bench-populate", Admission: &quotadv1.Admission{
				RequestId: uint64(j + 1), Domain: "buckets", Cost: 1, Attempt: 1,
				Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: fmt.Sprintf("t%07d", j)}},
			}}}})
		}
		ts += int64(10 * time.Microsecond)
		apply(ts, ops)
	}
	if got := f.Stats().DedupEntries; got != n {
		tb.Fatalf("%d dedup records, want %d", got, n)
	}
	return f
}

func liveHeap() uint64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// BenchmarkDedupMemory reports the live heap of the dedup table per remembered admission
// (B/record: records, decisions and index) and of the whole FSM per admission into a distinct
// bucket (B/bucket, engine included), after 1M admissions.
func BenchmarkDedupMemory(b *testing.B) {
	const n = 1_000_000
	for b.Loop() {
		before := liveHeap()
		f := bucketsFSM(b, n)
		full := liveHeap()
		f.mu.Lock()
		f.dedup = newDedupTable()
		f.mu.Unlock()
		noDedup := liveHeap()
		b.ReportMetric(float64(full-noDedup)/n, "B/record")
		b.ReportMetric(float64(full-before)/n, "B/bucket")
		runtime.KeepAlive(f)
	}
}

// BenchmarkSnapshotRestore is what a node does to ship and load 256K buckets and as many dedup
// records: Snapshot, Persist (into memory) and Restore into a fresh FSM.
func BenchmarkSnapshotRestore(b *testing.B) {
	const n = 1 << 18
	src := bucketsFSM(b, n)
	var sink memSink
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		sink.Reset()
		snap, err := src.Snapshot()
		if err != nil {
			b.Fatal(err)
		}
		if err := snap.Persist(&sink); err != nil {
			b.Fatal(err)
		}
		snap.Release()
		dst := New(Options{})
		if err := dst.Restore(io.NopCloser(bytes.NewReader(sink.Bytes()))); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(sink.Len())/n, "file-B/bucket")
}

// benchDedupTable holds n records like the bench tool's: one client, admissions of one
// bucket each.
func benchDedupTable(n int) *dedupTable {
	t := newDedupTable()
	for i := range n {
		t.put("bench-populate", uint64(i+1), quota.Time(int64(time.Hour)+int64(i/1024)*10_000), quota.Decision{
			Admitted: true, Reason: quota.ReasonOK, Scope: "tenant", Limit: 10, Remaining: 9,
			Window: time.Hour, ResetAfter: 6 * time.Minute, Cost: 1, DebitSeq: uint64(i + 1),
			Charges: []string{fmt.Sprintf("buckets/tenant=t%07d", i)},
		})
	}
	return t
}

// BenchmarkDedupSection encodes (as Snapshot does) and decodes (as Restore does) the dedup
// section of 1M records.
func BenchmarkDedupSection(b *testing.B) {
	const n = 1_000_000
	t := benchDedupTable(n)
	section := t.appendTo(make([]byte, 0, t.sectionSize()))
	b.Run("encode", func(b *testing.B) {
		b.ReportAllocs()
		for range b.N {
			buf := t.appendTo(make([]byte, 0, t.sectionSize()))
			if len(buf) != len(section) {
				b.Fatal(len(buf), len(section))
			}
		}
	})
	b.Run("decode", func(b *testing.B) {
		b.ReportAllocs()
		for range b.N {
			back, err := readDedup(bytes.NewReader(section), uint64(len(section)), dedupReadPiece)
			if err != nil || back.len() != n {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkDedupPut is remembering one admission (and expiring the oldest, so the table holds
// 500K records) — the dedup table's share of applying an admission.
func BenchmarkDedupPut(b *testing.B) {
	const window = 500_000
	t := newDedupTable()
	d := quota.Decision{Admitted: true, Reason: quota.ReasonOK, Scope: "tenant", Limit: 10, Remaining: 9,
		Window: time.Hour, ResetAfter: 6 * time.Minute, Cost: 1, Charges: []string{"buckets/tenant=t0000001"}}
	b.ReportAllocs()
	for i := range b.N {
		d.DebitSeq = uint64(i + 1)
		t.put("bench-populate", uint64(i+1), quota.Time(i+window), d)
		t.expire(quota.Time(i))
	}
}
