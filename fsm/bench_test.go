package fsm

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/quota"
)

// benchLimits is roomy: the benchmarks measure applying admissions, not refusing them.
var benchLimits = &quota.Limits{Domains: []quota.Domain{{
	Name: "bench",
	Rate: &quota.Rate{Unit: time.Second, RequestsPerUnit: 100_000_000},
	Descriptors: []quota.Node{{
		Key:  "tenant",
		Rate: &quota.Rate{Unit: time.Second, RequestsPerUnit: 1_000_000},
	}},
}}}

// benchCommand is one log entry as the leader's proposer writes it: ops admissions of one
// client with request IDs from firstID, tenants cycling through 1000 values.
func benchCommand(ts int64, firstID uint64, ops int) *fsmv1.Command {
	cmd := &fsmv1.Command{Ts: ts}
	for i := range ops {
		id := firstID + uint64(i)
		cmd.Ops = append(cmd.Ops, &fsmv1.Op{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{
			ClientId: "0123456789abcdef0123456789abcdef",
			Admission: &quotadv1.Admission{RequestId: id, Domain: "bench", Cost: 1, Attempt: 1,
				Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: fmt.Sprintf("t%d", id%1000)}}},
		}}})
	}
	return cmd
}

func benchFSM(b *testing.B) *FSM {
	b.Helper()
	f := New(Options{})
	lj, err := json.Marshal(benchLimits)
	if err != nil {
		b.Fatal(err)
	}
	data, err := Encode(&fsmv1.Command{Ops: []*fsmv1.Op{{Op: &fsmv1.Op_SetLimits{SetLimits: &fsmv1.SetLimits{LimitsJson: lj}}}}})
	if err != nil {
		b.Fatal(err)
	}
	if r := f.Apply(&raft.Log{Index: 1, Type: raft.LogCommand, Data: data}).(*Result); r.Ops[0].Other.Err != nil {
		b.Fatal(r.Ops[0].Other.Err)
	}
	return f
}

// BenchmarkApplyBatch: one iteration is one ApplyBatch call of 8 log entries of `ops`
// admissions each, the way raft hands committed entries to a replica; ns/admission is the
// figure to compare. Every admission is new (distinct request IDs), so each one is decided by
// the engine and remembered in the dedup table; FSM time advances 1 ms per entry, so the
// dedup table reaches its steady state (a 2-minute window) only in long runs.
func BenchmarkApplyBatch(b *testing.B) {
	for _, ops := range []int{1, 16, 256} {
		b.Run(fmt.Sprintf("ops=%d", ops), func(b *testing.B) {
			// Pre-encode a pool of entries; request IDs are rewritten per round so none repeats.
			const pool = 64
			f := benchFSM(b)
			var data [pool][]byte
			round := 0
			encode := func() {
				for e := range data {
					first := uint64(round*pool*ops+e*ops) + 1
					d, err := Encode(benchCommand(int64(time.Second)+int64(round*pool+e)*int64(time.Millisecond), first, ops))
					if err != nil {
						b.Fatal(err)
					}
					data[e] = d
				}
				round++
			}
			encode()
			index := uint64(1)
			logs := make([]*raft.Log, 8)
			next := 0
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if next == pool {
					b.StopTimer()
					encode()
					next = 0
					b.StartTimer()
				}
				for j := range logs {
					index++
					logs[j] = &raft.Log{Index: index, Type: raft.LogCommand, Data: data[(next+j)%pool]}
				}
				next += len(logs)
				f.ApplyBatch(logs)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(logs)*ops), "ns/admission")
		})
	}
}

// BenchmarkDecodeCommand is the decoding share of applying an entry of 256 admissions.
func BenchmarkDecodeCommand(b *testing.B) {
	data, err := Encode(benchCommand(1, 1, 256))
	if err != nil {
		b.Fatal(err)
	}
	var (
		cmd rawCommand
		a   acquireOp
		it  internTable
	)
	b.ReportAllocs()
	for b.Loop() {
		if err := decodeCommand(data, &cmd); err != nil {
			b.Fatal(err)
		}
		for _, op := range cmd.ops {
			acq, ok, err := splitOp(op)
			if err != nil || !ok {
				b.Fatal(err)
			}
			if err := decodeAcquire(acq, &a, it.get); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// BenchmarkEncode is the leader's cost of writing an entry of 256 admissions.
func BenchmarkEncode(b *testing.B) {
	cmd := benchCommand(1, 1, 256)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Encode(cmd); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkEncodeEntry is the same entry written the way the proposer does now: each op
// appended by AppendAcquireOp (on the callers' goroutines), then joined by EncodeEntry.
func BenchmarkEncodeEntry(b *testing.B) {
	cmd := benchCommand(1, 1, 256)
	ops := make([][]byte, len(cmd.Ops))
	var buf []byte
	b.ReportAllocs()
	for b.Loop() {
		buf = buf[:0]
		for i, op := range cmd.Ops {
			a := op.GetAcquire()
			from := len(buf)
			buf = AppendAcquireOp(buf, a.ClientId, a.Admission)
			ops[i] = buf[from:]
		}
		_ = EncodeEntry(1, ops)
	}
}
