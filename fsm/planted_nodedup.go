//go:build chaos_bug_nodedup

package fsm

// A deliberately broken build for the chaos suite: retries are decided again, not deduplicated.
const plantedNoDedup = true
