package cluster

import "time"

// SetBootstrapHold delays each node's first bootstrap check by hold(its ID) (nil: none). Set it
// before the nodes start and clear it after.
func SetBootstrapHold(hold func(id string) time.Duration) {
	if hold == nil {
		bootstrapHold.Store(nil)
		return
	}
	bootstrapHold.Store(&hold)
}
