//go:build !region_bug_doubleslice

package client

// plantedDoubleSlice is true only in a deliberately broken build (make test-regions-bugs):
// a slice of the regional leader's upstream share lent downstream is not charged against its
// local bucket (lender.go), as if the share were lent twice. TestRegionsRelend must catch it.
const plantedDoubleSlice = false
