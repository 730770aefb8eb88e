package rpc

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
)

// A follower forwards Envoy's calls to the leader in batches: calls that arrive while
// forwardInflight batches are on their way queue and leave together in the next one
// (quotad.v1.Peer/ForwardRateLimit), which the leader decides as one call's ops in its group
// commit. Idle, a call leaves at once, alone. Under load one RPC (a stream, its HTTP/2 frames
// and writes on both sides, the leader's authentication of the peer) serves many calls; that
// per-RPC cost was most of what a forwarded call cost (docs/performance.md, "Envoy RLS").
//
// Every call keeps its own caller: a token call's authorization header goes along and the
// leader authenticates it again, any other caller's identity goes as a principal, which the
// leader believes only from a peer with the server role; each call is authorized, validated
// and answered on its own, with the status it would have got alone.

const (
	// forwardInflight is how many ForwardRateLimit RPCs a follower keeps in flight per leader
	// connection (the leader commits at most ProposerConfig.MaxInflight entries at once, 2 by
	// default: more RPCs in flight would only queue there).
	forwardInflight = 2
	// MaxForwardBatch caps the calls in one ForwardRateLimit RPC.
	MaxForwardBatch = 256
	// forwardTimeout bounds a batch whose calls carry no deadline.
	forwardTimeout = 30 * time.Second
	// MaxForwardQueue caps the calls waiting on a follower for a batch to one leader: a burst
	// of callers beyond it is refused (RESOURCE_EXHAUSTED) instead of growing the queue
	// without bound while the leader is slow. So are calls whose requests would take the
	// queue past forwardQueueBatches batches' bytes.
	MaxForwardQueue     = 8 * MaxForwardBatch
	forwardQueueBatches = 8
	// legacyRecheck is how long a follower forwards calls one by one to a leader that said it
	// does not serve ForwardRateLimit before it tries a batch again (a rolling upgrade ends).
	legacyRecheck = 30 * time.Second
	// regionalParallel bounds the calls of one batch a regional leader decides at once from
	// its shares (each is a commit of its own).
	regionalParallel = 32
	// notLeaderTrailer, in the trailer of a ForwardRateLimit refused because the peer does
	// not lead, says nothing in the batch was decided (its value: the leader the peer knows,
	// may be empty): the follower may send the batch once more, to the leader.
	notLeaderTrailer = "x-quotad-forward-not-leader"
)

// forwardedCall is one caller's call waiting for its batch.
type forwardedCall struct {
	ctx      context.Context // the caller's: once done, the call is not sent
	req      *rlsv3.RateLimitRequest
	call     *quotadv1.ForwardedCall
	deadline time.Time // the caller's (zero: none)
	done     chan struct{}
	resp     *rlsv3.RateLimitResponse
	err      error
}

// gone reports whether the call's caller has given up (its context ended).
func (fc *forwardedCall) gone() bool { return fc.ctx != nil && fc.ctx.Err() != nil }

// forwardLane batches the calls forwarded over one leader connection.
type forwardLane struct {
	r    *rlsServer
	peer quotadv1.PeerClient
	rls  rlsv3.RateLimitServiceClient

	// legacyUntil (unix ns; 0: not legacy): the leader said it does not serve
	// ForwardRateLimit (an older version, during a rolling upgrade); until then calls go to it
	// one by one as before, after it the next batch asks again. Cleared when the follower
	// switches to this lane from another leader's.
	legacyUntil atomic.Int64

	mu         sync.Mutex
	queue      []*forwardedCall
	queueBytes int // Σ len(call.Request) over queue
	inflight   int
}

// legacy reports whether calls go to the lane's leader one by one now.
func (l *forwardLane) legacy() bool {
	u := l.legacyUntil.Load()
	return u != 0 && time.Now().UnixNano() < u
}

// lane returns the batching lane of conn. A lane the follower switches to from another
// (the leader changed) asks its leader for ForwardRateLimit again.
func (r *rlsServer) lane(conn *grpc.ClientConn) *forwardLane {
	r.lanesMu.Lock()
	defer r.lanesMu.Unlock()
	l := r.lanes[conn]
	if l == nil {
		if r.lanes == nil {
			r.lanes = make(map[*grpc.ClientConn]*forwardLane)
		}
		l = &forwardLane{r: r, peer: quotadv1.NewPeerClient(conn), rls: rlsv3.NewRateLimitServiceClient(conn)}
		r.lanes[conn] = l
	}
	if r.lastLane != l {
		if r.lastLane != nil {
			l.legacyUntil.Store(0)
		}
		r.lastLane = l
	}
	return l
}

