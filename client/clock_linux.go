package client

import "golang.org/x/sys/unix"

// systemClock reads CLOCK_MONOTONIC_RAW and CLOCK_BOOTTIME.
type systemClock struct{}

func (systemClock) Now() (raw, boot int64) {
	var r, b unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC_RAW, &r)
	_ = unix.ClockGettime(unix.CLOCK_BOOTTIME, &b)
	return r.Nano(), b.Nano()
}
