package rpc

import (
	"container/list"
	"context"
	"net"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/quotad/quotad/auth"
)

// DefaultMaxCallsPerIdentity is the default cap on the gRPC calls one identity may have open
// on one node without their request (--max-calls-per-identity): a unary call counts from its
// headers until its message has arrived, a stream from its headers to its end. Such a call
// costs the node a goroutine and 12-17 KB — 30,000 calls that sent their headers and never
// their message, with a valid token, took a dev node from 30 to 362 MB — so the cap bounds
// what one credential can make a node hold that way: ~70 MB at the default. A unary call
// whose request has arrived is bounded by its method instead (a waiting Acquire by the waiter
// caps), so waits sent unary (regional nodes, streams off, forwarded by followers) do not
// count. Honest callers stay far below it: a request follows its headers within a round
// trip; streams are few (a Go client holds one AcquireStream, --max-streams-per-identity).
const DefaultMaxCallsPerIdentity = 4096

// callCounter counts the gRPC calls each identity has open on this node, from the tap (the
// call's headers) until a unary call's request has arrived or a stream's end, and refuses
// one beyond the cap. Cluster nodes
// (server certificates: a follower forwards every caller's calls over one connection) and
// the --insecure identity (everyone) are not counted. Safe for concurrent use; its map holds
// only identities with calls in flight.
type callCounter struct {
	max     int
	refused prometheus.Counter // nil: not counted
	evicted prometheus.Counter // open calls ended for a newer one (nil: not counted)

	mu       sync.Mutex
	byName   map[string]int
	inFlight atomic.Int64 // the sum of byName and open (quotad_calls_in_flight)
	open     openCalls
}

func newCallCounter(max int) *callCounter {
	if max <= 0 {
		max = DefaultMaxCallsPerIdentity
	}
	return &callCounter{max: max, byName: make(map[string]int)}
}

// counted reports whether id's calls count against the cap.
func counted(id auth.Identity) bool {
	return id.Role != auth.RoleServer && id.Name != insecureIdentity && id.Name != ""
}

// take reserves a slot for one call of identity name, released by the returned slot's end
// or, whatever path the call takes (a message never read, an unknown method, the stream
// reset by the client), when ctx — the call's context, which grpc-go cancels when the call
// ends — is done. An error is a ResourceExhausted status naming the cap and its flag.
func (c *callCounter) take(ctx context.Context, name, method string) (*callSlot, error) {
	return c.takeUpTo(ctx, name, c.max, func(n int) error {
		return status.Errorf(codes.ResourceExhausted, "%s: identity %.64q already has %d calls open on this node without their request (unary calls whose message has not arrived, and open streams), its limit (--max-calls-per-identity %d); "+
			"send each call's request with its headers, close streams you no longer read, or give separate callers separate credentials", method, name, n, c.max)
	})
}

// MaxOpenCallsPerAddress and MaxOpenCalls bound the calls to open methods (gRPC health Check
// and List, which need no credential) that a node holds before their request has arrived:
// per source address (an IPv4 address or an IPv6 /64) and in total. Such a call holds a
// goroutine and 12-17 KB; without a bound anyone could hold a node's memory with health
// checks that send headers and never their message (30,000 took a node from 25 to 359 MB).
//
// A call beyond a bound is not refused: it is taken, and the oldest call of its address (or,
// at MaxOpenCalls, the node's oldest) that still waits for its request is ended (Canceled)
// instead. Refusing the newest locked out every health checker sharing the flooder's address
// (one NAT, one load balancer's health-check source): 64 calls that never sent their message
// held the address's slots for as long as their connection lived. An honest check sends its
// request with its headers and leaves the count within microseconds, so it is only ended if
// 64 newer calls from its address arrive before its request is read; the flooder keeps at
// most 64 (and all flooders together MaxOpenCalls: ~17 MB) however many it opens, and pays a
// HEADERS frame for every call it holds.
const (
	MaxOpenCallsPerAddress = 64
	MaxOpenCalls           = 1024
)

// maxOpenCalls is MaxOpenCalls (tests lower it).
var maxOpenCalls atomic.Int64

func init() { maxOpenCalls.Store(MaxOpenCalls) }

// openCalls orders the open-method calls waiting for their request, per source address and
// in total, oldest first (callCounter.mu guards them).
type openCalls struct {
	all    list.List // of *callSlot
	byAddr map[string]*list.List
}