// forward sends req to the leader over conn in the next batch and waits for its answer (or
// for ctx; the batch goes on without it).
func (r *rlsServer) forward(ctx context.Context, conn *grpc.ClientConn, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	l := r.lane(conn)
	if l.legacy() {
		return rlsv3.NewRateLimitServiceClient(conn).ShouldRateLimit(forwardCtx(ctx), req)
	}
	data, err := proto.Marshal(req)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "encoding the request to forward: %v", err)
	}
	if len(data) > r.forwardBatchBytes()/4 {
		// A large request goes alone: in a batch it could push the batch over the leader's
		// message cap and fail the other callers' requests with it (review finding).
		return l.rls.ShouldRateLimit(forwardCtx(ctx), req)
	}
	fc := &forwardedCall{ctx: ctx, req: req, call: &quotadv1.ForwardedCall{Request: data}, done: make(chan struct{})}
	c := callerFrom(ctx)
	switch {
	case c.viaToken:
		md, _ := metadata.FromIncomingContext(ctx)
		fc.call.Authorization = md.Get(authorizationHeader)
	case !c.id.IsZero():
		fc.call.Principal = auth.EncodePrincipal(c.id)
	}
	fc.deadline, _ = ctx.Deadline()
	if err := l.add(fc); err != nil {
		return nil, err
	}
	select {
	case <-fc.done:
		return fc.resp, fc.err
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// add queues fc; if a batch may leave now, it leaves with everything queued. A full queue
// (MaxForwardQueue calls, or forwardQueueBatches batches' bytes, once the calls whose callers
// are gone are dropped) refuses fc with RESOURCE_EXHAUSTED.
func (l *forwardLane) add(fc *forwardedCall) error {
	size := len(fc.call.Request)
	maxBytes := forwardQueueBatches * l.r.forwardBatchBytes()
	l.mu.Lock()
	if len(l.queue) >= MaxForwardQueue || l.queueBytes+size > maxBytes {
		l.dropGone()
	}
	if n := len(l.queue); n >= MaxForwardQueue || l.queueBytes+size > maxBytes {
		b := l.queueBytes
		l.mu.Unlock()
		l.r.s.metrics.observeForwardDropped("queue_full", 1)
		return status.Errorf(codes.ResourceExhausted, "%d calls (%d bytes) already wait on this node to be forwarded to the leader, the most it queues (%d calls, %d bytes): the leader is not keeping up; retry with backoff, send Envoy's calls to the leader itself, or give the cluster more capacity", n, b, MaxForwardQueue, maxBytes)
	}
	l.queue = append(l.queue, fc)
	l.queueBytes += size
	if l.inflight >= forwardInflight {
		l.mu.Unlock()
		return nil
	}
	l.inflight++
	batch := l.take()
	l.mu.Unlock()
	go l.run(batch)
	return nil
}

// dropGone removes from the queue the calls whose callers are gone (the lock held); their
// callers returned already.
func (l *forwardLane) dropGone() {
	keep := l.queue[:0]
	for _, fc := range l.queue {
		if fc.gone() {
			l.queueBytes -= len(fc.call.Request)
			continue
		}
		keep = append(keep, fc)
	}
	if n := len(l.queue) - len(keep); n > 0 {
		l.r.s.metrics.observeForwardDropped("caller_gone", n)
	}
	clear(l.queue[len(keep):])
	l.queue = keep
}

// take removes the next batch from the queue (the lock held): at most MaxForwardBatch calls
// whose requests together stay within the lane's batch bytes (at least one call).
func (l *forwardLane) take() []*forwardedCall {
	n, size, limit := 0, 0, l.r.forwardBatchBytes()
	for n < len(l.queue) && n < MaxForwardBatch {
		size += len(l.queue[n].call.Request)
		if n > 0 && size > limit {
			size -= len(l.queue[n].call.Request)
			break
		}
		n++
	}
	batch := make([]*forwardedCall, n)
	copy(batch, l.queue)
	rest := copy(l.queue, l.queue[n:])
	clear(l.queue[rest:])
	l.queue = l.queue[:rest]
	l.queueBytes -= size
	return batch
}

// run sends batch, then the batches that queued meanwhile, until the queue is empty.
func (l *forwardLane) run(batch []*forwardedCall) {
	for {
		l.send(batch)
		l.mu.Lock()
		if len(l.queue) == 0 {
			l.inflight--
			l.mu.Unlock()
			return
		}
		batch = l.take()
		l.mu.Unlock()
	}
}

// send forwards one batch and answers its calls. Calls whose caller is gone (its context
// ended, its deadline passed) are not sent.
func (l *forwardLane) send(batch []*forwardedCall) {
	req, sent, deadline := l.prepareBatch(batch)
	if len(sent) == 0 {
		return
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, forwardedHeader, "1")
	l.r.s.metrics.observeForward(len(sent))
	l.deliver(ctx, req, sent, deadline, true)
}

// prepareBatch answers the calls of batch whose caller is gone and returns the request of the
// others, with each call's time left, and the batch's deadline: its last caller's, at most
// forwardTimeout away.
func (l *forwardLane) prepareBatch(batch []*forwardedCall) (*quotadv1.ForwardRateLimitRequest, []*forwardedCall, time.Time) {
	now := time.Now()
	req := &quotadv1.ForwardRateLimitRequest{Calls: make([]*quotadv1.ForwardedCall, 0, len(batch))}
	sent := batch[:0:0]
	var deadline time.Time
	limit := now.Add(forwardTimeout)
	for _, fc := range batch {
		if fc.gone() || !fc.deadline.IsZero() && !fc.deadline.After(now) {
			fc.err = status.Error(codes.DeadlineExceeded, "the caller's deadline passed (or it gave up) before the call was forwarded to the leader; nothing was charged")
			close(fc.done)
			l.r.s.metrics.observeForwardDropped("caller_gone", 1)
			continue
		}
		d := fc.deadline
		fc.call.TimeoutNs = 0
		if !d.IsZero() {
			fc.call.TimeoutNs = int64(d.Sub(now))
		}
		if d.IsZero() || d.After(limit) {
			d = limit
		}
		if d.After(deadline) {
			deadline = d
		}
		req.Calls = append(req.Calls, fc.call)
		sent = append(sent, fc)
	}
	return req, sent, deadline
}

// deliver sends req (the calls sent) to the lane's leader and answers them. A peer that says
// it does not lead, having decided nothing, gets the batch sent once more to the leader
// (mayReroute: not yet re-sent).
func (l *forwardLane) deliver(ctx context.Context, req *quotadv1.ForwardRateLimitRequest, sent []*forwardedCall, deadline time.Time, mayReroute bool) {
	var trailer metadata.MD
	resp, err := l.peer.ForwardRateLimit(ctx, req, grpc.Trailer(&trailer))
	if status.Code(err) == codes.Unimplemented {
		l.legacyUntil.Store(time.Now().Add(legacyRecheck).UnixNano())
		l.sendEach(sent, deadline)
		return
	}
	if err != nil && mayReroute && len(trailer.Get(notLeaderTrailer)) > 0 {
		if to := l.r.rerouteLane(l, trailer.Get(notLeaderTrailer)[0]); to != nil {
			req, sent, _ = l.prepareBatch(sent) // the callers' time left, now
			if len(sent) == 0 {
				return
			}
			l.r.s.metrics.observeForwardRerouted(len(sent))
			to.deliver(ctx, req, sent, deadline, false)
			return
		}
	}
	if err == nil && len(resp.Results) != len(sent) {
		err = status.Errorf(codes.Internal, "the leader answered %d of %d forwarded calls", len(resp.Results), len(sent))
	}
	for i, fc := range sent {
		switch {
		case err != nil:
			fc.err = err
		case resp.Results[i].Code != 0:
			res := resp.Results[i]
			fc.err = status.Error(codes.Code(res.Code), res.Message)
		default:
			out := &rlsv3.RateLimitResponse{}
			if uerr := proto.Unmarshal(resp.Results[i].Response, out); uerr != nil {
				fc.err = status.Errorf(codes.Internal, "decoding the leader's answer: %v", uerr)
			} else {
				fc.resp = out
			}
		}
		close(fc.done)
	}
}

// rerouteLane is the lane of the leader to send a batch to after from's peer said it does
// not lead (hint: the leader it knows, may be empty): this node's view of the leader first,
// else the hint; nil when neither is another node's lane (this node leads now, or no leader
// is known: the batch fails as it did).
func (r *rlsServer) rerouteLane(from *forwardLane, hint string) *forwardLane {
	s := r.s
	if s.node == nil || s.fwd == nil || s.node.IsLeader() {
		return nil
	}
	_, own := s.node.Leader()
	for _, addr := range []string{own, hint} {
		if addr == "" {
			continue
		}
		conn, err := s.fwd.conn(addr)
		if err != nil {
			continue
		}
		if to := r.lane(conn); to != from {
			return to
		}
	}
	return nil
}

// sendEach forwards calls one RPC each, with their callers as forwardCtx passes them (to a
// leader that does not serve ForwardRateLimit).
func (l *forwardLane) sendEach(calls []*forwardedCall, limit time.Time) {
	var wg sync.WaitGroup
	for _, fc := range calls {
		if fc.gone() {
			fc.err = status.Error(codes.DeadlineExceeded, "the caller gave up before the call was forwarded to the leader; nothing was charged")
			close(fc.done)
			l.r.s.metrics.observeForwardDropped("caller_gone", 1)
			continue
		}
		wg.Go(func() {
			defer close(fc.done)
			d := fc.deadline
			if d.IsZero() {
				d = limit
			}
			ctx, cancel := context.WithDeadline(context.Background(), d)
			defer cancel()
			kv := []string{forwardedHeader, "1"}
			for _, v := range fc.call.Authorization {
				kv = append(kv, authorizationHeader, v)
			}
			if len(fc.call.Authorization) == 0 && fc.call.Principal != "" {
				kv = append(kv, auth.PrincipalHeader, fc.call.Principal)
			}
			fc.resp, fc.err = l.rls.ShouldRateLimit(metadata.AppendToOutgoingContext(ctx, kv...), fc.req)
		})
	}
	wg.Wait()
}

// peerServer serves quotad.v1.Peer.
type peerServer struct {
	quotadv1.UnimplementedPeerServer
	r *rlsServer
}

// ForwardRateLimit decides a follower's batch of Envoy calls on the leader: each is
// authenticated (its token) or identified (its principal, believed from a server-role peer),
// authorized and validated on its own; the valid ones go into the group commit as one call's
// ops; every call gets its own answer or status, in order. A call whose caller's time
// (timeout_ns) ran out before it is decided is answered DEADLINE_EXCEEDED, nothing charged.
// A regional leader decides the calls with scope: global rules from its shares, up to
// regionalParallel at once. A node that does not lead refuses the batch, nothing decided, and
// says so in the notLeaderTrailer (the follower sends it once more, to the leader).
func (p *peerServer) ForwardRateLimit(ctx context.Context, req *quotadv1.ForwardRateLimitRequest) (*quotadv1.ForwardRateLimitResponse, error) {
	r, s := p.r, p.r.s
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		// route refuses a second forward; a caller that is not a peer gets conn.
		_, addr := s.node.Leader()
		_ = grpc.SetTrailer(ctx, metadata.Pairs(notLeaderTrailer, addr))
		if err != nil {
			return nil, err
		}
		return nil, status.Errorf(codes.Unavailable, "not the leader (leader is %s); ForwardRateLimit is for the leader", addr)
	}
	switch n := len(req.Calls); {
	case n == 0:
		return nil, status.Error(codes.InvalidArgument, "no calls; a follower forwards at least one")
	case n > MaxForwardBatch:
		return nil, status.Errorf(codes.InvalidArgument, "%d calls in one ForwardRateLimit; at most %d", n, MaxForwardBatch)
	}
	start := time.Now()
	outer := callerFrom(ctx)
	n := len(req.Calls)
	out := &quotadv1.ForwardRateLimitResponse{Results: make([]*quotadv1.ForwardedResult, n)}
	reqs := make([]*rlsv3.RateLimitRequest, n)
	ops := make([]*fsmv1.RateLimit, n)
	deadlines := make([]time.Time, n)
	batchDeadline, _ := ctx.Deadline()
	for i, call := range req.Calls {
		deadlines[i] = callDeadline(start, call.TimeoutNs, batchDeadline)
		op, err := func() (*fsmv1.RateLimit, error) {
			id, err := r.forwardedCaller(outer, call)
			if err != nil {
				return nil, err
			}
			rr := &rlsv3.RateLimitRequest{}
			if err := proto.Unmarshal(call.Request, rr); err != nil {
				return nil, status.Errorf(codes.InvalidArgument, "calls[%d].request is not an envoy RateLimitRequest: %v", i, err)
			}
			reqs[i] = rr
			return r.authorize(id, rr)
		}()
		if err != nil {
			out.Results[i] = forwardedStatus(err)
			continue
		}
		ops[i] = op
	}
	// expired answers call i DEADLINE_EXCEEDED if its caller's time has run out.
	expired := func(i int) bool {
		if d := deadlines[i]; d.IsZero() || time.Now().Before(d) {
			return false
		}
		s.metrics.observeForwardDropped("expired", 1)
		out.Results[i] = forwardedStatus(status.Error(codes.DeadlineExceeded, "the caller's deadline passed before the leader decided the forwarded call; nothing was charged"))
		return true
	}
	if s.region != nil {
		// A regional leader decides scope: global rules from its shares, each call a commit
		// of its own: at most regionalParallel at once.
		var wg sync.WaitGroup
		sem := make(chan struct{}, regionalParallel)
		for i, op := range ops {
			if op == nil {
				continue
			}
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				if expired(i) {
					ops[i] = nil
					return
				}
				if hook := forwardRegionalHook.Load(); hook != nil {
					(*hook)()
				}
				if resp, handled, err := r.regional(ctx, reqs[i], op, start); handled {
					ops[i] = nil
					if err != nil {
						out.Results[i] = forwardedStatus(err)
					} else {
						out.Results[i] = forwardedAnswer(resp)
					}
				}
			})
		}
		wg.Wait()
	}
	var data [][]byte
	var which []int // data[k] is call which[k]
	for i, op := range ops {
		if op == nil || expired(i) {
			continue
		}
		b, err := encodeRLS(op)
		if err != nil {
			out.Results[i] = forwardedStatus(err)
			continue
		}
		data = append(data, b)
		which = append(which, i)
	}
	if len(data) == 0 {
		return out, nil
	}
	c, err := s.prop.submit(ctx, data)
	if err == nil {
		err = s.prop.wait(ctx, c)
	}
	for k, i := range which {
		var resp *rlsv3.RateLimitResponse
		ferr := err
		if err != nil {
			ferr = s.applyError(err)
		} else {
			resp, ferr = r.finish(reqs[i], c.results[k], start)
		}
		if ferr != nil {
			out.Results[i] = forwardedStatus(ferr)
			continue
		}
		out.Results[i] = forwardedAnswer(resp)
	}
	return out, nil
}

