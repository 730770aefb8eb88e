package quota

import (
	"errors"
	"math"
	"testing"
	"time"

	"pgregory.net/rapid"
)

func TestProgressiveFillTree(t *testing.T) {
	// Constraint 0 is a parent (100); 1 and 2 are children (30, unlimited).
	caps := []uint64{100, 30, math.MaxUint64}
	flows := []allocFlow{
		{demand: math.MaxUint64, weight: 1, levels: []int32{0, 1}},
		{demand: math.MaxUint64, weight: 1, levels: []int32{0, 2}},
		{demand: 10, weight: 1, levels: []int32{0}},
	}
	x := progressiveFill(flows, caps)
	if x[0] != 30 || x[1] != 60 || x[2] != 10 {
		t.Fatalf("x = %v, want [30 60 10]", x)
	}
	// Weights: 1:3 on one constraint.
	x = progressiveFill([]allocFlow{{demand: math.MaxUint64, weight: 1, levels: []int32{0}}, {demand: math.MaxUint64, weight: 3, levels: []int32{0}}}, []uint64{100})
	if x[0] != 25 || x[1] != 75 {
		t.Fatalf("weighted x = %v, want [25 75]", x)
	}
}

// The filling conserves every constraint, never exceeds a demand, and is max-min fair: a flow
// below its demand crosses a full constraint on which no flow has a larger share per weight.
func TestProgressiveFillProperties(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		nc := rapid.IntRange(1, 4).Draw(t, "constraints")
		caps := make([]uint64, nc)
		for i := range caps {
			caps[i] = rapid.Uint64Range(0, 1000).Draw(t, "cap")
		}
		nf := rapid.IntRange(0, 8).Draw(t, "flows")
		flows := make([]allocFlow, nf)
		for i := range flows {
			f := allocFlow{weight: rapid.Uint64Range(1, 4).Draw(t, "w")}
			if rapid.Bool().Draw(t, "unbounded") {
				f.demand = math.MaxUint64
			} else {
				f.demand = rapid.Uint64Range(0, 600).Draw(t, "demand")
			}
			for c := range nc {
				if rapid.Bool().Draw(t, "through") {
					f.levels = append(f.levels, int32(c))
				}
			}
			if len(f.levels) == 0 {
				f.levels = []int32{0}
			}
			flows[i] = f
		}
		x := progressiveFill(flows, caps)
		used := make([]uint64, nc)
		for i, f := range flows {
			if x[i] > f.demand {
				t.Fatalf("flow %d: %d above its demand %d", i, x[i], f.demand)
			}
			for _, c := range f.levels {
				used[c] += x[i]
			}
		}
		for c := range caps {
			if used[c] > caps[c] {
				t.Fatalf("constraint %d: %d used of %d", c, used[c], caps[c])
			}
		}
		var wsum = make([]uint64, nc)
		for _, f := range flows {
			for _, c := range f.levels {
				wsum[c] += f.weight
			}
		}
		for i, f := range flows {
			if x[i] >= f.demand {
				continue
			}
			ok := false
			for _, c := range f.levels {
				// Full up to the rounding of one fill step, and f has the most per weight there.
				if caps[c]-used[c] >= wsum[c] {
					continue
				}
				best := true
				for j, g := range flows {
					for _, gc := range g.levels {
						if gc == c && x[j]*f.weight > (x[i]+f.weight)*g.weight {
							best = false
						}
					}
				}
				if best {
					ok = true
				}
			}
			if !ok {
				t.Fatalf("flow %d gets %d < demand %d without a full constraint where it leads: x=%v used=%v caps=%v", i, x[i], f.demand, x, used, caps)
			}
		}
	})
}

