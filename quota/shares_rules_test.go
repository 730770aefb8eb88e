package quota

import (
	"errors"

	"testing"
	"time"
)

// One timeline per share rule. Each runs twice: with the rule, admissions by holders and
// central callers together stay within burst + rate·T(1+ρ) over every window; with the rule
// switched off (Engine.rules, the naive alternative), the same timeline breaks the bound.

type ruleTimeline struct {
	name        string
	off         func(*ruleSet)
	rate, burst uint64
	rho         float64
	run         func(t *testing.T, w *simWorld)
}

func (rt ruleTimeline) check(t *testing.T, limits *Limits) {
	t.Helper()
	for _, on := range []bool{true, false} {
		w := newSimWorld(t, limits)
		if !on {
			rt.off(&w.e.rules)
		}
		rt.run(t, w)
		ex, where := boundViolation(w.adm, rt.rate, rt.burst, rt.rho)
		switch {
		case on && ex > 1e-6:
			t.Errorf("%s: with the rule, %d admissions exceed the bound by %.2f units over %s", rt.name, len(w.adm), ex, where)
		case !on && ex <= 1e-6:
			t.Errorf("%s: without the rule the timeline should break the bound, but the worst window is %.2f units inside it", rt.name, -ex)
		case !on:
			t.Logf("%s: without the rule: %.1f units over the bound in %s", rt.name, ex, where)
		}
	}
}

// everyone spends greedily every step, the holder renewing every renew (0: never).
func greedyRun(w *simWorld, hs []*simHolder, until, step, renew time.Duration, central bool) {
	var sinceRenew time.Duration
	for w.real < Time(until) {
		if renew > 0 && sinceRenew >= renew {
			for _, h := range hs {
				h.renew(false)
			}
			sinceRenew = 0
		}
		for _, h := range hs {
			h.greedy(0)
		}
		if central {
			w.centralGreedy("d", nil)
		}
		w.e.Tick(w.fsmNow())
		w.advance(step)
		sinceRenew += step
	}
}

// Conservation, part 1: the central bucket refills at rate − Σr.
func TestShareRuleCentralRefillsAtRateMinusLent(t *testing.T) {
	ruleTimeline{name: "central rate cut", off: func(r *ruleSet) { r.noCentralCut = true }, rate: 100, burst: 100,
		run: func(t *testing.T, w *simWorld) {
			h := w.holder("a", wholeDomain)
			if _, err := h.renew(false); err != nil {
				t.Fatal(err)
			}
			greedyRun(w, []*simHolder{h}, 10*time.Second, 50*time.Millisecond, 5*time.Second, true)
		}}.check(t, sharedDomain(100, 100, &Shares{}))
}

// Conservation, part 2: a first grant's tokens come out of the central balance (the clamp's
// excess), never from nothing.
func TestShareRuleFirstTokensComeFromTheClamp(t *testing.T) {
	ruleTimeline{name: "initial from the clamp", off: func(r *ruleSet) { r.freeInitial = true }, rate: 100, burst: 100,
		run: func(t *testing.T, w *simWorld) {
			for range 90 {
				w.central("d", nil, 1) // the central bucket is at 10 of 100
			}
			h := w.holder("a", wholeDomain)
			if _, err := h.renew(false); err != nil {
				t.Fatal(err)
			}
			greedyRun(w, []*simHolder{h}, 2*time.Second, 50*time.Millisecond, 0, true)
		}}.check(t, sharedDomain(100, 100, &Shares{}))
}

// A bucket with lends is never swept: full at burst − Σb, it would come back full at burst
// once the lend ends.
func TestShareRuleLentBucketNeverSwept(t *testing.T) {
	ruleTimeline{name: "never sweep", off: func(r *ruleSet) { r.sweepLent = true }, rate: 100, burst: 100,
		run: func(t *testing.T, w *simWorld) {
			h := w.holder("a", wholeDomain)
			if _, err := h.renew(false); err != nil { // crashes after its first grant
				t.Fatal(err)
			}
			greedyRun(w, []*simHolder{h}, 5*time.Second, 50*time.Millisecond, 0, true)
			// The central callers pause until the lend has ended: their part fills up (to
			// burst − b) and a sweep sees it full.
			greedyRun(w, []*simHolder{h}, 15300*time.Millisecond, 50*time.Millisecond, 0, false)
			greedyRun(w, []*simHolder{h}, 17*time.Second, 50*time.Millisecond, 0, true)
		}}.check(t, sharedDomain(100, 100, &Shares{ReservePercent: 1}))
}

