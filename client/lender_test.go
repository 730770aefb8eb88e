package client

import (
	"context"
	"math"
	"sync/atomic"
	"testing"
	"time"
)

type stepClock struct{ ns atomic.Int64 }

func (c *stepClock) Now() (int64, int64) { n := c.ns.Load(); return n, n }

// lentGrant is a share answer lending one level (key "k") of one path.
func lentGrant(seq uint64, rate, burst uint64, first bool) *shareResponse {
	return &shareResponse{seq: seq, term: 3 * time.Second, margin: 250 * time.Millisecond, paths: []pathShare{{status: "lent",
		levels: []levelShare{{key: "k", rate: rate, burst: burst, initial: burst, first: first}}}}}
}

// newLender is a regional leader's holder on a stepped clock with one path (domain d).
func newLender() (*stepClock, *shareHolder, *sharePath, *Limiter) {
	clk := &stepClock{}
	clk.ns.Store(int64(time.Second))
	h := &shareHolder{clock: newTimeSource(clk), incarnation: 1, paths: map[string]*sharePath{}, levels: map[string]*gcra{},
		wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	p := h.addPath(Request{Domain: "d", Cost: 1}, LimiterOptions{})
	return clk, h, p, &Limiter{h: h, p: p, req: Request{Domain: "d", Cost: 1}}
}

// TestLenderConservesAndHoldsTheAck: the slices lent downstream and the local bucket together
// never exceed the upstream grant (the local bucket is rebuilt at grant − slices, the slice's
// initial tokens taken from its balance), and an upstream grant smaller than the slices still
// charged is not acknowledged until they end (the cluster keeps charging the last one that
// covered them). Fails with -tags region_bug_doubleslice.
func TestLenderConservesAndHoldsTheAck(t *testing.T) {
	clk, h, p, l := newLender()
	_, sent := h.clock.now()
	h.apply(lentGrant(1, 100e6, 100e6, true), []*sharePath{p}, sent)
	if h.applied != 1 {
		t.Fatalf("applied %d", h.applied)
	}
	sl := l.LendSlice(SliceRequest{Holder: "x", Seq: 1, Demand: 40e6, MaxCost: 1})
	if !sl.OK || sl.Rate != 40e6 || sl.Burst != 40e6 || !sl.First || sl.Initial != 40e6 {
		t.Fatalf("slice %+v, want 40/s, burst 40, first with 40 initial", sl)
	}
	if sl.Term <= 0 || sl.Term > 3*time.Second-250*time.Millisecond {
		t.Fatalf("slice term %v: must end by the upstream grant's end (3s − 250ms after its send)", sl.Term)
	}
	slow, _ := h.clock.now()
	g := h.levels["k"]
	if g.rate+sl.Rate > 100e6 || g.burst+sl.Burst > 100e6 || g.balance(slow)+sl.Initial > 100e6 {
		t.Fatalf("local bucket %d/s burst %d balance %d + slice %d/s burst %d initial %d exceed the grant of 100/s, burst 100",
			g.rate, g.burst, g.balance(slow), sl.Rate, sl.Burst, sl.Initial)
	}
	if st := p.state.Load(); st.levels[0] != g {
		t.Fatal("the path's state does not use the rebuilt local bucket")
	}
	// A second holder gets what is left of the lendable part, no more.
	sl2 := l.LendSlice(SliceRequest{Holder: "y", Seq: 1, Demand: 1000e6, MaxCost: 1})
	if !sl2.OK || sl.Rate+sl2.Rate+h.levels["k"].rate > 100e6 {
		t.Fatalf("second slice %+v beside %+v and a local %d/s: over the grant", sl2, sl, h.levels["k"].rate)
	}
	// The grant shrinks below the slices charged: applied, not acknowledged.
	_, sent = h.clock.now()
	h.apply(lentGrant(2, 30e6, 30e6, false), []*sharePath{p}, sent)
	if h.applied != 1 {
		t.Fatalf("a grant of 30/s under slices of %d/s was acknowledged (applied %d)", sl.Rate+sl2.Rate, h.applied)
	}
	if r := h.levels["k"].rate; r != 0 {
		t.Fatalf("local bucket %d/s while the slices exceed the grant", r)
	}
	if s := l.LendSlice(SliceRequest{Holder: "z", Seq: 1, Demand: 10e6, MaxCost: 1}); s.OK {
		t.Fatalf("lent %+v while the slices exceed the grant", s)
	}
	// No release while slices are charged (the cluster would stop charging the grant that
	// covers them): the local buckets are sealed and nothing is sent (h.c is nil here).
	seq := h.seq
	h.release(context.Background())
	if h.seq != seq || h.levels["k"] != nil {
		t.Fatalf("released with slices charged (seq %d → %d)", seq, h.seq)
	}
	_, sent = h.clock.now()
	h.apply(lentGrant(3, 30e6, 30e6, false), []*sharePath{p}, sent)
	// Once the slices have ended (they end with the grant they were cut from), the next
	// grant is acknowledged and the local bucket has it all.
	clk.ns.Add(int64(3 * time.Second))
	_, sent = h.clock.now()
	h.apply(lentGrant(4, 30e6, 30e6, false), []*sharePath{p}, sent)
	if h.applied != 4 || h.levels["k"].rate != 30e6 {
		t.Fatalf("after the slices ended: applied %d, local %d/s; want 4 and 30/s", h.applied, h.levels["k"].rate)
	}
	if r, b := l.Lent(); r != 0 || b != 0 {
		t.Fatalf("lent %d/s, burst %d after the slices ended", r, b)
	}
}

// TestLenderClampsTheAck: a downstream holder's AckSeq acknowledges at most the newest grant it
// was lent — an ack of 2^64-1 (review: any worker can send one) dropped every grant from the
// charge, so the leader rebuilt its own bucket at the whole upstream rate beside live slices.
func TestLenderClampsTheAck(t *testing.T) {
	_, h, p, l := newLender()
	_, sent := h.clock.now()
	h.apply(lentGrant(1, 100e6, 100e6, true), []*sharePath{p}, sent)
	for seq := uint64(1); seq <= 3; seq++ {
		sl := l.LendSlice(SliceRequest{Holder: "x", Seq: seq, Ack: math.MaxUint64, Demand: 60e6, MaxCost: 1})
		if !sl.OK {
			t.Fatalf("slice %d refused: %+v", seq, sl)
		}
		_, fast := h.clock.now()
		h.mu.Lock()
		lentR, lentB := h.lentCharged("k", fast, "")
		local := h.levels["k"]
		h.mu.Unlock()
		if lentR == 0 || local.rate+lentR > 100e6 || local.burst+lentB > 100e6 {
			t.Fatalf("after seq %d with AckSeq 2^64-1: slices charged %d/s burst %d beside a local %d/s burst %d: over the 100/s grant (or the slice not charged)",
				seq, lentR, lentB, local.rate, local.burst)
		}
	}
}

// TestLenderEndSlicesKeepsNewerSlices: a release ends only the slices granted at or before its
// seq. The regional FSM applies a holder's release (seq 2) before its renewal (seq 3), but the
// leader's handlers of the two run concurrently: the release's EndSlices can run after the
// renewal's slice was lent. Ending that newer slice (review: EndSlices carried no seq) let the
// leader rebuild its local bucket at the whole upstream rate while the holder spends the slice.
func TestLenderEndSlicesKeepsNewerSlices(t *testing.T) {
	_, h, p, l := newLender()
	_, sent := h.clock.now()
	h.apply(lentGrant(1, 100e6, 100e6, true), []*sharePath{p}, sent)
	old := l.LendSlice(SliceRequest{Holder: "x", Seq: 1, Demand: 60e6, MaxCost: 1})
	if !old.OK || old.Rate != 60e6 {
		t.Fatalf("slice for seq 1: %+v, want 60/s", old)
	}
	// The renewal after the release (seq 3), lent before the release's handler ends slices.
	sl := l.LendSlice(SliceRequest{Holder: "x", Seq: 3, Ack: 1, Demand: 20e6, MaxCost: 1})
	if !sl.OK || sl.Rate != 20e6 {
		t.Fatalf("slice for seq 3: %+v, want 20/s", sl)
	}
	l.EndSlices("x", 2)
	r, b := l.Lent()
	if r != sl.Rate || b != sl.Burst {
		t.Fatalf("after the release of seq 2: slices charged %d/s burst %d; want the seq-3 slice's %d/s burst %d still charged (and the seq-1 one ended)",
			r, b, sl.Rate, sl.Burst)
	}
	if g := h.levels["k"]; g.rate+r > 100e6 || g.burst+b > 100e6 {
		t.Fatalf("local bucket %d/s burst %d beside the live slice %d/s burst %d: over the 100/s grant", g.rate, g.burst, r, b)
	}
	// A stale release (an older seq) ends nothing more.
	l.EndSlices("x", 1)
	if r2, _ := l.Lent(); r2 != sl.Rate {
		t.Fatalf("a release of seq 1 changed the charge to %d/s; want %d/s", r2, sl.Rate)
	}
	// A release of the renewal's seq ends it, and the local bucket gets the grant back.
	l.EndSlices("x", 3)
	if r, b := l.Lent(); r != 0 || b != 0 {
		t.Fatalf("after the release of seq 3: %d/s burst %d still charged", r, b)
	}
	if g := h.levels["k"]; g.rate != 100e6 {
		t.Fatalf("local bucket %d/s after every slice ended; want the whole 100/s", g.rate)
	}
}
