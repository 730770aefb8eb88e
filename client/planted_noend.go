//go:build region_bug_noend

package client

// A deliberately broken build (make test-regions-bugs): a regional leader keeps deciding on
// its share after the grant ended without a renewal.
const plantedIgnoreShareEnd = true
