package chaos

import (
	"cmp"
	"fmt"
	"slices"
	"time"
)

// budgetVerdict is the exact linearizability decision for the spends on one non-refilling
// budget bucket: OK, or why no legal order exists.
type budgetVerdict struct {
	OK  bool
	Why string
}

// checkBudget decides, exactly and in O(n log n + n·initial), whether spends on one
// non-refilling bucket of initial units are linearizable against budgetModel's sequential
// specification (admit iff remaining ≥ cost; deny iff remaining < cost; an unknown op either
// way). Porcupine searches orders and can give up; this uses the model's structure instead:
//
//   - The remaining balance only falls, so an admitted op's condition (remaining ≥ cost before
//     it, i.e. ≥ 0 after it) holds in every order iff all admitted units together — known
//     admissions plus the unknown ops taken as admitted — are at most initial.
//   - A denied op of cost c needs more than initial−c units admitted before it. Linearizing
//     it as late as its interval allows (at its return) and every admission as early (at its
//     call) only adds admissions before each denial and keeps the total; any legal order can
//     be moved to that one, and that one is a legal order (points inside the intervals, ties
//     admissions first). So a history is linearizable iff some choice S of unknown ops to
//     count as admitted has total(admitted) + total(S) ≤ initial and, for every denial d,
//     the admitted and S ops called by d's return sum to more than initial − cost(d).
//
// The choice of S is a walk over events in time order keeping the set of reachable sums of S
// so far (0..slack): an unknown op's call adds its cost to each, a denial removes the sums
// below what it needs. Ops with outcome Failed never happened and are ignored.
func checkBudget(initial int64, ops []Op) budgetVerdict {
	var admitted int64
	for _, op := range ops {
		if op.Outcome == Admitted {
			admitted += int64(op.Cost)
		}
	}
	if admitted > initial {
		return budgetVerdict{Why: fmt.Sprintf("%d units admitted from a budget of %d: a double spend", admitted, initial)}
	}
	slack := initial - admitted

	type event struct {
		t    int64
		kind int // 0 admission (known or maybe), 1 denial check; at equal times admissions first
		op   Op
	}
	var evs []event
	for _, op := range ops {
		switch op.Outcome {
		case Admitted, Unknown:
			evs = append(evs, event{t: op.Call, kind: 0, op: op})
		case Denied:
			evs = append(evs, event{t: op.Return, kind: 1, op: op})
		}
	}
	slices.SortStableFunc(evs, func(a, b event) int {
		return cmp.Or(cmp.Compare(a.t, b.t), cmp.Compare(a.kind, b.kind))
	})

	// reach[s]: some choice of the unknown ops seen so far, with sum s, satisfies every
	// denial seen so far. Sums below lo have been ruled out by a denial.
	reach := make([]bool, slack+1)
	reach[0] = true
	lo := int64(0)
	var prefix int64 // known admitted units called so far
	for _, e := range evs {
		c := int64(e.op.Cost)
		switch {
		case e.kind == 0 && e.op.Outcome == Admitted:
			prefix += c
		case e.kind == 0: // unknown: taken as admitted or not
			for s := slack; s-c >= lo; s-- {
				if reach[s-c] {
					reach[s] = true
				}
			}
		default: // denial: more than initial−c admitted before it
			need := initial - c + 1 - prefix
			for ; lo < need && lo <= slack; lo++ {
				reach[lo] = false
			}
			if !slices.Contains(reach[min(lo, slack+1):], true) {
				return budgetVerdict{Why: fmt.Sprintf(
					"spend #%d of %d denied at %v, but at most %d of %d units can have been admitted by then: "+
						"a lost or phantom debit", e.op.RequestID, c, time.Duration(e.t).Round(time.Millisecond),
					prefix+reachBefore(ops, e.t, slack), initial)}
			}
		}
	}
	return budgetVerdict{OK: true}
}

// reachBefore is the most the unknown ops called by t can add (capped by slack), for the
// message only.
func reachBefore(ops []Op, t int64, slack int64) int64 {
	var s int64
	for _, op := range ops {
		if op.Outcome == Unknown && op.Call <= t {
			s += int64(op.Cost)
		}
	}
	return min(s, slack)
}
