package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// Waiting admissions over one AcquireStream (issue 16).
//
// A waiting admission (MaxWaitMs > 0) cannot share a unary batch: the batch would answer when
// its slowest admission is decided, so a grant on a free bucket would wait for another
// caller's 30 s wait. Sent one RPC each, thousands of waiting callers cost a call each on
// both sides. The streamer sends them over one stream to the leader instead: whatever is
// queued goes in one message (as the batcher drains its queue), and each caller gets its own
// answer the moment the leader decides it.
//
// Failures never double-spend and never lose a caller: an admission keeps its request ID, and
// when its stream breaks (leader change, node down, no answer within AttemptTimeout plus its
// max wait) or its answer is a status a unary call would retry (UNAVAILABLE,
// DEADLINE_EXCEEDED), it is decided by the unary path (acquireOne: leader finding, retries)
// with the same request ID, so the cluster's dedup table returns a decision already made. A
// node that refuses the stream (UNIMPLEMENTED: an older build or a regional node;
// RESOURCE_EXHAUSTED: the credential's streams are at --max-streams-per-identity;
// FAILED_PRECONDITION without a leader the client can follow) turns streaming off for
// streamOffAfterRefusal; the admissions of a stream a follower refused naming the leader are
// sent once more, on a stream to that leader. A stream idle for streamIdle is half-closed,
// and canceled if the leader has not ended it streamCloseGrace later.

const (
	// streamOffAfterRefusal is how long waiting admissions go unary after a node refused the
	// stream (an older build mid-upgrade, a regional node, a leader the client cannot dial).
	streamOffAfterRefusal = 30 * time.Second
	// streamQueue is the capacity of a stream's send queue.
	streamQueue = 4096
	// streamIdle: a stream with nothing undecided and nothing sent for this long is closed
	// (half-close; the leader ends it), so an idle client holds nothing on the leader. The
	// next waiting admission opens a new one.
	streamIdle = 30 * time.Second
	// streamCloseGrace: after the idle half-close the leader ends the stream within a round
	// trip (nothing is undecided on it). If it has not after this long (a paused or
	// partitioned node, a hostile one), the client cancels the stream, so its receiver and
	// the call's state do not outlive it.
	streamCloseGrace = 10 * time.Second
	// streamResendFor: for how long after its stream first broke for a leader change — a
	// node that named the leader, the old leader answering UNAVAILABLE, a node gone or
	// without a leader — an undecided admission is sent again on the next stream (same
	// request ID) before it goes unary: a few elections' length. A leader change then costs
	// the client a new stream, not a unary RPC per admission (and each one's retries while
	// the cluster elects). Between tries: the client's backoff, or the old stream's end.
	streamResendFor = 5 * time.Second
	// streamResendWait: how long an admission answered UNAVAILABLE waits for its stream to
	// end before it is sent again (the leader re-checks its leadership every second and then
	// ends the stream naming the new leader).
	streamResendWait = 1500 * time.Millisecond
	// streamStallBeats and streamStallMin: a leader that sends heartbeats (its header says
	// every how long, while admissions are undecided) and has sent nothing for this many
	// heartbeats, and at least streamStallMin, while this stream had admissions sent and
	// undecided, is taken as stalled (its process stopped, partitioned, hung): the stream is
	// failed UNAVAILABLE and its admissions go to the next node (again with the same request
	// IDs). Without it a stopped leader held every Wait until its own deadline, and the next
	// ones joined the same stream, for as long as it stayed stopped (trial: 15 s).
	streamStallBeats = 3
	streamStallMin   = 3 * time.Second
	// streamMaxBeat is the longest heartbeat period the client watches; a header announcing
	// a longer one (or a malformed one) is ignored.
	streamMaxBeat = time.Minute
)

// streamHeartbeatHeader is rpc.StreamHeartbeatHeader (the client does not import rpc).
const streamHeartbeatHeader = "x-quotad-stream-heartbeat-ms"

// streamer owns the Client's current AcquireStream. Safe for concurrent use.
type streamer struct {
	c          *Client
	idle       time.Duration // streamIdle (tests shorten it)
	closeGrace time.Duration // streamCloseGrace (tests shorten it)

	mu       sync.Mutex
	cur      *wstream
	offUntil time.Time // no new stream before this
	refused  bool      // offUntil is a refusal's (streamOffAfterRefusal), not a backoff
	failures int       // streams broken in a row without an answer (backoff)
	closed   bool
}