// A newcomer gets its fair share once the incumbent renews (the incumbent's charge is cut
// first, then the newcomer grows into what it freed): within two renewal rounds.
func TestShareNewcomerReachesFairShareWithinTwoRounds(t *testing.T) {
	w := newSimWorld(t, sharedDomain(100, 100, &Shares{}))
	a, b := w.holder("a", wholeDomain), w.holder("b", wholeDomain)
	ga, _ := a.renew(false)
	if r := ga.Paths[0].Levels[0].Rate; r != 90*microPerUnit {
		t.Fatalf("alone: %d, want 90/s (100 less the 10 %% reserve)", r)
	}
	gb, _ := b.renew(false)
	if gb.Paths[0].Status != ShareTooSmall {
		t.Fatalf("newcomer while a holds everything: %+v, want too_small (central meanwhile)", gb.Paths[0])
	}
	for round := 1; round <= 2; round++ {
		w.advance(5 * time.Second)
		ga, _ = a.renew(false)
		gb, _ = b.renew(false)
	}
	if gb.Paths[0].Status != ShareLent || gb.Paths[0].Levels[0].Rate != 45*microPerUnit || ga.Paths[0].Levels[0].Rate != 45*microPerUnit {
		t.Fatalf("after two rounds: a %+v b %+v, want 45/s each", ga.Paths[0], gb.Paths[0])
	}
}

// Demand moves from one holder to the other: the max-min shares follow.
func TestShareRebalanceFollowsDemand(t *testing.T) {
	w := newSimWorld(t, sharedDomain(100, 100, &Shares{}))
	a := w.holder("a", SharePath{Domain: "d", Demand: 80 * microPerUnit, MaxCost: 1})
	b := w.holder("b", SharePath{Domain: "d", Demand: 10 * microPerUnit, MaxCost: 1})
	for range 3 {
		a.renew(false)
		b.renew(false)
		w.advance(5 * time.Second)
	}
	if ra, rb := a.grant.Paths[0].Levels[0].Rate, b.grant.Paths[0].Levels[0].Rate; ra != 80*microPerUnit || rb != 10*microPerUnit {
		t.Fatalf("a %d b %d, want 80/s and 10/s", ra, rb)
	}
	a.paths[0].Demand, b.paths[0].Demand = 10*microPerUnit, 80*microPerUnit
	for range 2 {
		a.renew(false)
		b.renew(false)
		w.advance(5 * time.Second)
	}
	if ra, rb := a.grant.Paths[0].Levels[0].Rate, b.grant.Paths[0].Levels[0].Rate; ra != 10*microPerUnit || rb != 80*microPerUnit {
		t.Fatalf("after the move: a %d b %d, want 10/s and 80/s", ra, rb)
	}
}

// The reserve grows with central demand (1.2 ×) and with the largest cost (2 ×), never past
// half; a path is lent only above the threshold.
func TestShareReserveAndThreshold(t *testing.T) {
	w := newSimWorld(t, sharedDomain(100, 100, &Shares{}))
	a := w.holder("a", wholeDomain)
	a.renew(false)
	// Central callers attempt 40/s for a few seconds.
	for i := 0; i < 200; i++ {
		for range 4 {
			w.central("d", nil, 1)
		}
		w.advance(100 * time.Millisecond)
		if i%50 == 49 {
			a.renew(false)
		}
	}
	g, _ := a.renew(false)
	g, _ = a.renew(false)
	if r := g.Paths[0].Levels[0].Rate; r > 55*microPerUnit || r < 45*microPerUnit {
		t.Fatalf("with ~40/s of central demand the holder has %d/s, want about 100 − 1.2·40", r/microPerUnit)
	}
	// A holder whose largest cost is 40: b must be ≥ 80 of the lendable 90 − ... → too small.
	c := w.holder("c", SharePath{Domain: "d", Demand: math.MaxUint64, MaxCost: 40})
	if g, _ := c.renew(false); g.Paths[0].Status != ShareTooSmall {
		t.Fatalf("cost 40: %+v, want too_small", g.Paths[0])
	}
}

// Only levels marked lendable lend: a path through a rate-limited level without shares, or
// with a concurrency limit, is decided centrally.
func TestSharePathStatus(t *testing.T) {
	l := &Limits{Domains: []Domain{{Name: "d", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 100}, Shares: &Shares{},
		Descriptors: []Node{
			{Key: "t", Value: "lend", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 50}, Shares: &Shares{}},
			{Key: "t", Value: "keep", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 50}},
			{Key: "t", Value: "conc", Concurrency: &Concurrency{MaxInFlight: 2, LeaseTTL: time.Second}},
		}}}}
	w := newSimWorld(t, l)
	h := w.holder("a",
		SharePath{Domain: "d", Descriptors: []Entry{{"t", "lend"}}, Demand: math.MaxUint64},
		SharePath{Domain: "d", Descriptors: []Entry{{"t", "keep"}}, Demand: math.MaxUint64},
		SharePath{Domain: "d", Descriptors: []Entry{{"t", "conc"}}, Demand: math.MaxUint64},
		SharePath{Domain: "nope"},
	)
	g, err := h.renew(false)
	if err != nil {
		t.Fatal(err)
	}
	want := []ShareStatus{ShareLent, ShareCentral, ShareCentral, ShareInvalid}
	for i, p := range g.Paths {
		if p.Status != want[i] {
			t.Errorf("path %d: %s (%s), want %s", i, p.Status, p.Message, want[i])
		}
	}
	if lv := g.Paths[0].Levels; len(lv) != 2 || lv[0].Key != "d" || lv[1].Key != "d/t=lend" {
		t.Fatalf("levels %+v, want the domain then the tenant", lv)
	}
}

