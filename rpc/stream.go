package rpc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
)

// AcquireStream: waiting admissions of many callers of one client over one stream (issue 16).
//
// A unary Acquire of many waiting admissions answers when its slowest admission is decided, so
// a client sent each waiting admission in its own RPC, and at 10,000 grants/s the per-RPC cost
// (gRPC, TLS, a goroutine and a context per call, on both sides) saturated the 2-core machine.
// On a stream the client sends whatever is queued in one message and each admission is
// answered the moment it is decided, several answers to a message when several are ready.
//
// Each admission runs through exactly the path of a unary Acquire on the leader
// (acquireLeader with that one admission: the dedup check, the fair scheduler's wait with its
// waiter slots and caps, the gate for non-waiting ones, the group commit), under a context of
// its own that a cancel from the client ends, as a unary caller's cancel ends its call. The
// stream adds one cap (WaiterCaps.PerStream: undecided admissions of one stream) and is served
// only by the leader: a follower refuses with FAILED_PRECONDITION and the leader header (the
// client re-opens it there and decides the refused admissions by unary Acquire meanwhile), a
// regional node with UNIMPLEMENTED (its path goes through the global cluster first;
// regionAcquire stays unary). Losing leadership with admissions undecided answers them
// UNAVAILABLE (their waits fail as unary ones do) and ends the stream at the next message.
//
// What one caller can hold through streams is bounded: open streams per identity
// (--max-streams-per-identity, refused RESOURCE_EXHAUSTED), undecided admissions per stream
// (--max-stream-admissions), and time: an answer the client does not read (its flow-control
// window stays full) within --stream-send-timeout ends the stream (DEADLINE_EXCEEDED), and so
// do a revoked token and lost leadership while answers wait to be read.

const (
	// DefaultMaxStreamAdmissions is the default cap on one stream's undecided admissions
	// (--max-stream-admissions): twice the per-client waiter cap, since admissions that are
	// decided at once also count while they commit.
	DefaultMaxStreamAdmissions = 2 * DefaultMaxWaitersPerClient
	// ScopeStreamWaiters is the scope of a too_many_waiters denial by the per-stream cap.
	ScopeStreamWaiters = "stream"
	// streamAuthRecheck is how often an open stream with undecided admissions re-checks its
	// caller's token (and this node's leadership) when the client sends nothing: a revoked
	// token ends the stream within this.
	streamAuthRecheck = time.Second
	// StreamHeartbeatHeader is the AcquireStream response header in which a leader says it
	// sends a message without decisions every that many milliseconds while the stream has
	// admissions undecided (absent: a build that sends none).
	StreamHeartbeatHeader = "x-quotad-stream-heartbeat-ms"
	// streamMaxAnswers caps the answers in one response message.
	streamMaxAnswers = 1024
	// DefaultStreamSendTimeout is how long a write of answers may wait for the client to read
	// (--stream-send-timeout) before the stream is ended. The Go client reads every answer as
	// it arrives, so only a client that stopped reading (hung, hostile, or stalled 30 s) hits it.
	DefaultStreamSendTimeout = 30 * time.Second
	// DefaultMaxStreamsPerIdentity caps the AcquireStreams one identity may have open on the
	// leader (--max-streams-per-identity). A Go client process holds one; a workload with more
	// processes than this per credential sends the rest of its waits unary (as before streams
	// existed) until a stream frees up, or gets a credential per group of processes.
	DefaultMaxStreamsPerIdentity = 256
)

