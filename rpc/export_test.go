package rpc

import (
	"context"
	"net/http/httptest"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// HoldLane takes every commit slot of one of a leader's two group commits — the waiting
// path's own (waiting true: fair.prop) or the shared one of everything else (Server.prop) —
// once the entries it has in flight are committed, so nothing more of that lane reaches the
// log until release is called: the other lane's traffic shows whether it queues behind it.
func HoldLane(a *Agent, waiting bool) (release func()) {
	p := a.server.prop
	if waiting {
		p = a.server.fair.prop
	}
	n := cap(p.slots)
	for range n {
		p.slots <- struct{}{}
	}
	return func() {
		for range n {
			<-p.slots
		}
	}
}

// NonWaitingTrace is one non-waiting admission the leader decided and whether the scheduler
// held waiters (queued, or released and not yet applied) when it looked.
type NonWaitingTrace = nonWaitingTrace

// SetNonWaitingTrace makes the leader report every non-waiting admission it decides to fn
// (nil: stop).
func SetNonWaitingTrace(fn func(NonWaitingTrace)) {
	if fn == nil {
		nonWaitingHook.Store(nil)
		return
	}
	nonWaitingHook.Store(&fn)
}

// FairTrace is where one admitted waiter's time went on the leader.
type FairTrace = fairTrace

// FairExchangeMax is how far a held grant may be moved later by moment exchanges.
const FairExchangeMax = fairExchangeMax

// SetFairTrace makes the scheduler report every admission of the waiting path to fn (nil:
// stop). Set it before the cluster starts and clear it after the test.
func SetFairTrace(fn func(FairTrace)) {
	if fn == nil {
		fairTraceHook.Store(nil)
		return
	}
	fairTraceHook.Store(&fn)
}

// ForwardVia forwards req from agent a's Envoy service to the node at addr in a batch, as a
// follower that believes addr leads would.
func ForwardVia(ctx context.Context, a *Agent, addr string, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	conn, err := a.server.fwd.conn(addr)
	if err != nil {
		return nil, err
	}
	return a.server.rls.forward(ctx, conn, req)
}

// SetForwardRegionalHook makes a regional leader call fn as it starts deciding a forwarded
// call from its shares (nil: stop). Set it before the calls and clear it after the test.
func SetForwardRegionalHook(fn func()) {
	if fn == nil {
		forwardRegionalHook.Store(nil)
		return
	}
	forwardRegionalHook.Store(&fn)
}

// SetStampedHook makes every proposal call fn between taking its timestamp and queueing its
// entry in raft (nil: stop). Set it before the cluster starts and clear it after the test.
func SetStampedHook(fn func()) { setHook(&stampedHook, fn) }

// SetRestoreCopiedHook makes a restore that keeps the current tokens call fn right after it
// copied the snapshot with them (nil: stop). Set it before the cluster starts and clear it
// after the test.
func SetRestoreCopiedHook(fn func()) { setHook(&restoreCopiedHook, fn) }

func setHook(h *atomic.Pointer[func()], fn func()) {
	if fn == nil {
		h.Store(nil)
		return
	}
	h.Store(&fn)
}

// SetWaitReadHook makes the scheduler call fn with a waiting admission each time it reads
// that admission's path from the FSM to decide whether it waits (nil: stop). Clear it after
// the test.
func SetWaitReadHook(fn func(*quotadv1.Admission)) {
	if fn == nil {
		waitReadHook.Store(nil)
		return
	}
	waitReadHook.Store(&fn)
}

// Waiting returns how many admissions wait in a's scheduler (queued, not yet released).
func Waiting(a *Agent) int64 { return a.server.fair.nwait.Load() }

// CallsInFlight returns the calls of counted identities in flight on a
// (--max-calls-per-identity).
func CallsInFlight(a *Agent) int64 { return a.authn.calls.inFlight.Load() }

// SetTokenHashHook makes every hash of a bearer token call fn (nil: stop).
func SetTokenHashHook(fn func()) {
	if fn == nil {
		tokenHashHook.Store(nil)
		return
	}
	tokenHashHook.Store(&fn)
}

// SetCertKeyHook makes every computation of a client certificate's deny-list key call fn
// (nil: stop).
func SetCertKeyHook(fn func()) {
	if fn == nil {
		certKeyHook.Store(nil)
		return
	}
	certKeyHook.Store(&fn)
}

// MetricsText returns a's /metrics page.
func MetricsText(a *Agent) string {
	rec := httptest.NewRecorder()
	promhttp.HandlerFor(a.metrics.Registry, promhttp.HandlerOpts{}).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	return rec.Body.String()
}

// SetMaxOpenCalls sets the node-wide bound on open-method calls waiting for their request
// (MaxOpenCalls) and returns a func that restores it.
func SetMaxOpenCalls(n int64) func() {
	old := maxOpenCalls.Swap(n)
	return func() { maxOpenCalls.Store(old) }
}
