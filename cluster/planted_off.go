//go:build !chaos_bug_wallclock

package cluster

// plantedWallClock is true only in the chaos suite's deliberately broken build
// (-tags chaos_bug_wallclock): the leader stamps wall-clock time instead of base + monotonic
// elapsed time, which clock faults must expose.
const plantedWallClock = false
