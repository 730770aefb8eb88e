//go:build chaos_bug_followerdecides

package fsm

import (
	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	"github.com/quotad/quotad/quota"
)

// ApplyLocal exists only in a deliberately broken build for the chaos suite
// (-tags chaos_bug_followerdecides): a follower decides on its own state, outside the log.
func (f *FSM) ApplyLocal(ops []*fsmv1.Op) *Result {
	f.mu.Lock()
	defer f.mu.Unlock()
	now := f.engine.Clock()
	res := &Result{Ops: make([]OpResult, len(ops))}
	for i, op := range ops {
		res.Ops[i] = f.applyOp(quota.Time(now), op)
	}
	return res
}