// wstream is one AcquireStream and the admissions it carries.
type wstream struct {
	s      *streamer
	addr   string
	ctx    context.Context
	cancel context.CancelFunc
	sendq  chan *quotadv1.Admission
	kick   chan struct{} // cancels queued
	done   chan struct{} // closed when broken

	lastRecv atomic.Int64 // when the last message came (unix ns)

	mu       sync.Mutex
	calls    map[uint64]*streamCall // undecided, by request ID
	cancels  []uint64
	broken   bool
	retired  bool // closed for being idle (broken too)
	answered bool
}

type streamCall struct {
	done chan streamResult // buffered: the receiver never blocks
	// sent: its admission went into a message (under wstream.mu). A caller that gives up
	// before sends no cancel and its admission is dropped from the queue: a cancel in the
	// admission's own message or an earlier one would name nothing on the leader (it applies
	// a message's cancels first), which would then queue the admission for its whole wait.
	sent bool
}

// streamResult is a caller's outcome: a decision, an error, fallback (decide it by unary
// Acquire with the same request ID) or again (send it on the next stream: this one was
// refused by a node that named the leader, ended for lack of one, or answered UNAVAILABLE).
type streamResult struct {
	d                       *quotadv1.Decision
	at                      time.Time
	err                     error
	fallback, again, reopen bool
}

func newStreamer(c *Client) *streamer {
	return &streamer{c: c, idle: streamIdle, closeGrace: streamCloseGrace}
}

// submit decides a waiting admission over the stream, falling back to acquireOne. An
// admission whose stream broke for a leader change (a node named the leader, the old leader
// answered UNAVAILABLE, the node went away) is sent again on the next stream (same request
// ID), for up to streamResendFor, before it falls back.
func (s *streamer) submit(ctx context.Context, adm *quotadv1.Admission) (*quotadv1.Decision, time.Time, error) {
	var resendUntil time.Time // set at the first break: zero while none
	for tries := 1; ; tries++ {
		ws := s.stream()
		if ws == nil && !resendUntil.IsZero() {
			ws = s.streamAfterBackoff(ctx, resendUntil)
		}
		if ws == nil {
			if !resendUntil.IsZero() {
				return s.fallback(ctx, adm)
			}
			return s.c.acquireOne(ctx, adm)
		}
		r, ok := s.await(ctx, ws, adm)
		if !ok {
			return nil, time.Time{}, s.c.unavailable("Acquire", tries, nil, ctx.Err())
		}
		switch {
		case r.reopen:
			continue // the stream was closed for being idle as this admission came: a new one
		case r.again && (resendUntil.IsZero() || time.Now().Before(resendUntil)):
			if resendUntil.IsZero() {
				resendUntil = time.Now().Add(streamResendFor)
			}
			if !ws.isBroken() {
				// Answered UNAVAILABLE (leadership moved): send it again once the old
				// leader has ended the stream (naming the new one), not to the old leader.
				t := time.NewTimer(streamResendWait)
				select {
				case <-ws.done:
				case <-t.C:
				case <-ctx.Done():
				}
				t.Stop()
			}
			continue
		case r.again, r.fallback:
			return s.fallback(ctx, adm)
		}
		return r.d, r.at, r.err
	}
}

// await sends adm on ws and waits for its answer; false when ctx ended first.
func (s *streamer) await(ctx context.Context, ws *wstream, adm *quotadv1.Admission) (streamResult, bool) {
	call, retired := ws.add(ctx, adm)
	if call == nil {
		// The stream broke before adm joined it: the next one (submit decides whether it
		// may open, or adm goes unary).
		return streamResult{again: !retired, reopen: retired}, true
	}
	limit := s.c.cfg.AttemptTimeout + time.Duration(adm.MaxWaitMs)*time.Millisecond
	timer := time.NewTimer(limit)
	defer timer.Stop()
	select {
	case r := <-call.done:
		return r, true
	case <-ctx.Done():
		if !ws.forget(adm.RequestId) {
			// Answered in the same instant: prefer a decision.
			select {
			case r := <-call.done:
				if r.err == nil && !r.fallback && !r.again {
					return r, true
				}
			default:
			}
		}
		return streamResult{}, false
	case <-timer.C:
		// A leader answers a waiting admission by its max wait: this stream is stuck (a paused
		// or partitioned node). Every admission on it goes unary.
		ws.fail(fmt.Errorf("no answer within %v", limit), nil)
		return <-call.done, true
	}
}

