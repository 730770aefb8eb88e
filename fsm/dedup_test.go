package fsm

import (
	"reflect"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/quota"
)

// TestDedupTableAcrossChunks puts and expires records across several chunk boundaries and
// checks lookups, the live count and the snapshot round trip.
func TestDedupTableAcrossChunks(t *testing.T) {
	tb := newDedupTable()
	const n = 3*dedupChunk + 17
	for i := range n {
		tb.put("c", uint64(i+1), quota.Time(i), quota.Decision{Admitted: true, Remaining: uint64(i)})
	}
	for _, cut := range []int{0, 5, dedupChunk - 1, dedupChunk, 2*dedupChunk + 3, n} {
		tb.expire(quota.Time(cut - 1)) // expires records with expires <= cut-1, i.e. the first cut
		if got, want := tb.len(), n-cut; got != want {
			t.Fatalf("after expiring %d: len %d, want %d", cut, got, want)
		}
		if cut > 0 {
			if _, ok := tb.get("c", uint64(cut)); ok {
				t.Fatalf("record %d still there after expiring the first %d", cut, cut)
			}
		}
		if cut < n {
			d, ok := tb.get("c", uint64(cut+1))
			if !ok || d.Remaining != uint64(cut) || !d.Admitted {
				t.Fatalf("record %d: %+v %v", cut+1, d, ok)
			}
			seq, _ := tb.lookup("c", uint64(cut+1))
			tb.setRefunded(seq) // kept in the table
			if s2, _ := tb.lookup("c", uint64(cut+1)); !tb.refunded(s2) {
				t.Fatal("refunded flag lost")
			}
		}
		back, err := unmarshalDedup(tb.marshal())
		if err != nil || back.len() != tb.len() {
			t.Fatalf("round trip: %v, len %d want %d", err, back.len(), tb.len())
		}
	}
	// Reuse after emptying.
	tb.put("c", 1, quota.Time(n+10), quota.Decision{})
	if _, ok := tb.get("c", 1); !ok || tb.len() != 1 {
		t.Fatal("put after emptying the table")
	}
}

// TestEncodeMatchesProtobuf: the hand-written encoder and decoder agree with the protobuf
// runtime on every field of an Acquire op.
func TestEncodeMatchesProtobuf(t *testing.T) {
	adm := &quotadv1.Admission{RequestId: 1<<40 + 3, Domain: "provider", Cost: 7, LeaseTtlMs: -5, Attempt: 2,
		WorkClass: "batch", MaxWaitMs: 9, Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}, {Key: "consumer"}, {Value: "x"}}}
	want := &fsmv1.Command{Version: CommandVersion, Ts: 12345, Ops: []*fsmv1.Op{
		{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{ClientId: "c1", Admission: adm}}},
		{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{Admission: &quotadv1.Admission{}}}},
		{Op: &fsmv1.Op_Release{Release: &fsmv1.Release{LeaseId: 4}}},
	}}
	rel, err := EncodeOp(want.Ops[2])
	if err != nil {
		t.Fatal(err)
	}
	data := EncodeEntry(12345, [][]byte{AppendAcquireOp(nil, "c1", adm), AppendAcquireOp(nil, "", &quotadv1.Admission{}), rel})
	var got fsmv1.Command
	if err := proto.Unmarshal(data, &got); err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(&got, want) {
		t.Fatalf("encoded\n%v\nwant\n%v", &got, want)
	}
	var raw rawCommand
	if err := decodeCommand(data, &raw); err != nil || raw.version != CommandVersion || raw.ts != 12345 || len(raw.ops) != 3 {
		t.Fatalf("decodeCommand: %v %+v", err, raw)
	}
	acq, ok, err := splitOp(raw.ops[0])
	if err != nil || !ok {
		t.Fatalf("splitOp: %v %v", ok, err)
	}
	var a acquireOp
	var it internTable
	if err := decodeAcquire(acq, &a, it.get); err != nil {
		t.Fatal(err)
	}
	wantReq := quota.Request{Domain: "provider", Cost: 7, LeaseTTL: -5 * time.Millisecond, Attempt: 2, WorkClass: "batch",
		Descriptors: []quota.Entry{{Key: "tenant", Value: "acme"}, {Key: "consumer"}, {Value: "x"}}}
	if a.clientID != "c1" || a.id != adm.RequestId || !a.hasAdm || !reflect.DeepEqual(a.req, wantReq) {
		t.Fatalf("decoded %+v", a)
	}
	if _, ok, _ := splitOp(raw.ops[2]); ok {
		t.Fatal("a Release was taken for an Acquire")
	}
}

// TestDedupIndexMatchesMap drives the table's open-addressing index through growth, expiry
// across chunks and many clients, and checks every lookup against a plain map.
func TestDedupIndexMatchesMap(t *testing.T) {
	tb := newDedupTable()
	type key struct {
		c  string
		id uint64
	}
	want := map[key]uint64{} // → Remaining
	var order []key
	head := 0
	clients := []string{"a", "b", "c", "d", "e"}
	for i := range 5 * dedupChunk {
		k := key{clients[i*7%len(clients)], uint64(i*31%977 + i)}
		if _, dup := want[k]; dup {
			continue
		}
		tb.put(k.c, k.id, quota.Time(i), quota.Decision{Admitted: true, Remaining: uint64(i), Charges: []string{k.c}})
		want[k] = uint64(i)
		order = append(order, k)
		if i%3 == 0 { // expire roughly a third as we go
			cut := i / 3
			tb.expire(quota.Time(cut))
			for head < len(order) && int(want[order[head]]) <= cut {
				delete(want, order[head])
				head++
			}
		}
		if i%97 == 0 || i == 5*dedupChunk-1 {
			if tb.len() != len(want) {
				t.Fatalf("step %d: len %d, want %d", i, tb.len(), len(want))
			}
			for k, rem := range want {
				d, ok := tb.get(k.c, k.id)
				if !ok || d.Remaining != rem || len(d.Charges) != 1 || d.Charges[0] != k.c {
					t.Fatalf("step %d: %v: %+v %v, want remaining %d", i, k, d, ok, rem)
				}
			}
			for _, k := range order[:head] {
				if _, ok := tb.get(k.c, k.id); ok {
					t.Fatalf("step %d: expired %v still found", i, k)
				}
			}
		}
	}
	back, err := unmarshalDedup(tb.marshal())
	if err != nil {
		t.Fatal(err)
	}
	for k, rem := range want {
		if d, ok := back.get(k.c, k.id); !ok || d.Remaining != rem {
			t.Fatalf("restored %v: %+v %v", k, d, ok)
		}
	}
}