// acquireStream is the leader's state of one AcquireStream.
type acquireStream struct {
	s        *Server
	ss       quotadv1.Quota_AcquireStreamServer
	ctx      context.Context // canceled when the handler returns
	id       auth.Identity
	clientID string
	max      int

	mu sync.Mutex
	// pending: the undecided admissions by request ID. An entry is a record of its own,
	// compared by pointer: a client may cancel X and send X again (in the same message or a
	// later one) while the first X's goroutine still holds on, and that goroutine must
	// neither remove the second X's entry nor answer in its name.
	pending map[uint64]*streamAdmission
	// held counts the admissions started and not yet answered (or dropped): what the
	// per-stream cap bounds. Not len(pending): an admission leaves pending when decided, but
	// its goroutine holds on until the answer is queued, which a client that does not read
	// delays forever; a canceled one holds on until its wait ends.
	held int
	wg   sync.WaitGroup                // their goroutines
	out  chan *quotadv1.StreamDecision // answers, to the sender

	born time.Time // the stream's start: sendingSince counts from it (monotonic)
	// sendingSince is when the sender's write in progress began (time since born, +1), 0
	// when it is not writing; unsent counts the answers queued and not yet written. Both are
	// how the serve loop sees a client that does not read (stalled).
	sendingSince atomic.Int64
	unsent       atomic.Int64
	// slotKey is the per-identity stream slot this stream holds ("": none yet).
	slotKey string
	// timedOut: ended for --stream-send-timeout; its connection is closed (connlisten.go).
	timedOut atomic.Bool
}

// streamAdmission is one undecided admission of a stream (pending).
type streamAdmission struct {
	cancel context.CancelFunc
}

// AcquireStream decides a stream of admissions, answering each as soon as it is decided (see
// the comment above).
func (s *Server) AcquireStream(ss quotadv1.Quota_AcquireStreamServer) error {
	ctx := ss.Context()
	switch {
	case s.region != nil:
		return status.Error(codes.Unimplemented, "AcquireStream is not served by a regional cluster's nodes; use Acquire")
	case s.noStream:
		return status.Error(codes.Unimplemented, "AcquireStream is turned off on this node (--disable-acquire-stream); use Acquire")
	}
	_, leaderAddr := s.node.Leader()
	if leaderAddr != "" {
		_ = grpc.SetHeader(ctx, metadata.Pairs(LeaderHeader, leaderAddr))
	}
	if !s.node.IsLeader() {
		return notLeaderForStream(leaderAddr)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st := &acquireStream{s: s, ss: ss, ctx: ctx, id: IdentityFrom(ctx), max: s.fair.slots.perStream(),
		pending: make(map[uint64]*streamAdmission), out: make(chan *quotadv1.StreamDecision, 256), born: time.Now()}
	defer st.releaseSlot()
	defer func() {
		if st.timedOut.Load() {
			// Its client does not read: grpc-go would keep the stream's unwritten answers and
			// unread requests until it did (connlisten.go). Its other calls on the connection
			// fail Unavailable and are retried, as after any lost connection.
			s.endConn(ss.Context())
		}
	}()
	if !st.countsByClientID() {
		// Counted from the open (before the header: a refusal is the whole answer). The
		// insecure identity is everyone's, so its streams count by client_id (handle).
		if err := st.takeSlot(st.id.Name, fmt.Sprintf("identity %.64q", st.id.Name)); err != nil {
			return err
		}
	}
	// The header now: the client learns the leader, and that this leader sends a heartbeat
	// (an answer message without decisions) every streamAuthRecheck while admissions are
	// undecided, so a client can tell a stalled leader (paused, partitioned, its process
	// stopped) from admissions that are merely waiting, and leave it.
	if err := ss.SendHeader(metadata.Pairs(StreamHeartbeatHeader, strconv.FormatInt(streamAuthRecheck.Milliseconds(), 10))); err != nil {
		return err
	}
	s.openStreams.Add(1)
	defer s.openStreams.Add(-1)
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		st.send()
	}()
	err := st.serve()
	if err == nil {
		// Half-closed and every admission's answer queued: close out, and the sender writes
		// what is left and stops — within --stream-send-timeout, like every write.
		st.wg.Wait()
		close(st.out)
		if err = st.flush(sent); err == nil {
			return nil
		}
		cancel()
		return err
	}
	// The stream ends on err: every undecided admission's wait is canceled, and answers not
	// yet written are dropped. A dropped answer of an admission already decided (granted,
	// its units debited in the log) is exactly a unary Acquire whose response was lost: the
	// client decides it again with the same request ID (the Go client does so, by unary
	// Acquire, when a stream breaks) and the FSM's dedup table returns that decision, debiting
	// nothing more. So nothing is refunded here — a refund followed by that retry would hand
	// out the units twice; a client that never retries leaves them spent, as after a lost
	// unary answer (rate units are never over-admitted; a concurrency permit comes back when
	// its lease TTL ends). An admission whose entry is committing when canceled is the same:
	// its outcome is unknown until the retry asks.
	cancel()
	st.wg.Wait()
	close(st.out)
	// Not waiting for the sender: it may be blocked in Send on a client that does not read,
	// and only this handler's return unblocks it (grpc-go then cancels the stream's context,
	// which ends the write, after writing this status). It sends nothing more: st.ctx is
	// canceled, which it checks before each write.
	return err
}