func (s *streamer) fallback(ctx context.Context, adm *quotadv1.Admission) (*quotadv1.Decision, time.Time, error) {
	select {
	case <-s.c.closing: // the stream broke because the client is closing
		return nil, time.Time{}, ErrClosed
	default:
	}
	s.c.metrics.streamFallbacks.Add(1)
	return s.c.acquireOne(ctx, adm)
}

// streamAfterBackoff waits out the short backoffs after broken streams (not a refusal) until
// a stream opens, and returns it; nil when streaming is off for longer, ctx ends or until
// passes. (Many callers wake at a break: another's new stream may break before this one
// looks, moving the backoff on.)
func (s *streamer) streamAfterBackoff(ctx context.Context, until time.Time) *wstream {
	for time.Now().Before(until) {
		s.mu.Lock()
		wait, refused, closed := time.Until(s.offUntil), s.refused, s.closed
		s.mu.Unlock()
		if refused || closed || wait > s.c.cfg.Backoff.Max || !sleep(ctx, wait) {
			return nil
		}
		if ws := s.stream(); ws != nil {
			return ws
		}
		if wait <= 0 {
			return nil // not a backoff: no node to open it to
		}
	}
	return nil
}

// stream returns the open stream, opening one unless streaming is off for now (nil).
func (s *streamer) stream() *wstream {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	if ws := s.cur; ws != nil {
		select {
		case <-ws.done:
		default:
			return ws
		}
	}
	if time.Now().Before(s.offUntil) {
		return nil
	}
	n, err := s.c.nodes.target()
	if err != nil {
		return nil
	}
	ctx, cancel := context.WithCancel(s.c.baseCtx)
	ws := &wstream{s: s, addr: n.addr, ctx: ctx, cancel: cancel, sendq: make(chan *quotadv1.Admission, streamQueue),
		kick: make(chan struct{}, 1), done: make(chan struct{}), calls: make(map[uint64]*streamCall)}
	s.cur = ws
	s.c.metrics.streams.Add(1)
	go ws.run(n.qc)
	return ws
}

func (s *streamer) close() {
	s.mu.Lock()
	s.closed = true
	ws := s.cur
	s.mu.Unlock()
	if ws != nil {
		ws.fail(ErrClosed, nil)
	}
}

// broke notes why the stream to addr ended (answered: it had answered something) and when
// the next stream may open. It reports whether the stream was refused by a node that named
// the leader, whom the next stream goes to.
func (s *streamer) broke(addr string, answered bool, err error, md metadata.MD) (again bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if answered {
		s.failures = 0
	}
	leader := firstValue(md)
	code := status.Code(err)
	s.refused = false
	switch {
	case code == codes.Unimplemented, code == codes.ResourceExhausted:
		s.refused = true
		// UNIMPLEMENTED: a build or node without the stream. RESOURCE_EXHAUSTED: the leader
		// refused one more stream for this credential (--max-streams-per-identity), or a
		// message was too large; retrying at once would be refused again, every time.
		s.offUntil = time.Now().Add(streamOffAfterRefusal)
	case leader != "" && leader != addr && s.c.nodes.follow(leader):
		// A follower (or a deposed leader) named the leader: the next stream goes there.
		return code == codes.FailedPrecondition
	case code == codes.FailedPrecondition:
		s.offUntil = time.Now().Add(streamOffAfterRefusal) // a leader this client cannot follow
		s.refused = true
	default:
		s.offUntil = time.Now().Add(s.c.cfg.Backoff.delay(s.failures))
		s.failures++
		if code == codes.Unavailable {
			// The node went away or has no leader (an election): the next stream goes to
			// the next node, which serves it or names the leader.
			s.c.nodes.failed(addr, silent(code, leader))
			return true
		}
	}
	return false
}

// add registers adm and queues it for sending; nil when the stream is broken (retired: it
// was closed for being idle).
func (ws *wstream) add(ctx context.Context, adm *quotadv1.Admission) (call *streamCall, retired bool) {
	call = &streamCall{done: make(chan streamResult, 1)}
	ws.mu.Lock()
	if ws.broken {
		retired = ws.retired
		ws.mu.Unlock()
		return nil, retired
	}
	ws.calls[adm.RequestId] = call
	ws.mu.Unlock()
	select {
	case ws.sendq <- adm:
	case <-ws.done: // fail answers call
	case <-ctx.Done():
		ws.forget(adm.RequestId) // never sent: the cancel is ignored by the leader
	}
	return call, false
}

