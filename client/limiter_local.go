package client

import "runtime"

// Local-only decisions for a regional cluster's leader (issue 13, package region): it holds
// shares of the global cluster's buckets and must never put a cross-region call on its
// callers' request path, so where the Limiter would ask the cluster it answers no instead.

// AllowLocalN is AllowN without the central path: it spends n units from the local grant
// (or, once the grant has ended unrenewed, from the fallback slice) and reports true, or
// reports false without calling the cluster — also when the path is not decided locally (no
// grant yet, not lent, invalid). When ok, undo gives the n units back to the buckets they
// came from (a later check of the same request refused it); undo is nil otherwise.
func (l *Limiter) AllowLocalN(n uint64) (ok bool, undo func()) {
	p := l.p
	if p == nil || l.closed.Load() {
		return false, nil
	}
	if n == 0 {
		n = 1
	}
	p.attempts.Add(n)
	if n > p.maxCost.Load() {
		p.raiseMaxCost(n)
	}
	for {
		st := p.state.Load()
		if st.mode != modeLocal || n > st.maxLocal {
			return false, nil
		}
		slow, fast := l.h.clock.now()
		if slow < st.pausedUntil {
			return false, nil // a pause binds the fallback too (AllowN)
		}
		if fast >= st.endFast && !plantedIgnoreShareEnd {
			if st.fallback == nil {
				return false, nil
			}
			if ok, _ := st.fallback.take(n, slow); ok {
				return true, func() { st.fallback.untake(n) }
			}
			return false, nil
		}
		ok, reload := st.takeAll(n, slow)
		if !reload {
			if !ok {
				return false, nil
			}
			return true, func() {
				for _, g := range st.levels {
					g.untake(n)
				}
			}
		}
		runtime.Gosched() // a new grant is being installed
	}
}
