package cluster

import "errors"

// Sentinel errors. Errors returned by Node wrap one of these with %w (and, where one caused
// it, the underlying raft error too, so errors.Is(err, raft.ErrNotLeader) also works).
var (
	// ErrNotLeader: this node is not the leader, or has just become leader and not yet
	// finished establishing its clock. Nothing was appended; retry on the leader (Leader()).
	ErrNotLeader = errors.New("cluster: not the leader")

	// ErrOutcomeUnknown: the entry was handed to Raft but the node lost leadership, shut
	// down, or the context ended before it was known to commit. It may or may not be
	// applied. A retry must be idempotent (same request ID) to be safe.
	ErrOutcomeUnknown = errors.New("cluster: outcome unknown")

	// ErrShutdown: the node is shut down or shutting down.
	ErrShutdown = errors.New("cluster: node is shut down")

	// ErrUnknownServer: a server ID that is not in the Raft configuration.
	ErrUnknownServer = errors.New("cluster: unknown server")

	// ErrNoLiveMajority: a membership change refused because the voters it would leave do not
	// have a majority that answered the leader recently; committing it would stop the cluster
	// until enough of them return. Nothing was changed.
	ErrNoLiveMajority = errors.New("cluster: the remaining voters would have no live majority")
)
