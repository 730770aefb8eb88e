package fsm

import "time"

// LimitsVersion is the version of the limits this replica enforces (issue 13: a regional
// leader's share holder follows it without copying the limits on every admission).
func (f *FSM) LimitsVersion() uint64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.engine.LimitsVersion()
}

// decidedMargin: Decided answers true only for a record that outlives the FSM clock by this
// much, so the retry's entry, applied a little later, still finds it (and is answered from it
// rather than decided anew).
const decidedMargin = 10 * time.Second

// Decided reports whether this replica remembers a decision for request id of clientID
// under owner (the caller's identity name, as the leader writes it into the op) for at least
// decidedMargin more of FSM time: the leader will answer a retry of it from the dedup table
// without deciding again. A regional leader spends no global share for such a retry (issue
// 13: a retried request no longer spends the share twice). Read only; id 0 is never
// remembered.
func (f *FSM) Decided(owner, clientID string, id uint64) bool {
	if id == 0 {
		return false
	}
	f.mu.RLock()
	defer f.mu.RUnlock()
	seq, ok := f.dedup.lookup(ownedClient(owner, clientID), id)
	if !ok {
		return false
	}
	c, i := f.dedup.at(seq)
	return c.recs[i].expires > f.engine.Clock().Add(decidedMargin)
}