// retire closes an idle stream (nothing undecided, no cancel to send): it stops taking
// admissions and half-closes, and the leader ends it. False if it is not idle.
func (ws *wstream) retire(cs quotadv1.Quota_AcquireStreamClient) bool {
	ws.mu.Lock()
	if ws.broken || len(ws.calls) > 0 || len(ws.cancels) > 0 || len(ws.sendq) > 0 {
		ws.mu.Unlock()
		return false
	}
	ws.broken, ws.retired = true, true
	ws.mu.Unlock()
	close(ws.done)
	_ = cs.CloseSend()
	// The receiver waits for the leader to end the stream; one that never does (paused,
	// partitioned) would hold it and the call forever: cancel it after the grace.
	time.AfterFunc(ws.s.closeGrace, ws.cancel)
	return true
}

// forget drops an undecided admission whose caller gave up and queues its cancel (none when
// it was not sent yet: run drops it); false when it was already answered (its result is in
// its call's channel).
func (ws *wstream) forget(id uint64) bool {
	ws.mu.Lock()
	call, ok := ws.calls[id]
	sent := ok && call.sent
	if ok {
		delete(ws.calls, id)
	}
	if sent {
		ws.cancels = append(ws.cancels, id)
	}
	ws.mu.Unlock()
	if sent {
		select {
		case ws.kick <- struct{}{}:
		default:
		}
	}
	return ok
}

// isBroken reports whether the stream has ended (or been retired).
func (ws *wstream) isBroken() bool {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	return ws.broken
}

// fail ends the stream: every undecided admission is sent again on the next stream (a leader
// change) or falls back to unary Acquire.
func (ws *wstream) fail(err error, md metadata.MD) {
	ws.mu.Lock()
	if ws.broken {
		ws.mu.Unlock()
		ws.cancel() // a retired stream's end (io.EOF)
		return
	}
	ws.broken = true
	calls, answered := ws.calls, ws.answered
	ws.calls = nil
	ws.mu.Unlock()
	close(ws.done)
	ws.cancel()
	again := ws.s.broke(ws.addr, answered, err, md)
	for _, call := range calls {
		call.done <- streamResult{fallback: !again, again: again}
	}
}

// run opens the stream, starts its receiver and sends until it breaks.
func (ws *wstream) run(qc quotadv1.QuotaClient) {
	cs, err := qc.AcquireStream(ws.ctx)
	if err != nil {
		ws.fail(err, nil)
		return
	}
	go ws.recv(cs)
	c := ws.s.c
	first := true
	idle := time.NewTimer(ws.s.idle)
	defer idle.Stop()
	for {
		var adms []*quotadv1.Admission
		select {
		case a := <-ws.sendq:
			adms = append(adms, a)
		case <-ws.kick:
		case <-ws.done:
			return
		case <-idle.C:
			if ws.retire(cs) {
				return
			}
			idle.Reset(ws.s.idle)
			continue
		}
	drain: // whatever else is queued goes along
		for len(adms) < maxAdmissionsPerBatch {
			select {
			case a := <-ws.sendq:
				adms = append(adms, a)
			default:
				break drain
			}
		}
		ws.mu.Lock()
		kept := adms[:0]
		for _, a := range adms {
			if call := ws.calls[a.RequestId]; call != nil { // else its caller gave up: not sent
				call.sent = true
				kept = append(kept, a)
			}
		}
		adms = kept
		n := min(len(ws.cancels), maxAdmissionsPerBatch)
		cancels := ws.cancels[:n:n]
		ws.cancels = ws.cancels[n:]
		more := len(ws.cancels) > 0
		ws.mu.Unlock()
		if more {
			select {
			case ws.kick <- struct{}{}:
			default:
			}
		}
		if len(adms) == 0 && len(cancels) == 0 {
			continue
		}
		m := &quotadv1.AcquireStreamRequest{Admissions: adms, Cancels: cancels}
		if first {
			m.ClientId, first = c.id, false
		}
		c.metrics.streamSends.Add(1)
		c.metrics.streamAdmissions.Add(uint64(len(adms)))
		if err := cs.Send(m); err != nil {
			if !errors.Is(err, io.EOF) { // io.EOF: the stream ended; recv gets its status
				ws.fail(err, nil)
			}
			return
		}
		idle.Reset(ws.s.idle)
	}
}

