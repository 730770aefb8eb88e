//go:build !chaos_bug_holderexpiry

package main

import "github.com/quotad/quotad/client"

// allowFunc is the holder's decision: the Limiter's.
func allowFunc(lim *client.Limiter) func() bool { return lim.Allow }
