//go:build !linux

package wal

import "os"

// datasync falls back to a full fsync where fdatasync is not available.
func datasync(f *os.File) error { return f.Sync() }

// preallocate is not attempted outside Linux: segment files grow with each write.
func preallocate(*os.File, int64) (bool, error) { return false, nil }

// lockDir is a no-op outside Linux; the stable store's BoltDB lock still guards the data dir.
func lockDir(*os.File) error { return nil }
