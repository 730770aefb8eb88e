//go:build !region_bug_fallbackshare

package client

// plantedFallbackAtShareRate is true only in a deliberately broken build (make
// test-regions-bugs): once a grant has ended unrenewed, the Limiter admits at the grant's
// rate instead of its slice of fallback_rate. region.TestRegionsFaults must catch it.
const plantedFallbackAtShareRate = false
