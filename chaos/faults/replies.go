package faults

import (
	"context"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// AcquireMethod and ShareMethod are the gRPC methods whose replies Replies drops (a lost
// Share reply is a grant the holder never applies: it stays charged until it ends).
const (
	AcquireMethod = "/quotad.v1.Quota/Acquire"
	ShareMethod   = "/quotad.v1.Quota/Share"
)

// DroppedMessage is in the status message of every reply Replies drops, so that a test can
// tell a dropped reply from a real failure.
const DroppedMessage = "chaos: reply dropped after the decision committed"

// maxHang bounds how long a dropped reply holds its handler when the caller set no deadline.
const maxHang = 2 * time.Second

// Replies loses the answers of admissions that were decided: for a fraction of the Acquire
// (and Share) calls this node answers successfully (every decision committed through Raft and applied),
// the caller gets no answer instead — half of them an Unavailable status at once (a
// connection that broke after the commit), half nothing until the caller's deadline (a
// reply lost on the wire; at most maxHang, then Unavailable). Either way the decision stands
// and the caller cannot know it: retrying the request ID must return it, not decide again.
// The zero value drops nothing. Safe for concurrent use.
type Replies struct {
	drop    atomic.Uint64 // math.Float64bits of the fraction; 0: none
	dropped atomic.Uint64
	hung    atomic.Uint64
	passed  atomic.Uint64
}

// SetDrop sets the fraction of decided Acquire calls whose reply is lost (0: none, 1: all).
func (r *Replies) SetDrop(fraction float64) {
	r.drop.Store(uint64(min(max(fraction, 0), 1) * 1e6))
}

// Drop returns the fraction set by SetDrop.
func (r *Replies) Drop() float64 { return float64(r.drop.Load()) / 1e6 }

// RepliesState is a Replies' settings and counters, as the HTTP handler reports them.
type RepliesState struct {
	Drop float64 `json:"drop"`
	// Dropped counts decided calls answered Unavailable at once, Hung those held until the
	// caller gave up, Passed decided calls answered normally while a drop fraction was set.
	Dropped uint64 `json:"dropped"`
	Hung    uint64 `json:"hung"`
	Passed  uint64 `json:"passed"`
}

// State returns the fraction and counters.
func (r *Replies) State() RepliesState {
	return RepliesState{Drop: r.Drop(), Dropped: r.dropped.Load(), Hung: r.hung.Load(), Passed: r.passed.Load()}
}

// UnaryInterceptor is the gRPC server interceptor that loses replies. Chain it innermost
// (after authentication), so that it sees exactly the calls the handler decided.
func (r *Replies) UnaryInterceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	resp, err := handler(ctx, req)
	frac := r.drop.Load()
	if err != nil || frac == 0 || (info.FullMethod != AcquireMethod && info.FullMethod != ShareMethod) {
		return resp, err
	}
	if rand.Uint64N(1e6) >= frac {
		r.passed.Add(1)
		return resp, err
	}
	if rand.IntN(2) == 0 {
		r.dropped.Add(1)
		return nil, status.Error(codes.Unavailable, DroppedMessage+" (connection broken)")
	}
	r.hung.Add(1)
	t := time.NewTimer(maxHang)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return nil, status.Error(codes.DeadlineExceeded, DroppedMessage+" (reply lost; caller gave up)")
	case <-t.C:
		return nil, status.Error(codes.Unavailable, DroppedMessage+" (reply lost)")
	}
}
