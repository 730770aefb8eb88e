package chaos

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"time"

	"github.com/anishathalye/porcupine"
)

// spendInput and spendOutput are the porcupine operation values of a budget spend.
type spendInput struct {
	Cost      uint64
	RequestID uint64
}

type spendOutput struct {
	Outcome string // Admitted, Denied or Unknown
}

// budgetModel is the sequential specification of a non-refilling bucket: the state is the
// remaining units; a spend of cost is admitted iff remaining ≥ cost, and debits it then. An
// op whose outcome is unknown may have been admitted or not (hence the nondeterministic
// model): either way it happened at most once, because all its attempts shared one request ID.
func budgetModel(initial int64) porcupine.Model {
	nm := &porcupine.NondeterministicModel{
		Init: func() []any { return []any{initial} },
		Step: func(state, input, output any) []any {
			rem := state.(int64)
			in := input.(spendInput)
			cost := int64(in.Cost)
			switch output.(spendOutput).Outcome {
			case Admitted:
				if rem >= cost {
					return []any{rem - cost}
				}
			case Denied:
				if rem < cost {
					return []any{rem}
				}
			default: // unknown
				if rem >= cost {
					return []any{rem - cost, rem}
				}
				return []any{rem}
			}
			return nil
		},
		Equal: func(a, b any) bool { return a.(int64) == b.(int64) },
		Hash:  func(s any) uint64 { return uint64(s.(int64)) },
		DescribeOperation: func(input, output any) string {
			in := input.(spendInput)
			return fmt.Sprintf("spend(%d) #%d → %s", in.Cost, in.RequestID, output.(spendOutput).Outcome)
		},
		DescribeState: func(s any) string { return fmt.Sprintf("remaining %d", s.(int64)) },
	}
	return nm.ToModel()
}

// LinearizabilityConfig configures CheckLinearizable.
type LinearizabilityConfig struct {
	// Initial is every budget bucket's starting balance (its burst; buckets start full).
	Initial int64
	// Timeout bounds porcupine's cross-check of one bucket and Budget all of them together
	// (0: no bound, either). The verdict is checkBudget's, which is exact and never gives
	// up; porcupine re-checks each bucket independently while the budget lasts, and a
	// bucket it cannot decide in time is only counted, not an anomaly.
	Timeout time.Duration
	Budget  time.Duration
	// VisualizeDir, if set, receives porcupine's HTML visualization of every bucket that is
	// not linearizable (when porcupine finishes on it).
	VisualizeDir string
}

// LinearizabilityStats are the checkers' numbers for the report.
type LinearizabilityStats struct {
	Buckets  int           `json:"buckets"`
	Ops      int           `json:"ops"`
	Unknown  int           `json:"unknown"`
	Resolved int           `json:"resolved"`
	Elapsed  time.Duration `json:"elapsed_ns"`
	// CrossChecked buckets porcupine decided too (and agreed on); Undecided ones it gave up
	// on or had no budget left for.
	CrossChecked int `json:"cross_checked"`
	Undecided    int `json:"porcupine_undecided"`
}

// CheckLinearizable checks the spends on every non-refilling budget bucket, one partition
// per bucket: checkBudget decides exactly, and porcupine (a general search over orders)
// checks the same history independently — a disagreement is an anomaly of the checkers
// themselves. Ops with no answer end at infinity (after every other op) and may have been
// admitted or not; ops whose outcome was learned later by re-sending the request ID end at
// that answer.
func CheckLinearizable(h *History, cfg LinearizabilityConfig) (Result, LinearizabilityStats) {
	var st LinearizabilityStats
	res := timed("linearizable-spends", func(r *Result) {
		model := budgetModel(cfg.Initial)
		buckets, by := opsOf(h, KindSpend)
		var end int64
		for _, op := range h.Ops {
			end = max(end, op.Return, op.Call)
		}
		infinity := end + int64(time.Hour)
		start := time.Now()
		for _, b := range buckets {
			var ops []porcupine.Operation
			var spends []Op
			for _, op := range by[b] {
				if op.Outcome == Failed {
					continue
				}
				if op.Outcome == Unknown {
					op.Return = infinity
					st.Unknown++
				}
				if op.Resolved {
					st.Resolved++
				}
				spends = append(spends, op)
				ops = append(ops, porcupine.Operation{
					ClientId: op.Worker,
					Input:    spendInput{Cost: op.Cost, RequestID: op.RequestID},
					Call:     op.Call,
					Output:   spendOutput{Outcome: op.Outcome},
					Return:   op.Return,
				})
			}
			st.Buckets++
			st.Ops += len(ops)
			r.Checked += len(ops)
			v := checkBudget(cfg.Initial, spends)
			if !v.OK {
				r.anomaly("bucket %q: %d spends are not linearizable: %s", b, len(ops), v.Why)
			}
			timeout := cfg.Timeout
			if timeout <= 0 {
				timeout = time.Duration(math.MaxInt64) // porcupine's 0: no bound
			}
			if cfg.Budget > 0 {
				timeout = min(timeout, cfg.Budget-time.Since(start))
			}
			if timeout <= 0 {
				st.Undecided++
				continue
			}
			verdict, info := porcupine.CheckOperationsVerbose(model, ops, timeout)
			switch {
			case verdict == porcupine.Unknown:
				st.Undecided++
			case (verdict == porcupine.Ok) != v.OK:
				r.anomaly("bucket %q: the checkers disagree (exact: linearizable=%v, porcupine: %v) on %d ops", b, v.OK, verdict, len(ops))
			default:
				st.CrossChecked++
			}
			if verdict == porcupine.Illegal && cfg.VisualizeDir != "" {
				path := filepath.Join(cfg.VisualizeDir, "porcupine-"+safeName(b)+".html")
				if err := os.MkdirAll(cfg.VisualizeDir, 0o755); err == nil {
					if err := porcupine.VisualizePath(model, info, path); err == nil {
						r.Files = append(r.Files, path)
					}
				}
			}
		}
		st.Elapsed = time.Since(start)
		r.note("%d buckets, %d ops (%d unknown, %d resolved by re-send); porcupine agreed on %d buckets, undecided on %d; %v",
			st.Buckets, st.Ops, st.Unknown, st.Resolved, st.CrossChecked, st.Undecided, st.Elapsed.Round(time.Millisecond))
		if st.Ops == 0 {
			r.anomaly("no spend on a budget bucket: nothing was checked")
		}
	})
	return res, st
}

func safeName(s string) string {
	b := []byte(s)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			b[i] = '_'
		}
	}
	return string(b)
}
