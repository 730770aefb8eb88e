package chaos

import (
	"fmt"
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
	// Timeout bounds porcupine per bucket; a timeout makes the result inconclusive (not OK).
	Timeout time.Duration
	// VisualizeDir, if set, receives porcupine's HTML visualization of every bucket that is
	// not linearizable.
	VisualizeDir string
}

// LinearizabilityStats are porcupine's numbers for the report.
type LinearizabilityStats struct {
	Buckets  int           `json:"buckets"`
	Ops      int           `json:"ops"`
	Unknown  int           `json:"unknown"`
	Resolved int           `json:"resolved"`
	Elapsed  time.Duration `json:"elapsed_ns"`
}

// CheckLinearizable checks the spends on every non-refilling budget bucket with porcupine,
// one partition per bucket. Ops with no answer end at infinity (after every other op) and may
// have been admitted or not; ops whose outcome was learned later by re-sending the request ID
// end at that answer.
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
			for _, op := range by[b] {
				if op.Outcome == Failed {
					continue
				}
				ret := op.Return
				if op.Outcome == Unknown {
					ret = infinity
					st.Unknown++
				}
				if op.Resolved {
					st.Resolved++
				}
				ops = append(ops, porcupine.Operation{
					ClientId: op.Worker,
					Input:    spendInput{Cost: op.Cost, RequestID: op.RequestID},
					Call:     op.Call,
					Output:   spendOutput{Outcome: op.Outcome},
					Return:   ret,
				})
			}
			st.Buckets++
			st.Ops += len(ops)
			r.Checked += len(ops)
			verdict, info := porcupine.CheckOperationsVerbose(model, ops, cfg.Timeout)
			switch verdict {
			case porcupine.Ok:
			case porcupine.Illegal:
				r.anomaly("bucket %q: %d spends are not linearizable (double spend, lost or phantom debit)", b, len(ops))
				if cfg.VisualizeDir != "" {
					path := filepath.Join(cfg.VisualizeDir, "porcupine-"+safeName(b)+".html")
					if err := os.MkdirAll(cfg.VisualizeDir, 0o755); err == nil {
						if err := porcupine.VisualizePath(model, info, path); err == nil {
							r.Files = append(r.Files, path)
						}
					}
				}
			default:
				r.anomaly("bucket %q: porcupine gave up after %v on %d ops (inconclusive)", b, cfg.Timeout, len(ops))
			}
		}
		st.Elapsed = time.Since(start)
		r.note("%d buckets, %d ops (%d unknown, %d resolved by re-send), porcupine %v", st.Buckets, st.Ops, st.Unknown, st.Resolved, st.Elapsed.Round(time.Millisecond))
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
