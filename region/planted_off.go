//go:build !region_bug_doubleshare

package region

// plantedDoubleShare is true only in a deliberately broken build (make test-regions-bugs):
// every other unit admitted at a global level is not spent from the share, as if the share
// were twice what the global cluster lent. TestRegionsFaults must catch it.
const plantedDoubleShare = false