// recv hands each answer to its caller until the stream ends.
func (ws *wstream) recv(cs quotadv1.Quota_AcquireStreamClient) {
	if md, err := cs.Header(); err == nil {
		if v := md.Get(streamHeartbeatHeader); len(v) > 0 {
			// A period outside (0, streamMaxBeat] is not one this client can watch (one
			// that overflows a Duration made time.NewTicker panic): no watch, as without
			// the header.
			if ms, err := strconv.ParseInt(v[0], 10, 64); err == nil && ms > 0 && ms <= streamMaxBeat.Milliseconds() {
				go ws.watch(time.Duration(ms) * time.Millisecond)
			}
		}
	}
	for {
		resp, err := cs.Recv()
		ws.lastRecv.Store(time.Now().UnixNano())
		if err != nil {
			// The trailer first: the header named the leader when the stream opened, which
			// a deposed leader's trailer corrects.
			md, _ := cs.Header()
			ws.fail(err, metadata.Join(cs.Trailer(), md))
			return
		}
		at := time.Now()
		for _, sd := range resp.GetDecisions() {
			ws.deliver(sd, at)
		}
	}
}

// deliver gives one answer to its caller (none: canceled, or the stream already failed).
// watch fails the stream when its leader, which sends a heartbeat every beat while admissions
// are undecided, has sent nothing for streamStallBeats beats (at least streamStallMin) while
// admissions were sent on it and undecided (see streamStallBeats).
func (ws *wstream) watch(beat time.Duration) {
	stall := max(streamStallBeats*beat, streamStallMin)
	t := time.NewTicker(beat)
	defer t.Stop()
	quietFrom := time.Now() // silence counts from when admissions were last all decided
	prev := quietFrom       // the previous tick
	for {
		select {
		case <-ws.done:
			return
		case <-t.C:
		}
		now := time.Now()
		late := now.Sub(prev) > 2*beat
		prev = now
		if late || !ws.awaiting() {
			// late: this process was not running (stopped, its VM suspended, starved) for
			// more than a beat; what the leader sent meanwhile waits unread in the socket, and
			// the receiver may not have run yet. Silence counts from now.
			quietFrom = now
			continue
		}
		since := max(quietFrom.UnixNano(), ws.lastRecv.Load())
		if silent := now.Sub(time.Unix(0, since)); silent > stall {
			ws.s.c.metrics.streamStalls.Add(1)
			ws.fail(status.Errorf(codes.Unavailable, "AcquireStream to %s: nothing received for %v while admissions were undecided (the leader sends a heartbeat every %v): the node is stalled or unreachable; trying another", ws.addr, silent.Round(time.Millisecond), beat), nil)
			return
		}
	}
}

// awaiting reports whether an admission was sent on ws and is undecided.
func (ws *wstream) awaiting() bool {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	for _, c := range ws.calls {
		if c.sent {
			return true
		}
	}
	return false
}

func (ws *wstream) deliver(sd *quotadv1.StreamDecision, at time.Time) {
	ws.mu.Lock()
	call := ws.calls[sd.GetRequestId()]
	delete(ws.calls, sd.GetRequestId())
	ws.answered = true
	ws.mu.Unlock()
	if call == nil {
		return
	}
	switch {
	case sd.GetCode() != 0:
		st := status.New(codes.Code(sd.GetCode()), sd.GetMessage())
		if st.Code() == codes.Unavailable {
			// Leadership changed while it waited: the stream ends at the leader's next check
			// (naming the new leader); send it again on the next stream, same request ID.
			call.done <- streamResult{again: true}
			return
		}
		if retryable(st.Code()) {
			call.done <- streamResult{fallback: true} // as a unary attempt would be retried
			return
		}
		call.done <- streamResult{err: permanentError("Acquire", st, st.Err())}
	case sd.GetDecision() == nil:
		call.done <- streamResult{err: fmt.Errorf("quotad: AcquireStream: the answer for request %d has neither a decision nor a status", sd.GetRequestId())}
	default:
		call.done <- streamResult{d: sd.GetDecision(), at: at}
	}
}
