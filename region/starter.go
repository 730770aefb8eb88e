package region

import (
	"context"
	"log/slog"

	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/quota"
	"github.com/quotad/quotad/rpc"
)

// Agent returns the rpc.RegionConfig of an agent of regional cluster name under the global
// cluster reached with global (addresses, CA, a worker credential of the global cluster
// scoped to the domains the region serves): the agent starts a Holder each time it becomes
// the regional leader and closes it when it stops leading; the holder makes the global
// cluster's limits (those domains) the regional cluster's.
func Agent(name string, global client.Config) *rpc.RegionConfig {
	return &rpc.RegionConfig{Name: name, Start: func(nodeID string, limits func() *quota.Limits, follow func(context.Context, *quota.Limits) (bool, error), log *slog.Logger) (rpc.RegionHolder, error) {
		return Start(Config{Region: name, Node: nodeID, Global: global, Limits: limits, Follow: follow, Logger: log})
	}}
}
