//go:build !chaos_bug_nodedup

package fsm

// plantedNoDedup is true only in the chaos suite's deliberately broken build
// (-tags chaos_bug_nodedup), which must be caught double-spending on retries.
const plantedNoDedup = false