// countsByClientID: an agent run with --insecure has one identity for every caller, so its
// streams are counted per client_id (from the stream's first message), as its waiters are.
func (st *acquireStream) countsByClientID() bool {
	return st.s.insecure && st.id.Name == insecureIdentity
}

// takeSlot counts this stream against its identity's cap (--max-streams-per-identity), or
// refuses it (RESOURCE_EXHAUSTED) naming who and the limit.
func (st *acquireStream) takeSlot(key, who string) error {
	s := st.s
	limit := s.maxStreamsPerIdentity
	if limit <= 0 {
		limit = DefaultMaxStreamsPerIdentity
	}
	s.streamsMu.Lock()
	defer s.streamsMu.Unlock()
	if n := s.streamsByIdentity[key]; n >= limit {
		s.metrics.streamCapped(streamCapIdentity)
		return status.Errorf(codes.ResourceExhausted, "AcquireStream: %s already has %d AcquireStreams open on this leader, its limit (--max-streams-per-identity %d); close one (a Go client holds one per process), send waiting admissions by unary Acquire, or use another credential", who, n, limit)
	}
	if s.streamsByIdentity == nil {
		s.streamsByIdentity = make(map[string]int)
	}
	s.streamsByIdentity[key]++
	st.slotKey = key
	return nil
}

// releaseSlot gives back the stream's per-identity slot, if it holds one.
func (st *acquireStream) releaseSlot() {
	if st.slotKey == "" {
		return
	}
	s := st.s
	s.streamsMu.Lock()
	if s.streamsByIdentity[st.slotKey]--; s.streamsByIdentity[st.slotKey] <= 0 {
		delete(s.streamsByIdentity, st.slotKey)
	}
	s.streamsMu.Unlock()
	st.slotKey = ""
}

// flush waits for the sender to write the last answers and stop, re-checking the token, the
// leadership and the write's age every streamAuthRecheck; an error ends the stream.
func (st *acquireStream) flush(sent <-chan struct{}) error {
	tick := time.NewTicker(streamAuthRecheck)
	defer tick.Stop()
	for {
		select {
		case <-sent:
			return nil
		case <-tick.C:
			if err := st.stalled(); err != nil {
				return err
			}
			if err := st.check(); err != nil {
				return err
			}
		}
	}
}

// sendTimeout is --stream-send-timeout.
func (s *Server) sendTimeout() time.Duration {
	if s.streamSendTimeout <= 0 {
		return DefaultStreamSendTimeout
	}
	return s.streamSendTimeout
}

// stalled ends the stream (DEADLINE_EXCEEDED) when a write of answers has waited longer than
// --stream-send-timeout for the client to read.
func (st *acquireStream) stalled() error {
	since := st.sendingSince.Load()
	if since == 0 {
		return nil
	}
	waited := time.Since(st.born) - time.Duration(since-1)
	if limit := st.s.sendTimeout(); waited >= limit {
		st.s.metrics.streamCapped(streamCapSendTimeout)
		st.timedOut.Store(true)
		return status.Errorf(codes.DeadlineExceeded, "AcquireStream: the client has not read its answers for %v (--stream-send-timeout %v); the stream ends and its undecided admissions are canceled: decide them again with the same request IDs, which returns any decision already made", waited.Round(time.Millisecond), limit)
	}
	return nil
}