// takeOpen takes a slot for one call to an open method from ctx's source address and returns
// the context the call runs with: ending the slot's call early (evict) cancels it, which ends
// the call's wait for its request. Never refuses (see MaxOpenCallsPerAddress).
func (c *callCounter) takeOpen(ctx context.Context) (context.Context, *callSlot) {
	src := sourceOf(ctx)
	ctx, cancel := context.WithCancel(ctx)
	s := &callSlot{c: c, name: src, cancel: cancel}
	c.inFlight.Add(1)
	s.stop = context.AfterFunc(ctx, s.release)
	var evicted []*callSlot
	c.mu.Lock()
	if !s.done.Load() { // else released already: ctx was done
		if c.open.byAddr == nil {
			c.open.byAddr = make(map[string]*list.List)
		}
		l := c.open.byAddr[src]
		if l == nil {
			l = list.New()
			c.open.byAddr[src] = l
		}
		if l.Len() >= MaxOpenCallsPerAddress {
			evicted = append(evicted, c.unlinkOpen(l.Front().Value.(*callSlot)))
		}
		if int64(c.open.all.Len()) >= maxOpenCalls.Load() {
			evicted = append(evicted, c.unlinkOpen(c.open.all.Front().Value.(*callSlot)))
		}
		s.addrElem = l.PushBack(s)
		s.allElem = c.open.all.PushBack(s)
	}
	c.mu.Unlock()
	for _, e := range evicted {
		if e.done.CompareAndSwap(false, true) {
			c.inFlight.Add(-1)
			if c.evicted != nil {
				c.evicted.Inc()
			}
		}
		e.cancel() // its wait for the request ends; its AfterFunc finds it released
	}
	return ctx, s
}

// unlinkOpen takes s out of the open-call order (c.mu held) and returns it.
func (c *callCounter) unlinkOpen(s *callSlot) *callSlot {
	if s.allElem == nil {
		return s
	}
	c.open.all.Remove(s.allElem)
	l := c.open.byAddr[s.name]
	l.Remove(s.addrElem)
	if l.Len() == 0 {
		delete(c.open.byAddr, s.name)
	}
	s.allElem, s.addrElem = nil, nil
	return s
}

// sourceOf is the source address a call counts against: its IPv4 address, its IPv6 /64, or
// the whole address if it is neither.
func sourceOf(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return "an unknown address"
	}
	if ta, ok := p.Addr.(*net.TCPAddr); ok {
		if ip4 := ta.IP.To4(); ip4 != nil {
			return ip4.String()
		}
		return ta.IP.Mask(net.CIDRMask(64, 128)).String() + "/64"
	}
	return p.Addr.String()
}

func (c *callCounter) takeUpTo(ctx context.Context, name string, limit int, refusal func(n int) error) (*callSlot, error) {
	c.mu.Lock()
	n := c.byName[name]
	if n >= limit {
		c.mu.Unlock()
		if c.refused != nil {
			c.refused.Inc()
		}
		return nil, refusal(n)
	}
	c.byName[name] = n + 1
	c.mu.Unlock()
	c.inFlight.Add(1)
	s := &callSlot{c: c, name: name}
	s.stop = context.AfterFunc(ctx, s.release)
	return s, nil
}

func (c *callCounter) put(name string) {
	c.mu.Lock()
	if c.byName[name]--; c.byName[name] <= 0 {
		delete(c.byName, name)
	}
	c.mu.Unlock()
	c.inFlight.Add(-1)
}

// callSlot is one call's place in its identity's count, or in the open calls' order.
type callSlot struct {
	c    *callCounter
	name string      // the identity, or the source address of an open call
	stop func() bool // unregisters the release on the call's context
	done atomic.Bool

	// Open calls only (takeOpen): cancel ends the call; its places in the order (nil once
	// out of it).
	cancel            context.CancelFunc
	addrElem, allElem *list.Element
}

// release returns the slot (once, whoever calls first).
func (s *callSlot) release() {
	if !s.done.CompareAndSwap(false, true) {
		return
	}
	if s.cancel == nil {
		s.c.put(s.name)
		return
	}
	s.c.mu.Lock()
	s.c.unlinkOpen(s)
	s.c.mu.Unlock()
	s.c.inFlight.Add(-1)
}

// end returns the slot when the interceptor sees the call end, without the goroutine
// context.AfterFunc would start for it.
func (s *callSlot) end() {
	s.stop()
	s.release()
}
