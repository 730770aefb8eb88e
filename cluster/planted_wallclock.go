//go:build chaos_bug_wallclock

package cluster

// A deliberately broken build for the chaos suite: the leader stamps wall-clock time.
const plantedWallClock = true