// AcquireStreams returns the AcquireStreams open on this agent (quotad_acquire_streams).
func (a *Agent) AcquireStreams() int { return int(a.server.openStreams.Load()) }

// notLeaderForStream is a follower's refusal of an AcquireStream.
func notLeaderForStream(leaderAddr string) error {
	if leaderAddr == "" {
		return status.Error(codes.Unavailable, "no leader: the cluster is electing one or has lost quorum; retry shortly or check `quotad status`")
	}
	return status.Errorf(codes.FailedPrecondition, "AcquireStream is served by the leader only (%s); open it there, or use Acquire, which any node forwards", leaderAddr)
}

// serve reads the client's messages until it half-closes and every admission is answered
// (nil), or the stream must end (the error to end it with).
func (st *acquireStream) serve() error {
	type received struct {
		m   *quotadv1.AcquireStreamRequest
		err error
	}
	recvd := make(chan received)
	go func() {
		for {
			m, err := st.ss.Recv()
			select {
			case recvd <- received{m, err}:
			case <-st.ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	// The token and leadership are re-checked on every message and, while admissions are
	// undecided or answers unwritten, every streamAuthRecheck: an idle stream costs no
	// wake-ups.
	tick := time.NewTicker(streamAuthRecheck)
	defer tick.Stop()
	tick.Stop()
	ticking := false
	var drained chan struct{} // closed when every admission is answered after the half-close
	for {
		select {
		case r := <-recvd:
			if errors.Is(r.err, io.EOF) {
				drained = make(chan struct{})
				go func() {
					st.wg.Wait()
					close(drained)
				}()
				recvd = nil
				continue
			}
			if r.err != nil {
				return r.err
			}
			st.s.metrics.streamMessage("received")
			if err := st.handle(r.m); err != nil {
				return err
			}
			if len(r.m.Admissions) > 0 && !ticking {
				// Started, not restarted: a client sending more often than the tick would
				// otherwise postpone the re-checks and the heartbeat forever.
				tick.Reset(streamAuthRecheck)
				ticking = true
			}
		case <-drained:
			return nil
		case <-tick.C:
			if err := st.check(); err != nil {
				return err
			}
			if err := st.stalled(); err != nil {
				return err
			}
			// Ticks go on while anything is held: undecided admissions, and answers decided
			// but not written (a client that does not read must still meet the re-checks and
			// the send timeout). held drops only after its answer is counted in unsent.
			st.mu.Lock()
			idle := st.held == 0
			st.mu.Unlock()
			if idle && st.unsent.Load() == 0 {
				tick.Stop()
				ticking = false
			} else if !idle {
				// The heartbeat (StreamHeartbeatHeader); never waits: with the sender's
				// queue full, answers are what the client is not reading.
				select {
				case st.out <- nil:
				default:
				}
			}
		case <-st.ctx.Done():
			return st.ctx.Err()
		}
	}
}

// reauthenticate checks the stream's credential again: a token revoked since the stream
// opened, or a certificate put on the deny-list since, ends it (UNAUTHENTICATED).
func (st *acquireStream) reauthenticate() error {
	c := callerFrom(st.ctx)
	if !c.viaToken {
		if st.s.certRevokedOwner(c.id.Cert) {
			return revokedCertError("AcquireStream", strings.TrimPrefix(c.id.Name, "cert:"), c.id.Cert)
		}
		return nil
	}
	if st.s.authn == nil {
		return nil
	}
	md, _ := metadata.FromIncomingContext(st.ctx)
	id, err := st.s.authn.fromToken(md.Get(authorizationHeader), "AcquireStream")
	if err != nil {
		return err
	}
	if id.Name != c.id.Name || id.Role != c.id.Role {
		return status.Errorf(codes.Unauthenticated, "AcquireStream: the token now names %s, not %s; open a new stream", id, c.id)
	}
	return nil
}

// check ends the stream (the error) when its token was revoked or this node no longer leads
// (the trailer names the new leader).
func (st *acquireStream) check() error {
	if err := st.reauthenticate(); err != nil {
		return err
	}
	if !st.s.node.IsLeader() {
		_, addr := st.s.node.Leader()
		if addr != "" {
			_ = grpc.SetTrailer(st.ctx, metadata.Pairs(LeaderHeader, addr))
		}
		return notLeaderForStream(addr)
	}
	return nil
}

// handle takes one client message: cancels first (they name earlier admissions), then the new
// admissions, each started on its own.
func (st *acquireStream) handle(m *quotadv1.AcquireStreamRequest) error {
	if err := st.check(); err != nil {
		return err
	}
	switch {
	case m.ClientId != "" && st.clientID != "" && m.ClientId != st.clientID:
		return status.Errorf(codes.InvalidArgument, "client_id %.64q differs from this stream's %.64q; open a stream per client_id", m.ClientId, st.clientID)
	case m.ClientId == "" && st.clientID == "":
		return status.Error(codes.InvalidArgument, "client_id is empty in the stream's first message; set a stable ID per client so retries can be deduplicated")
	case len(m.Cancels) > MaxAdmissionsPerCall:
		return status.Errorf(codes.InvalidArgument, "%d cancels in one message; send at most %d", len(m.Cancels), MaxAdmissionsPerCall)
	}
	if st.clientID == "" {
		st.clientID = m.ClientId
		if st.countsByClientID() {
			if err := st.takeSlot(insecureIdentity+"\x00"+st.clientID, fmt.Sprintf("client_id %.64q", st.clientID)); err != nil {
				return err
			}
		}
	}
	st.mu.Lock()
	for _, id := range m.Cancels {
		if a, ok := st.pending[id]; ok {
			delete(st.pending, id)
			a.cancel()
		}
	}
	st.mu.Unlock()
	if len(m.Admissions) == 0 {
		return nil
	}
	req := &quotadv1.AcquireRequest{ClientId: st.clientID, Admissions: m.Admissions}
	if err := validateAcquire(req); err != nil {
		return err
	}
	for _, adm := range m.Admissions {
		if err := st.start(adm); err != nil {
			return err
		}
	}
	return nil
}

// start decides adm in a goroutine of its own and answers it, unless the client cancels it.
func (st *acquireStream) start(adm *quotadv1.Admission) error {
	rid := adm.GetRequestId()
	st.mu.Lock()
	if _, dup := st.pending[rid]; dup && rid != 0 {
		st.mu.Unlock()
		return status.Errorf(codes.InvalidArgument, "request_id %d is already undecided on this stream; send a request ID again only after its answer (or on another call)", rid)
	}
	if st.held >= st.max {
		held := st.held
		st.mu.Unlock()
		// Answered from the serve loop, which must not block for good on a client that does
		// not read: queueing it re-checks like the loop does.
		return st.answerFromServe(&quotadv1.StreamDecision{RequestId: rid, Decision: st.s.fair.tooManyWaiters(adm.GetDomain(),
			fmt.Sprintf("this stream already has %d undecided or unread admissions, its limit (--max-stream-admissions %d); wait for some to be answered and read them, or open another stream", held, st.max),
			ScopeStreamWaiters)})
	}
	actx, cancel := context.WithCancel(st.ctx)
	rec := &streamAdmission{cancel: cancel}
	if rid != 0 {
		st.pending[rid] = rec
	}
	st.held++
	st.wg.Add(1)
	st.mu.Unlock()
	go func() {
		defer st.wg.Done()
		defer func() {
			st.mu.Lock()
			st.held--
			st.mu.Unlock()
		}()
		defer cancel()
		d, err := st.s.acquireOneStreamed(actx, st.id, st.clientID, adm)
		st.mu.Lock()
		live := st.pending[rid] == rec // another record: this one was canceled, the ID sent again
		if live {
			delete(st.pending, rid)
		}
		st.mu.Unlock()
		if !live && rid != 0 {
			return // canceled by the client: it has forgotten this admission
		}
		sd := &quotadv1.StreamDecision{RequestId: rid, Decision: d}
		if err != nil {
			stt := status.Convert(err)
			sd.Code, sd.Message = uint32(stt.Code()), stt.Message()
		}
		st.answer(sd)
	}()
	return nil
}

// answer queues sd for the sender (dropped once the stream is ending).
func (st *acquireStream) answer(sd *quotadv1.StreamDecision) {
	st.unsent.Add(1)
	select {
	case st.out <- sd:
	case <-st.ctx.Done():
		st.unsent.Add(-1)
	}
}

// answerFromServe is answer for the serve loop: while out is full (a client that does not
// read) it goes on re-checking the token, the leadership and the send timeout, and returns
// the error that ends the stream.
func (st *acquireStream) answerFromServe(sd *quotadv1.StreamDecision) error {
	st.unsent.Add(1) // before it can be written: the sender subtracts what it wrote
	select {
	case st.out <- sd:
		return nil
	default:
	}
	tick := time.NewTicker(streamAuthRecheck)
	defer tick.Stop()
	for {
		select {
		case st.out <- sd:
			return nil
		case <-st.ctx.Done():
			st.unsent.Add(-1)
			return st.ctx.Err()
		case <-tick.C:
			err := st.stalled()
			if err == nil {
				err = st.check()
			}
			if err != nil {
				st.unsent.Add(-1)
				return err
			}
		}
	}
}

// send writes answers as they come, whatever is queued at once in one message, until out is
// closed. After a failed write it only drains.
func (st *acquireStream) send() {
	var failed bool
	for sd := range st.out {
		// A nil is a heartbeat: a message, with whatever answers are queued beside it.
		resp := &quotadv1.AcquireStreamResponse{}
		if sd != nil {
			resp.Decisions = append(resp.Decisions, sd)
		}
	drain:
		for len(resp.Decisions) < streamMaxAnswers {
			select {
			case more, ok := <-st.out:
				if !ok {
					break drain
				}
				if more != nil {
					resp.Decisions = append(resp.Decisions, more)
				}
			default:
				break drain
			}
		}
		n := int64(len(resp.Decisions))
		if failed || st.ctx.Err() != nil {
			st.unsent.Add(-n)
			continue
		}
		st.sendingSince.Store(int64(time.Since(st.born)) + 1)
		err := st.ss.Send(resp)
		st.sendingSince.Store(0)
		st.unsent.Add(-n)
		if err != nil {
			failed = true
			continue
		}
		st.s.metrics.streamMessage("sent")
	}
}

// acquireOneStreamed decides one admission of a stream exactly as a unary Acquire carrying it
// alone would on the leader: the same checks (admissionChecks), then acquireLeader. An error
// is the status that call would have failed with.
func (s *Server) acquireOneStreamed(ctx context.Context, id auth.Identity, clientID string, adm *quotadv1.Admission) (*quotadv1.Decision, error) {
	if err := s.admissionChecks(id, 0, adm); err != nil {
		return nil, err
	}
	resp, err := s.acquireLeader(ctx, &quotadv1.AcquireRequest{ClientId: clientID, Admissions: []*quotadv1.Admission{adm}}, id)
	if err != nil {
		return nil, err
	}
	if len(resp.Decisions) != 1 || resp.Decisions[0] == nil {
		return nil, status.Error(codes.Internal, "no decision for the admission")
	}
	return resp.Decisions[0], nil
}

// admissionChecks refuses admission i of a call whose caller id may not spend on its path
// (PERMISSION_DENIED). An admission without a domain is left to the decision (invalid).
func (s *Server) admissionChecks(id auth.Identity, i int, adm *quotadv1.Admission) error {
	if adm.GetDomain() == "" {
		return nil
	}
	if msg := scopeProblem(id, adm.GetDomain(), adm.GetDescriptors(), true); msg != "" {
		return permissionDenied("admissions[%d]: %s", i, msg)
	}
	if msg := s.tenantPathProblem(id, adm.GetDomain(), adm.GetDescriptors()); msg != "" {
		return permissionDenied("admissions[%d]: %s", i, msg)
	}
	return nil
}

// perStream is the cap on one stream's undecided admissions.
func (w *waiterSlots) perStream() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.caps.PerStream <= 0 {
		return DefaultMaxStreamAdmissions
	}
	return w.caps.PerStream
}
