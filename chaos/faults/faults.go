// Package faults holds the fault hooks that must live inside a quotad process for the chaos
// suite: a skewable node clock, a Raft stream-layer wrapper that partitions peers, a Raft
// log-store wrapper that slows the disk, a gRPC interceptor that loses the replies of
// committed admissions, and an HTTP handler that sets them at run time.
//
// It is linked only into binaries built with `-tags chaos` (cmd/quotad's chaos file calls
// Hooks); a production build never contains it. It must never be imported by quota, fsm,
// cluster or rpc: those packages expose plain hooks (cluster.Config.Clock,
// cluster.Config.WrapStreamLayer, cluster.Config.WrapLogStore, rpc.AgentConfig.ExtraHTTP,
// rpc.AgentConfig.UnaryInterceptors) and the chaos build fills them in:
//
//	h := faults.Hooks()
//	cc.Clock = h.Clock                     // cluster.Clock: Now() time.Time
//	cc.WrapStreamLayer = h.WrapStreamLayer // partitions
//	cc.WrapLogStore = h.WrapLogStore       // slow disk (optional hook)
//	ac.ExtraHTTP = map[string]http.Handler{faults.HTTPPrefix: h.Handler}
//	ac.UnaryInterceptors = append(ac.UnaryInterceptors, h.UnaryInterceptor) // lost replies
//
// HTTP API (on the agent's --http-addr; every call answers the resulting State as JSON):
//
//	GET  /chaos/                                  the current State
//	POST /chaos/clock?offset=-3h&rate=1.5         set the wall offset and/or the rate
//	POST /chaos/clock?jump=-10m                   add to the wall offset (a jump back)
//	POST /chaos/clock?reset=1                     rate 1, offset 0
//	POST /chaos/partition?block=h:p,h:p           block these Raft peer addresses (replaces the set)
//	POST /chaos/disk?delay=200ms                  delay every Raft log append
//	POST /chaos/replies?drop=0.3                  lose the reply of 30% of decided Acquire calls
//	POST /chaos/heal[?what=net|clock|disk|replies|all]  undo faults (default all)
package faults

import (
	"net/http"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
)

// HTTPPrefix is where Handler expects to be mounted.
const HTTPPrefix = "/chaos/"

// Faults is one process's set of fault knobs. The zero value is not usable; use New.
// Safe for concurrent use.
type Faults struct {
	Clock   *Clock
	Network *Network
	Disk    *Disk
	Replies *Replies
}

// New returns fault knobs that inject nothing until told to.
func New() *Faults {
	return &Faults{Clock: NewClock(), Network: NewNetwork(), Disk: &Disk{}, Replies: &Replies{}}
}

// HookSet is what a chaos build wires into a node. Every field is non-nil.
type HookSet struct {
	// Clock is the node clock (it implements cluster.Clock).
	Clock *Clock
	// WrapStreamLayer wraps the Raft TCP stream layer (partitions).
	WrapStreamLayer func(raft.StreamLayer) raft.StreamLayer
	// WrapLogStore wraps the durable Raft log store (slow disk).
	WrapLogStore func(raft.LogStore) raft.LogStore
	// UnaryInterceptor loses replies of decided admissions (chain it innermost).
	UnaryInterceptor grpc.UnaryServerInterceptor
	// Handler serves the HTTP API above; mount it at HTTPPrefix.
	Handler http.Handler
}

// Hooks returns the hooks of f.
func (f *Faults) Hooks() HookSet {
	return HookSet{
		Clock:            f.Clock,
		WrapStreamLayer:  f.Network.WrapStreamLayer,
		WrapLogStore:     f.Disk.WrapLogStore,
		UnaryInterceptor: f.Replies.UnaryInterceptor,
		Handler:          f.Handler(),
	}
}

// Hooks returns the hooks of a new set of fault knobs: call it once per process (one node per
// process) and wire every field.
func Hooks() HookSet { return New().Hooks() }

// State is everything the knobs are set to.
type State struct {
	Clock               ClockState   `json:"clock"`
	Network             NetworkState `json:"network"`
	Disk                DiskState    `json:"disk"`
	Replies             RepliesState `json:"replies"`
	WallOffsetSupported bool         `json:"wall_offset_supported"`
}

// State returns the current settings.
func (f *Faults) State() State {
	return State{
		Clock: f.Clock.State(), Network: f.Network.State(), Disk: f.Disk.State(), Replies: f.Replies.State(),
		WallOffsetSupported: WallOffsetSupported(),
	}
}
