//go:build !chaos

package main

import "github.com/quotad/quotad/cluster"

// nodeClock is the system clock; chaos builds replace it with a controllable one.
func nodeClock() cluster.Clock { return cluster.SystemClock{} }