// Tokens move only at the first grant: a renewal that refilled the holder's bucket would
// hand out b units from nothing every term/3.
func TestShareRuleRenewalsMoveNoTokens(t *testing.T) {
	ruleTimeline{name: "no tokens at renewal", off: func(r *ruleSet) { r.renewRefills = true }, rate: 100, burst: 100,
		run: func(t *testing.T, w *simWorld) {
			h := w.holder("a", wholeDomain)
			if _, err := h.renew(false); err != nil {
				t.Fatal(err)
			}
			greedyRun(w, []*simHolder{h}, 12*time.Second, 50*time.Millisecond, 2*time.Second, true)
		}}.check(t, sharedDomain(100, 100, &Shares{}))
}

// Grants are acknowledged: a decrease whose reply is lost leaves the holder on its old, larger
// share; the engine must keep charging that one until the holder acknowledges the smaller.
func TestShareRuleDecreaseChargedUntilAcknowledged(t *testing.T) {
	ruleTimeline{name: "acknowledged grants", off: func(r *ruleSet) { r.noAck = true }, rate: 100, burst: 100,
		run: func(t *testing.T, w *simWorld) {
			h := w.holder("a", wholeDomain)
			if _, err := h.renew(false); err != nil {
				t.Fatal(err)
			}
			greedyRun(w, []*simHolder{h}, 2*time.Second, 50*time.Millisecond, 0, true)
			h.paths = []SharePath{{Domain: "d", Demand: 10 * microPerUnit, MaxCost: 1}}
			if g, err := h.renew(true); err != nil || g.Paths[0].Levels[0].Rate >= 50*microPerUnit {
				t.Fatalf("the decrease: %+v %v", g, err)
			}
			greedyRun(w, []*simHolder{h}, 12*time.Second, 50*time.Millisecond, 0, true)
		}}.check(t, sharedDomain(100, 100, &Shares{}))
}

// A command applies only if its seq is newer: a replayed release would put the same tokens
// back twice, the second time while the holder holds a new lend.
func TestShareRuleReplayedReleaseChangesNothing(t *testing.T) {
	ruleTimeline{name: "seq", off: func(r *ruleSet) { r.noSeq = true }, rate: 100, burst: 100,
		run: func(t *testing.T, w *simWorld) {
			h := w.holder("a", wholeDomain)
			if _, err := h.renew(false); err != nil {
				t.Fatal(err)
			}
			toks := []LevelTokens{{Key: "d", Tokens: h.local["d"].tokens}}
			if _, err := h.release(); err != nil {
				t.Fatal(err)
			}
			relSeq := h.seq
			w.centralGreedy("d", nil)
			if _, err := h.renew(false); err != nil {
				t.Fatal(err)
			}
			// The release arrives again (a client retry, a replayed log entry's request).
			_, err := w.e.ReleaseShare(w.fsmNow(), ShareRelease{Holder: h.key, Seq: relSeq, Tokens: toks})
			if !w.e.rules.noSeq && !errors.Is(err, ErrStaleShare) {
				t.Fatalf("replayed release: %v, want ErrStaleShare", err)
			}
			greedyRun(w, []*simHolder{h}, 3*time.Second, 50*time.Millisecond, 0, true)
		}}.check(t, sharedDomain(100, 100, &Shares{}))
}

