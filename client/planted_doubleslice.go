//go:build region_bug_doubleslice

package client

// A deliberately broken build (make test-regions-bugs): a slice re-lent downstream is not
// charged against the regional leader's local bucket, so the region spends its share twice.
const plantedDoubleSlice = true
