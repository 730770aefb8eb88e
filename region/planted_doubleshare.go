//go:build region_bug_doubleshare

package region

// A deliberately broken build (make test-regions-bugs): every other admission at a global
// level is free, doubling the region's share.
const plantedDoubleShare = true