// forwardRegionalHook, when set (tests), is called as a regional leader starts deciding a
// forwarded call from its shares.
var forwardRegionalHook atomic.Pointer[func()]

// maxCallTimeout bounds a forwarded call's timeout_ns (a larger one is taken as this).
const maxCallTimeout = 24 * time.Hour

// callDeadline is a forwarded call's deadline on the leader: timeout (timeout_ns) after the
// batch arrived at start, no later than the batch's own deadline (zero: none); timeout 0
// means none given, the batch's; a negative one is already past.
func callDeadline(start time.Time, timeout int64, batch time.Time) time.Time {
	if timeout == 0 {
		return batch
	}
	d := start.Add(time.Duration(min(timeout, int64(maxCallTimeout))))
	if !batch.IsZero() && batch.Before(d) {
		return batch
	}
	return d
}

// forwardedAnswer is a call's result carrying Envoy's answer.
func forwardedAnswer(resp *rlsv3.RateLimitResponse) *quotadv1.ForwardedResult {
	data, err := proto.Marshal(resp)
	if err != nil {
		return forwardedStatus(status.Errorf(codes.Internal, "encoding the answer: %v", err))
	}
	return &quotadv1.ForwardedResult{Response: data}
}

// forwardedCaller is the identity a forwarded call acts as, authorized for ShouldRateLimit:
// its token's; else, from a server-role peer, its principal (none: unauthenticated, never the
// peer's own identity); else (an admin or --insecure calling ForwardRateLimit itself) the
// caller of the batch, as for a forwarded single call.
func (r *rlsServer) forwardedCaller(outer caller, call *quotadv1.ForwardedCall) (auth.Identity, error) {
	id := outer.id
	method := auth.MethodName(auth.RateLimitMethod)
	switch {
	case len(call.Authorization) > 0 && r.authn != nil:
		var err error
		if id, err = r.authn.fromToken(call.Authorization, method); err != nil {
			return auth.Identity{}, err
		}
	case outer.id.Role == auth.RoleServer:
		id = auth.Identity{}
		if call.Principal != "" {
			var err error
			if id, err = auth.DecodePrincipal(call.Principal); err != nil {
				return auth.Identity{}, status.Errorf(codes.Unauthenticated, "%s: server %s forwarded a bad principal: %v", method, outer.id.Name, err)
			}
			if r.authn != nil {
				if err := r.authn.checkPrincipalCert(method, outer.id.Name, id); err != nil {
					return auth.Identity{}, err
				}
			}
		}
	}
	if err := auth.Authorize(id, auth.RateLimitMethod); err != nil {
		code := codes.PermissionDenied
		if errors.Is(err, auth.ErrUnauthenticated) {
			code = codes.Unauthenticated
		}
		return auth.Identity{}, status.Error(code, err.Error())
	}
	return id, nil
}

// forwardedStatus is err as a ForwardedResult.
func forwardedStatus(err error) *quotadv1.ForwardedResult {
	st := status.Convert(err)
	code := st.Code()
	if code == codes.OK {
		code = codes.Unknown
	}
	return &quotadv1.ForwardedResult{Code: uint32(code), Message: st.Message()}
}
