//go:build region_bug_fallbackshare

package client

// A deliberately broken build (make test-regions-bugs): the fallback after a grant's end
// runs at the grant's rate, not at the holder's slice of fallback_rate.
const plantedFallbackAtShareRate = true
