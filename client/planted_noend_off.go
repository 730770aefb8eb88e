//go:build !region_bug_noend

package client

// plantedIgnoreShareEnd is true only in a deliberately broken build (make test-regions-bugs):
// AllowLocalN keeps deciding on a grant after its end instead of falling back. The fault test
// of regional clusters (region.TestRegionsFaults) must catch it.
const plantedIgnoreShareEnd = false