func TestShareLimitsValidation(t *testing.T) {
	bad := []*Limits{
		{Domains: []Domain{{Name: "d", Shares: &Shares{}}}}, // no rate
		sharedDomain(10, 10, &Shares{Lease: time.Millisecond}),
		sharedDomain(10, 10, &Shares{ReservePercent: 60}),
		sharedDomain(10, 10, &Shares{FallbackRate: 11}),
		{Domains: []Domain{{Name: "d", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1}, Concurrency: &Concurrency{MaxInFlight: 1, LeaseTTL: time.Second}, Shares: &Shares{}}}},
	}
	for i, l := range bad {
		if err := NewEngine().SetLimits(0, l); err == nil {
			t.Errorf("limits #%d accepted, want an error", i)
		} else {
			t.Logf("#%d: %v", i, err)
		}
	}
}

// Replays: the same seq gets the stored answer and changes nothing; an older one nothing.
func TestShareSeqReplays(t *testing.T) {
	w := newSimWorld(t, sharedDomain(100, 100, &Shares{}))
	h := w.holder("a", wholeDomain)
	g1, _ := h.renew(false)
	before := w.e.Hash()
	again, err := w.e.Share(w.fsmNow(), ShareRequest{Holder: h.key, Seq: h.seq, Paths: h.paths})
	if err != nil || !again.Duplicate || again.Paths[0].Levels[0] != g1.Paths[0].Levels[0] {
		t.Fatalf("repeated seq: %+v %v, want the stored answer", again, err)
	}
	if w.e.Hash() != before {
		t.Fatal("a repeated seq changed the state")
	}
	// The same seq naming other paths: its stored answer is not theirs (matched by position it
	// would give one path another's share), so it is refused and nothing changes.
	other := []SharePath{{Domain: "d", Descriptors: []Entry{{Key: "k", Value: "v"}}, Demand: 1, MaxCost: 1}}
	if g, err := w.e.Share(w.fsmNow(), ShareRequest{Holder: h.key, Seq: h.seq, Paths: other}); !errors.Is(err, ErrStaleShare) {
		t.Fatalf("repeated seq with other paths: %+v %v, want ErrStaleShare", g, err)
	}
	if w.e.Hash() != before {
		t.Fatal("a repeated seq with other paths changed the state")
	}
	h.renew(false)
	before = w.e.Hash()
	if _, err := w.e.Share(w.fsmNow(), ShareRequest{Holder: h.key, Seq: 1, Paths: h.paths}); err == nil {
		t.Fatal("an older seq was applied")
	}
	if w.e.Hash() != before {
		t.Fatal("an older seq changed the state")
	}
}

// The rewrite hysteresis never keeps a larger share at the expense of another flow: a small
// demand next to a holder of everything gets its share within two rounds.
func TestShareHysteresisYieldsToOthers(t *testing.T) {
	w := newSimWorld(t, sharedDomain(1000, 1000, &Shares{}))
	a := w.holder("a", SharePath{Domain: "d", Demand: 1500 * microPerUnit, MaxCost: 1})
	b := w.holder("b", SharePath{Domain: "d", Demand: 50 * microPerUnit, MaxCost: 1})
	a.renew(false)
	for range 2 {
		w.advance(5 * time.Second)
		b.renew(false)
		a.renew(false)
		a.renew(false) // the acknowledgement of the decrease
	}
	b.renew(false)
	if rb := b.grant.Paths[0]; rb.Status != ShareLent || rb.Levels[0].Rate != 50*microPerUnit {
		t.Fatalf("b: %+v, want 50/s", rb)
	}
}
