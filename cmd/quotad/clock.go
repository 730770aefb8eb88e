//go:build !chaos

package main

import (
	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/rpc"
)

// nodeClock is the system clock; chaos builds replace it with a controllable one.
func nodeClock() cluster.Clock { return cluster.SystemClock{} }

// chaosHooks adds nothing outside chaos builds.
func chaosHooks(*rpc.AgentConfig) {}
