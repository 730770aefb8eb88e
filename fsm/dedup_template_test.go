package fsm

import (
	"bytes"
	"math"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/quota"
)

// randomDecision fills every field, with lengths and values that take every varint length.
func randomDecision(rng *rand.Rand) quota.Decision {
	str := func() string { return strings.Repeat("s", []int{0, 1, 127, 128, 300}[rng.IntN(5)]) }
	u := func() uint64 { return rng.Uint64() >> rng.IntN(64) }
	dur := func() time.Duration { return time.Duration(int64(rng.Uint64()) >> rng.IntN(64)) }
	d := quota.Decision{Admitted: rng.IntN(2) == 0, Reason: quota.Reason(str()), Scope: str(), Limit: u(),
		Remaining: u(), Window: dur(), ResetAfter: dur(), RetryAfter: dur(), LeaseID: u(), LeaseTTL: dur(),
		Message: str(), Cost: u(), DebitSeq: u()}
	for range rng.IntN(4) {
		d.Charges = append(d.Charges, str())
	}
	return d
}

// TestStoredDecisionRoundTrip: splitDecision finds the runs appendDecisionRuns reports, and a
// decision stored as template and varying fields expands back to exactly appendDecision's
// bytes, and decodes to the decision.
func TestStoredDecisionRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var ts decisionTemplates
	for i := range 2000 {
		d := randomDecision(rng)
		if i%3 == 0 {
			d = quota.Decision{}
		} else if i%3 == 1 {
			d.Limit, d.Window, d.LeaseTTL, d.Message = math.MaxUint64, math.MinInt64, math.MaxInt64, ""
		}
		enc, runs := appendDecisionRuns([]byte{0xee}, &d)
		enc = enc[1:]
		dd := decoder{buf: enc}
		if split := dd.splitDecision(); dd.err != nil || len(dd.buf) != 0 || split != runs || runs[5] != len(enc) {
			t.Fatalf("decision %d: split %v, %d bytes left, runs %v, encoded with runs %v", i, dd.err, len(dd.buf), split, runs)
		}
		stored := ts.appendStored([]byte{0xee}, enc, runs)[1:]
		if got := ts.appendExpanded(nil, stored); !bytes.Equal(got, enc) {
			t.Fatalf("decision %d: expanded\n%x\nwant\n%x", i, got, enc)
		}
		if got := ts.expandedLen(stored); got != len(enc) {
			t.Fatalf("decision %d: expandedLen %d, want %d", i, got, len(enc))
		}
		back := (&decoder{buf: ts.appendExpanded(nil, stored)}).decision()
		if len(d.Charges) == 0 {
			d.Charges = nil
		}
		if !reflect.DeepEqual(back, d) {
			t.Fatalf("decision %d: decoded %+v, want %+v", i, back, d)
		}
	}
}

// TestStoredDecisionKeepsBytes: the bytes of a restored decision come back unchanged even
// where this build would encode its value differently (an Admitted byte of 2, a varint with a
// redundant continuation byte), as they did when the arena held the snapshot's bytes.
func TestStoredDecisionKeepsBytes(t *testing.T) {
	canonical := appendDecision(nil, &quota.Decision{Admitted: true, Reason: "ok", Scope: "tenant", Limit: 10,
		Remaining: 3, Window: time.Second, Charges: []string{"a"}, DebitSeq: 9})
	odd := bytes.Clone(canonical)
	odd[0] = 2                                       // Admitted
	odd = append(odd[:len(odd)-1], 0x89, 0x80, 0x00) // DebitSeq 9 in three bytes
	dd := decoder{buf: odd}
	if dd.splitDecision(); dd.err != nil {
		t.Fatal(dd.err)
	}
	section := []byte{dedupFormat, 2}
	for i, dec := range [][]byte{odd, canonical} {
		section = appendRecordHead(section, "c", &dedupRecord{id: uint64(i + 1), expires: 5})
		section = append(section, dec...)
	}
	tb, err := unmarshalDedup(section)
	if err != nil {
		t.Fatal(err)
	}
	if got := tb.marshal(); !bytes.Equal(got, section) {
		t.Fatalf("section written back\n%x\nwant\n%x", got, section)
	}
}

// TestTemplatesAreForgotten: a template lives as long as a record uses it; indexes are reused.
func TestTemplatesAreForgotten(t *testing.T) {
	tb := newDedupTable()
	for round := range 3 {
		for i := range 2 * dedupChunk {
			now := quota.Time(round*10*dedupChunk + i)
			tb.put("c", uint64(now)+1, now, quota.Decision{Admitted: true, Limit: uint64(i % 50), Charges: []string{"k"}})
		}
		if got := len(tb.templates.idx); got != 50 {
			t.Fatalf("round %d: %d templates, want 50", round, got)
		}
		tb.expire(quota.Time(round*10*dedupChunk + 2*dedupChunk))
		if tb.len() != 0 || len(tb.templates.idx) != 0 || len(tb.templates.list) != 50 {
			t.Fatalf("round %d: after expiring all, %d records, %d templates of %d slots", round, tb.len(), len(tb.templates.idx), len(tb.templates.list))
		}
	}
}

// FuzzReadDedup: any section is refused or read into a table that writes a section which
// reads back the same, with decisions that decode.
func FuzzReadDedup(f *testing.F) {
	tb := newDedupTable()
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 20 {
		tb.put([]string{"a", "bb"}[i%2], uint64(i), quota.Time(i), randomDecision(rng))
	}
	f.Add(tb.marshal())
	f.Add(variedDedupTable().marshal()[:3000])
	f.Fuzz(func(t *testing.T, section []byte) {
		tb, err := readDedup(bytes.NewReader(section), uint64(len(section)), 64)
		if err != nil {
			return
		}
		out := tb.marshal()
		back, err := unmarshalDedup(out)
		if err != nil {
			t.Fatalf("a section written from a read one does not read: %v", err)
		}
		if !bytes.Equal(back.marshal(), out) {
			t.Fatal("a section does not read back the same")
		}
		if got, want := tb.sectionSize(), len(out); got != want {
			t.Fatalf("sectionSize %d, want %d", got, want)
		}
		for seq := tb.head; seq < tb.next; seq++ {
			tb.decision(seq)
		}
		tb.expire(math.MaxInt64)
		if tb.len() != 0 || len(tb.templates.idx) != 0 || len(tb.clientIdx) != 0 {
			t.Fatal("expiring everything left records, templates or clients")
		}
	})
}
