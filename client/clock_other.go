//go:build !linux

package client

import "time"

var processStart = time.Now()

// systemClock outside Linux reads Go's monotonic clock for both (no raw or boot clock is
// available portably): the Limiter is then only as good as that clock.
type systemClock struct{}

func (systemClock) Now() (raw, boot int64) {
	d := int64(time.Since(processStart))
	return d, d
}