// The engine charges a grant until its end + m_F: with a leader clock 1 % fast (FSM time runs
// ahead of real time) and a holder without its own margin, charging until the end only frees
// the central rate while the holder still refills. (The burst is small so that the window
// around the end has no slack.)
func TestShareRuleChargedUntilEndPlusMargin(t *testing.T) {
	ruleTimeline{name: "m_F", off: func(r *ruleSet) { r.noMarginF = true }, rate: 100, burst: 5, rho: 0.01,
		run: func(t *testing.T, w *simWorld) {
			w.fsmFast = 0.01
			h := w.holder("a", wholeDomain)
			h.marginH = 0
			if _, err := h.renew(false); err != nil {
				t.Fatal(err)
			}
			greedyRun(w, []*simHolder{h}, 16*time.Second, 10*time.Millisecond, 0, true)
		}}.check(t, sharedDomain(100, 5, &Shares{}))
}

// A limit decrease is absorbed by the central part first: the central rate falls to
// new rate − Σr (here to nothing) at once, and the holder is bound at its next
// acknowledgement; from then on the new rate holds for everyone together.
func TestShareDecreaseAbsorbedByCentralFirst(t *testing.T) {
	w := newSimWorld(t, sharedDomain(100, 100, &Shares{}))
	h := w.holder("a", wholeDomain)
	if _, err := h.renew(false); err != nil {
		t.Fatal(err)
	}
	greedyRun(w, []*simHolder{h}, time.Second, 50*time.Millisecond, 0, true)
	if err := w.e.SetLimits(w.fsmNow(), sharedDomain(50, 50, &Shares{})); err != nil {
		t.Fatal(err)
	}
	st, _ := w.e.Status(w.fsmNow(), "d", nil)
	if st[0].Limit != 0 || st[0].Burst != 0 {
		t.Fatalf("central part after the decrease below what is lent: limit %d burst %d, want 0 and 0", st[0].Limit, st[0].Burst)
	}
	h.renew(false) // bound by the new limits; the old grant is still charged (not acknowledged)
	h.renew(false) // acknowledges the smaller one
	lends, _ := w.e.ShareStatus("d")
	if len(lends) != 1 || lends[0].LentRate > 45*microPerUnit {
		t.Fatalf("lends after the acknowledgement: %+v, want at most 45/s", lends)
	}
	from := len(w.adm)
	start := w.real
	greedyRun(w, []*simHolder{h}, 12*time.Second, 50*time.Millisecond, 5*time.Second, true)
	w.adm = w.adm[from:]
	if ex, where := boundViolation(w.adm, 50, 50, 0); ex > 1e-6 {
		t.Fatalf("after the acknowledgement the new limit does not hold: %.1f over in %s (from %v)", ex, where, time.Duration(start))
	}
}

// Every reply carries the pauses covering the holder's paths.
func TestShareReplyCarriesPauses(t *testing.T) {
	w := newSimWorld(t, sharedDomain(100, 100, &Shares{}))
	if _, err := w.e.Pause(0, "d", nil, Time(3*time.Second)); err != nil {
		t.Fatal(err)
	}
	h := w.holder("a", wholeDomain)
	g, err := h.renew(false)
	if err != nil {
		t.Fatal(err)
	}
	if g.Paths[0].PausedFor != 3*time.Second {
		t.Fatalf("PausedFor %v, want 3s", g.Paths[0].PausedFor)
	}
}

// A crashed holder's rate returns after its end + m_F; its tokens are lost.
func TestShareCrashedHolderRateReturns(t *testing.T) {
	w := newSimWorld(t, sharedDomain(100, 100, &Shares{Lease: 3 * time.Second}))
	h := w.holder("a", wholeDomain)
	g, err := h.renew(false)
	if err != nil {
		t.Fatal(err)
	}
	end := Time(g.Term + ShareMarginFSM)
	w.e.Tick(end - 1)
	if l, _ := w.e.ShareStatus("d"); len(l) != 1 || l[0].LentRate == 0 {
		t.Fatalf("just before end + m_F: %+v, want the lend", l)
	}
	w.e.Tick(end)
	if l, _ := w.e.ShareStatus("d"); len(l) != 0 {
		t.Fatalf("at end + m_F: %+v, want no lend", l)
	}
	if st, _ := w.e.Status(end, "d", nil); st[0].Limit != 100 || st[0].Burst != 100 {
		t.Fatalf("central part after the lend ended: %+v", st[0])
	}

}
