package chaos

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"pgregory.net/rapid"
)

// TestCheckBudgetAgreesWithPorcupine is a differential test: on small random histories
// (legal ones built from a sequential run, then some with one outcome flipped or one
// admission added) the exact checker and porcupine's search must give the same verdict.
func TestCheckBudgetAgreesWithPorcupine(t *testing.T) {
	var legal, illegal int
	rapid.Check(t, func(t *rapid.T) {
		initial := rapid.Int64Range(1, 12).Draw(t, "initial")
		n := rapid.IntRange(1, 10).Draw(t, "n")
		// A sequential run at linearization points 10, 20, ...; each op's interval is drawn
		// around its point, so the true order is always one legal order.
		rem := initial
		ops := make([]Op, n)
		for i := range ops {
			cost := uint64(rapid.IntRange(1, 4).Draw(t, "cost"))
			point := int64(10 * (i + 1))
			call := point - rapid.Int64Range(0, 40).Draw(t, "before")
			ret := point + rapid.Int64Range(0, 40).Draw(t, "after")
			outcome := Denied
			if rem >= int64(cost) {
				outcome = Admitted
				rem -= int64(cost)
			}
			if rapid.IntRange(0, 5).Draw(t, "unknown") == 0 {
				outcome = Unknown // it happened as above, but nobody heard
			}
			ops[i] = spend(i, i, "b", cost, call, ret, outcome)
		}
		switch rapid.IntRange(0, 3).Draw(t, "mutation") {
		case 1: // flip one known outcome
			i := rapid.IntRange(0, n-1).Draw(t, "flip")
			switch ops[i].Outcome {
			case Admitted:
				ops[i].Outcome = Denied
			case Denied:
				ops[i].Outcome = Admitted
			}
		case 2: // one more admission somewhere (a unit granted twice?)
			call := rapid.Int64Range(0, int64(10*n+40)).Draw(t, "extraCall")
			ops = append(ops, spend(n, n, "b", uint64(rapid.IntRange(1, 4).Draw(t, "extraCost")), call, call+rapid.Int64Range(0, 40).Draw(t, "extraLen"), Admitted))
		}
		var pops []porcupine.Operation
		const infinity = 1 << 40
		for i, op := range ops {
			if op.Outcome == Unknown {
				ops[i].Return = infinity
			}
			pops = append(pops, porcupine.Operation{ClientId: op.Worker, Input: spendInput{Cost: op.Cost},
				Call: op.Call, Output: spendOutput{Outcome: op.Outcome}, Return: ops[i].Return})
		}
		want := porcupine.CheckOperations(budgetModel(initial), pops)
		got := checkBudget(initial, ops)
		if got.OK != want {
			t.Fatalf("initial %d, ops %+v: exact says %v (%s), porcupine says %v", initial, ops, got.OK, got.Why, want)
		}
		if want {
			legal++
		} else {
			illegal++
		}
	})
	// Both verdicts must have been exercised, or the agreement says little.
	if legal < 10 || illegal < 10 {
		t.Fatalf("only %d legal and %d illegal histories drawn", legal, illegal)
	}
	t.Logf("%d legal, %d illegal histories agreed", legal, illegal)
}

// TestCheckBudgetDecidesWhatPorcupineCannot: the history shape that made porcupine give up
// in CI (a fault leaves a generation's spends all pending together, answered seconds later by
// re-sends, plus ambiguous ones ending at infinity) is decided at once, both ways.
func TestCheckBudgetDecidesWhatPorcupineCannot(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const initial = 2000
	rem := int64(initial)
	var ops []Op
	for i := range 1400 {
		cost := uint64(1 + rng.IntN(4))
		point := int64(i) * int64(time.Millisecond)
		call := point - rng.Int64N(int64(3*time.Second))
		ret := point + rng.Int64N(int64(10*time.Second)) // answered by a re-send, late
		outcome := Denied
		if rem >= int64(cost) {
			outcome, rem = Admitted, rem-int64(cost)
		}
		op := spend(i, i%20, "g29-0", cost, call, ret, outcome)
		if i%200 == 7 {
			op.Outcome, op.Return = Unknown, 1<<60
		}
		ops = append(ops, op)
	}
	start := time.Now()
	if v := checkBudget(initial, ops); !v.OK {
		t.Fatalf("a legal history was rejected: %s", v.Why)
	}
	// One denial of an op that had budget left: it made the last admissions impossible.
	for i := range ops {
		if ops[i].Outcome == Admitted && ops[i].Cost >= 1 {
			ops[i].Outcome = Denied
			ops[i].Call, ops[i].Return = 0, 1 // denied before anything was spent
			break
		}
	}
	v := checkBudget(initial, ops)
	if v.OK {
		t.Fatalf("a denial at the start of a full bucket was accepted")
	}
	t.Logf("rejected: %s", v.Why)
	if d := time.Since(start); d > 30*time.Second {
		t.Fatalf("two checks of 1,400 ops took %v", d)
	}
}
