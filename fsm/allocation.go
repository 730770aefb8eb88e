package fsm

import "github.com/quotad/quotad/quota"

// Allocation lists the rate-limited levels of the installed limits with the buckets each holds
// (quota.Engine.Allocation; reads every stored bucket under the read lock).
func (f *FSM) Allocation() []quota.LevelAllocation {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.engine.Allocation()
}
