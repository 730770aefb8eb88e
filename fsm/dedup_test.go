package fsm

import (
	"bytes"
	"fmt"
	"reflect"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/quota"
)

func (t *dedupTable) marshal() []byte { return t.appendTo(nil) }

func unmarshalDedup(data []byte) (*dedupTable, error) {
	return readDedup(bytes.NewReader(data), uint64(len(data)), dedupReadPiece)
}

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
	t.Run("grow in place", testDedupIndexMatchesMap)
	t.Run("grow in the background", func(t *testing.T) {
		defer func(v int) { backgroundGrowthSlots = v }(backgroundGrowthSlots)
		backgroundGrowthSlots = 1024 // the smallest index: every growth goes to the background
		testDedupIndexMatchesMap(t)
	})
}

func testDedupIndexMatchesMap(t *testing.T) {
	tb := newDedupTable()
	backgrounds := 0
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
		expire := func(cut int) {
			tb.expire(quota.Time(cut))
			for head < len(order) && int(want[order[head]]) <= cut {
				delete(want, order[head])
				head++
			}
		}
		d := quota.Decision{Admitted: true, Remaining: uint64(i), Charges: []string{k.c}}
		if i%2 == 0 {
			tb.put(k.c, k.id, quota.Time(i), d)
		} else {
			// The FSM's way: find, then putAt with the spot the miss returned; sometimes
			// stale because records expired in between.
			if _, ok, at := tb.find(k.c, k.id); ok {
				t.Fatalf("step %d: %v found before it was put", i, k)
			} else {
				if i%5 == 1 {
					expire(i / 2)
				}
				tb.putAt(at, k.c, k.id, uint64(i)+1, quota.Time(i), &d)
			}
		}
		if tb.index.grow != nil {
			backgrounds++
			if i%2 == 0 {
				<-tb.index.grow.done // the next put swaps it in at once
			}
		}
		want[k] = uint64(i)
		order = append(order, k)
		if i%3 == 0 { // expire roughly a third as we go
			expire(i / 3)
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
	if got := backgroundGrowthSlots <= 1024; got != (backgrounds > 0) {
		t.Fatalf("puts saw a background growth %d times; expected one: %v", backgrounds, got)
	}
	if tb.index.n != tb.len() {
		t.Fatalf("%d records indexed, %d live", tb.index.n, tb.len())
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

// variedDedupTable holds records that exercise every length in a record head: clients of 1
// and 200 bytes, IDs of 1 to 10 varint bytes, negative and large expiry times, refunded flags; across
// three chunks with the oldest live record inside the first.
func variedDedupTable() *dedupTable {
	tb := newDedupTable()
	long := string(bytes.Repeat([]byte("x"), 200))
	for i := range 3*dedupChunk + 11 {
		client := []string{"c", long, "client-2"}[i%3]
		id := uint64(i+1) * 0x9e3779b97f4a7c15 // unique, and long varints
		if i%3 == 0 {
			id = uint64(i + 1) // unique for client "c", short varints
		}
		tb.put(client, id, quota.Time(int64(i)-1000)<<(i%20), quota.Decision{
			Admitted: i%2 == 0, Reason: quota.ReasonOK, Scope: "tenant", Remaining: uint64(i) << (i % 50),
			Charges: []string{long[:i%150]}, DebitSeq: uint64(i),
		})
		if i%5 == 0 {
			seq, _ := tb.lookup(client, id)
			tb.setRefunded(seq)
		}
	}
	return tb
}

// TestDedupSectionSize: sectionSize is exactly the length appendTo writes.
func TestDedupSectionSize(t *testing.T) {
	check := func(what string, tb *dedupTable) {
		t.Helper()
		if got, want := tb.sectionSize(), len(tb.appendTo(nil)); got != want {
			t.Fatalf("%s: sectionSize %d, appendTo wrote %d", what, got, want)
		}
	}
	tb := newDedupTable()
	check("empty", tb)
	tb.put("c", 1, 5, quota.Decision{})
	check("one record", tb)
	tb.expire(5)
	check("emptied", tb)
	tb = variedDedupTable()
	check("varied", tb)
	for _, seq := range []uint64{1, dedupChunk, dedupChunk + 1, 2*dedupChunk + 5} {
		tb.expire(tb.recAt(tb.head + seq - 1).expires) // expiry times are not ordered here
		check(fmt.Sprintf("%d records", tb.len()), tb)
	}
}

// TestReadDedupInPieces: decoding a section in pieces of any size, down to one byte (every
// record split across reads), gives back the same table.
func TestReadDedupInPieces(t *testing.T) {
	tb := variedDedupTable()
	section := tb.marshal()
	for _, piece := range []int{1, 2, 7, 100, 4096, dedupReadPiece} {
		back, err := readDedup(bytes.NewReader(section), uint64(len(section)), piece)
		if err != nil {
			t.Fatalf("pieces of %d: %v", piece, err)
		}
		if !bytes.Equal(back.marshal(), section) {
			t.Fatalf("pieces of %d: the table read back differs", piece)
		}
		for seq := tb.head; seq < tb.next; seq += 97 {
			r := tb.recAt(seq)
			client := tb.clients[r.client&^refundedBit].id
			bseq, ok := back.lookup(client, r.id)
			if !ok || back.refunded(bseq) != tb.refunded(seq) || !reflect.DeepEqual(back.decision(bseq), tb.decision(seq)) {
				t.Fatalf("pieces of %d: record %d (%q, %d) not found or different", piece, seq, client, r.id)
			}
		}
	}
	// The index built at once serves expiry (backward-shift deletion) and new puts as well as
	// one built record by record.
	back, err := unmarshalDedup(section)
	if err != nil {
		t.Fatal(err)
	}
	for back.len() > 0 {
		back.expire(back.recAt(back.head).expires)
		tb.expire(tb.recAt(tb.head).expires)
		if back.len() != tb.len() || back.index.n != back.len() {
			t.Fatalf("after expiry: %d records (%d indexed), want %d", back.len(), back.index.n, tb.len())
		}
		if back.len()%50 == 0 {
			for seq := back.head; seq < back.next; seq++ {
				r := back.recAt(seq)
				if s, ok := back.lookup(back.clients[r.client&^refundedBit].id, r.id); !ok || s != seq {
					t.Fatalf("record %d lost from the index after expiry", seq)
				}
			}
		}
	}
	back.put("new", 1, 0, quota.Decision{})
	if _, ok := back.get("new", 1); !ok {
		t.Fatal("a put after restore and expiry is not found")
	}
	if _, err := readDedup(bytes.NewReader(section[:len(section)-1]), uint64(len(section)), 100); err == nil {
		t.Fatal("a truncated section was read")
	}
}

// TestEncodeEntryAtVersion: EncodeEntryAt writes the version it is given, this build's for 0
// and for one it does not apply (above CommandVersion), and EncodeTick does the same.
func TestEncodeEntryAtVersion(t *testing.T) {
	for _, tc := range []struct{ in, want int }{{5, 5}, {1, 1}, {0, CommandVersion}, {-3, CommandVersion}, {CommandVersion + 1, CommandVersion}} {
		for name, data := range map[string][]byte{"entry": EncodeEntryAt(tc.in, 7, [][]byte{AppendAcquireOp(nil, "c", &quotadv1.Admission{})}),
			"tick": (&FSM{}).EncodeTick(7, tc.in)} {
			var c rawCommand
			if err := decodeCommand(data, &c); err != nil {
				t.Fatal(err)
			}
			if int(c.version) != tc.want || c.ts != 7 {
				t.Errorf("%s at %d: version %d ts %d, want version %d ts 7", name, tc.in, c.version, c.ts, tc.want)
			}
		}
	}
}
