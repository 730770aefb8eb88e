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
)

// forwardedCall is one caller's call waiting for its batch.
type forwardedCall struct {
	req      *rlsv3.RateLimitRequest
	call     *quotadv1.ForwardedCall
	deadline time.Time // the caller's (zero: none)
	done     chan struct{}
	resp     *rlsv3.RateLimitResponse
	err      error
}

// forwardLane batches the calls forwarded over one leader connection.
type forwardLane struct {
	r    *rlsServer
	peer quotadv1.PeerClient
	rls  rlsv3.RateLimitServiceClient

	// legacy: the leader does not serve ForwardRateLimit (an older version, during a rolling
	// upgrade); calls go to it one by one as before. A new leader gets a new lane.
	legacy atomic.Bool

	mu       sync.Mutex
	queue    []*forwardedCall
	inflight int
}

// lane returns the batching lane of conn.
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
	return l
}

// forward sends req to the leader over conn in the next batch and waits for its answer (or
// for ctx; the batch goes on without it).
func (r *rlsServer) forward(ctx context.Context, conn *grpc.ClientConn, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	l := r.lane(conn)
	if l.legacy.Load() {
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
	fc := &forwardedCall{req: req, call: &quotadv1.ForwardedCall{Request: data}, done: make(chan struct{})}
	c := callerFrom(ctx)
	switch {
	case c.viaToken:
		md, _ := metadata.FromIncomingContext(ctx)
		fc.call.Authorization = md.Get(authorizationHeader)
	case !c.id.IsZero():
		fc.call.Principal = auth.EncodePrincipal(c.id)
	}
	fc.deadline, _ = ctx.Deadline()
	l.add(fc)
	select {
	case <-fc.done:
		return fc.resp, fc.err
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// add queues fc; if a batch may leave now, it leaves with everything queued.
func (l *forwardLane) add(fc *forwardedCall) {
	l.mu.Lock()
	l.queue = append(l.queue, fc)
	if l.inflight >= forwardInflight {
		l.mu.Unlock()
		return
	}
	l.inflight++
	batch := l.take()
	l.mu.Unlock()
	go l.run(batch)
}

// take removes the next batch from the queue (the lock held): at most MaxForwardBatch calls
// whose requests together stay within the lane's batch bytes (at least one call).
func (l *forwardLane) take() []*forwardedCall {
	n, size, limit := 0, 0, l.r.forwardBatchBytes()
	for n < len(l.queue) && n < MaxForwardBatch {
		size += len(l.queue[n].call.Request)
		if n > 0 && size > limit {
			break
		}
		n++
	}
	batch := make([]*forwardedCall, n)
	copy(batch, l.queue)
	rest := copy(l.queue, l.queue[n:])
	clear(l.queue[rest:])
	l.queue = l.queue[:rest]
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

// send forwards one batch and answers its calls. Calls whose caller's deadline has passed are
// not sent.
func (l *forwardLane) send(batch []*forwardedCall) {
	now := time.Now()
	req := &quotadv1.ForwardRateLimitRequest{Calls: make([]*quotadv1.ForwardedCall, 0, len(batch))}
	sent := batch[:0:0]
	// The batch runs until its last caller's deadline, at most forwardTimeout.
	var deadline time.Time
	limit := now.Add(forwardTimeout)
	for _, fc := range batch {
		if !fc.deadline.IsZero() && !fc.deadline.After(now) {
			fc.err = status.Error(codes.DeadlineExceeded, "the deadline passed before the call was forwarded to the leader")
			close(fc.done)
			continue
		}
		d := fc.deadline
		if d.IsZero() || d.After(limit) {
			d = limit
		}
		if d.After(deadline) {
			deadline = d
		}
		req.Calls = append(req.Calls, fc.call)
		sent = append(sent, fc)
	}
	if len(sent) == 0 {
		return
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, forwardedHeader, "1")
	l.r.s.metrics.observeForward(len(sent))
	resp, err := l.peer.ForwardRateLimit(ctx, req)
	if status.Code(err) == codes.Unimplemented {
		l.legacy.Store(true)
		l.sendEach(sent, deadline)
		return
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

// sendEach forwards calls one RPC each, with their callers as forwardCtx passes them (to a
// leader that does not serve ForwardRateLimit).
func (l *forwardLane) sendEach(calls []*forwardedCall, limit time.Time) {
	var wg sync.WaitGroup
	for _, fc := range calls {
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
// ops; every call gets its own answer or status, in order.
func (p *peerServer) ForwardRateLimit(ctx context.Context, req *quotadv1.ForwardRateLimitRequest) (*quotadv1.ForwardRateLimitResponse, error) {
	r, s := p.r, p.r.s
	conn, err := s.route(ctx)
	if err != nil {
		return nil, err
	}
	if conn != nil { // route refuses a second forward; a caller that is not a peer gets here
		_, addr := s.node.Leader()
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
	out := &quotadv1.ForwardRateLimitResponse{Results: make([]*quotadv1.ForwardedResult, len(req.Calls))}
	reqs := make([]*rlsv3.RateLimitRequest, len(req.Calls))
	var ops [][]byte
	var which []int // ops[k] is call which[k]
	for i, call := range req.Calls {
		var regional *rlsv3.RateLimitResponse
		data, err := func() ([]byte, error) {
			id, err := r.forwardedCaller(outer, call)
			if err != nil {
				return nil, err
			}
			rr := &rlsv3.RateLimitRequest{}
			if err := proto.Unmarshal(call.Request, rr); err != nil {
				return nil, status.Errorf(codes.InvalidArgument, "calls[%d].request is not an envoy RateLimitRequest: %v", i, err)
			}
			reqs[i] = rr
			op, err := r.authorize(id, rr)
			if err != nil {
				return nil, err
			}
			// A regional leader decides scope: global rules from its shares, one call at a time.
			if resp, handled, err := r.regional(ctx, rr, op, start); handled {
				regional = resp
				return nil, err
			}
			return encodeRLS(op)
		}()
		if err == nil && regional != nil {
			out.Results[i] = forwardedAnswer(regional)
			continue
		}
		if err != nil {
			out.Results[i] = forwardedStatus(err)
			continue
		}
		ops = append(ops, data)
		which = append(which, i)
	}
	if len(ops) == 0 {
		return out, nil
	}
	c, err := s.prop.submit(ctx, ops)
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
