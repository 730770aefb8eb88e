package fsm

// LimitsVersion is the version of the limits this replica enforces (issue 13: a regional
// leader's share holder follows it without copying the limits on every admission).
func (f *FSM) LimitsVersion() uint64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.engine.LimitsVersion()
}
