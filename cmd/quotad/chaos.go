//go:build chaos

package main

import (
	"net/http"

	"github.com/quotad/quotad/chaos/faults"
	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/rpc"
)

// The chaos build links the fault hooks (chaos/faults) into the node: a skewable clock, a
// partitionable Raft stream layer, a slowable log store, a gRPC interceptor that loses replies
// of committed admissions, and their HTTP controls at /chaos/.
var hooks = faults.Hooks()

func nodeClock() cluster.Clock { return hooks.Clock }

func chaosHooks(c *rpc.AgentConfig) {
	c.Cluster.WrapStreamLayer = hooks.WrapStreamLayer
	c.Cluster.WrapLogStore = hooks.WrapLogStore
	c.ExtraHTTP = map[string]http.Handler{faults.HTTPPrefix: hooks.Handler}
	c.UnaryInterceptors = append(c.UnaryInterceptors, hooks.UnaryInterceptor)
}
