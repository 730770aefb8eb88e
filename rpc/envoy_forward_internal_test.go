package rpc

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// TestForwardBatchesStayWithinBytes: a lane's batch carries calls whose requests together stay
// within its batch bytes, so the leader's message cap never refuses a whole batch — one
// caller's large request failed every other caller's in the same batch (review finding).
func TestForwardBatchesStayWithinBytes(t *testing.T) {
	l := &forwardLane{r: &rlsServer{batchBytes: 1000}}
	for _, n := range []int{300, 300, 300, 300, 900, 10, 10} {
		l.queue = append(l.queue, &forwardedCall{call: &quotadv1.ForwardedCall{Request: make([]byte, n)}})
	}
	var sizes [][]int
	for len(l.queue) > 0 {
		var b []int
		for _, fc := range l.take() {
			b = append(b, len(fc.call.Request))
		}
		sizes = append(sizes, b)
	}
	want := [][]int{{300, 300, 300}, {300}, {900, 10, 10}}
	if len(sizes) != len(want) {
		t.Fatalf("batches %v, want %v", sizes, want)
	}
	for i := range want {
		if len(sizes[i]) != len(want[i]) {
			t.Fatalf("batches %v, want %v", sizes, want)
		}
	}
}

// TestForwardQueueIsCapped: a follower's queue of calls waiting for a batch to the leader is
// capped in calls and in bytes (review: it was unbounded, so a burst of callers while the
// leader was slow grew memory without limit); a full queue refuses the call with
// RESOURCE_EXHAUSTED naming the cap, and calls whose callers are gone make room.
func TestForwardQueueIsCapped(t *testing.T) {
	l := &forwardLane{r: &rlsServer{s: &Server{}, batchBytes: 1000}}
	l.inflight = forwardInflight // no batch leaves: the leader is busy
	live := context.Background()
	call := func(ctx context.Context, size int) *forwardedCall {
		return &forwardedCall{ctx: ctx, call: &quotadv1.ForwardedCall{Request: make([]byte, size)}, done: make(chan struct{})}
	}
	gone, cancel := context.WithCancel(context.Background())
	for i := range MaxForwardQueue {
		ctx := live
		if i < 10 {
			ctx = gone
		}
		if err := l.add(call(ctx, 0)); err != nil {
			t.Fatalf("call %d of %d refused: %v", i+1, MaxForwardQueue, err)
		}
	}
	err := l.add(call(live, 0))
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), fmt.Sprint(MaxForwardQueue)) {
		t.Fatalf("call %d: %v; want RESOURCE_EXHAUSTED naming the cap %d", MaxForwardQueue+1, err, MaxForwardQueue)
	}
	cancel() // 10 callers give up: their calls make room
	for i := range 10 {
		if err := l.add(call(live, 0)); err != nil {
			t.Fatalf("after 10 callers gave up, call %d: %v", i+1, err)
		}
	}
	if err := l.add(call(live, 0)); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("queue over its cap again: %v", err)
	}
	if len(l.queue) != MaxForwardQueue {
		t.Fatalf("queue holds %d calls; cap %d", len(l.queue), MaxForwardQueue)
	}

	// Bytes: 8 batches of 1000 bytes, calls of 250 bytes (the largest that are batched).
	l = &forwardLane{r: &rlsServer{s: &Server{}, batchBytes: 1000}}
	l.inflight = forwardInflight
	for i := range forwardQueueBatches * 4 {
		if err := l.add(call(live, 250)); err != nil {
			t.Fatalf("250-byte call %d refused: %v", i+1, err)
		}
	}
	if err := l.add(call(live, 250)); status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "8000 bytes") {
		t.Fatalf("a call past 8000 queued bytes: %v; want RESOURCE_EXHAUSTED naming 8000 bytes", err)
	}
	for len(l.queue) > 0 {
		l.take()
	}
	if l.queueBytes != 0 {
		t.Fatalf("queue empty, %d bytes counted", l.queueBytes)
	}
}

// fakePeer serves quotad.v1.Peer for the follower side's tests: Unimplemented until upgraded
// (a leader of an older version); then it answers every call OK and records the calls.
type fakePeer struct {
	quotadv1.UnimplementedPeerServer
	upgraded atomic.Bool
	mu       sync.Mutex
	batches  int
	calls    []*quotadv1.ForwardedCall
}

func (f *fakePeer) ForwardRateLimit(ctx context.Context, req *quotadv1.ForwardRateLimitRequest) (*quotadv1.ForwardRateLimitResponse, error) {
	if !f.upgraded.Load() {
		return nil, status.Error(codes.Unimplemented, "unknown method ForwardRateLimit")
	}
	f.mu.Lock()
	f.batches++
	f.calls = append(f.calls, req.Calls...)
	f.mu.Unlock()
	ok, _ := proto.Marshal(&rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_OK})
	out := &quotadv1.ForwardRateLimitResponse{}
	for range req.Calls {
		out.Results = append(out.Results, &quotadv1.ForwardedResult{Response: ok})
	}
	return out, nil
}

func (f *fakePeer) counts() (batches int, calls []*quotadv1.ForwardedCall) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.batches, slices.Clone(f.calls)
}

func (o *oldLeader) count() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.calls
}

// startFakeLeader serves a fakePeer and an old leader's ShouldRateLimit on loopback.
func startFakeLeader(t *testing.T) (*fakePeer, *oldLeader, string) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	fp, old := &fakePeer{}, &oldLeader{}
	quotadv1.RegisterPeerServer(g, fp)
	rlsv3.RegisterRateLimitServiceServer(g, old)
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	return fp, old, lis.Addr().String()
}

func dialTest(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// TestForwardLegacyRechecks: a leader that lacked ForwardRateLimit is asked again after
// legacyRecheck, and at once when the follower switches to it from another leader's lane
// (review: the legacy mark stuck forever per address, so after a rolling upgrade finished
// a follower kept forwarding one RPC per call to that leader).
func TestForwardLegacyRechecks(t *testing.T) {
	fp, old, addr := startFakeLeader(t)
	conn, other := dialTest(t, addr), dialTest(t, addr)
	r := &rlsServer{s: &Server{}}
	batches := func() int { n, _ := fp.counts(); return n }
	req := &rlsv3.RateLimitRequest{Domain: "d", Descriptors: []*rlcommon.RateLimitDescriptor{
		{Entries: []*rlcommon.RateLimitDescriptor_Entry{{Key: "k", Value: "v"}}}}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	forward := func(c *grpc.ClientConn) {
		t.Helper()
		if _, err := r.forward(ctx, c, req); err != nil {
			t.Fatal(err)
		}
	}
	forward(conn) // the old leader: one by one from now on
	l := r.lane(conn)
	if !l.legacy() || old.count() != 1 {
		t.Fatalf("legacy %v, old leader answered %d; want legacy after its Unimplemented, 1 call", l.legacy(), old.count())
	}
	fp.upgraded.Store(true) // the rolling upgrade finishes
	forward(conn)
	if batches() != 0 || old.count() != 2 {
		t.Fatalf("within the recheck period: %d batches, %d single calls; want 0 and 2", batches(), old.count())
	}
	// The recheck period passes.
	l.legacyUntil.Store(time.Now().Add(-time.Millisecond).UnixNano())
	forward(conn)
	if batches() != 1 || l.legacy() {
		t.Fatalf("after the recheck period: %d batches (legacy %v); want the call batched to the upgraded leader", batches(), l.legacy())
	}
	// Legacy again; then the follower forwards to another leader and comes back.
	fp.upgraded.Store(false)
	forward(conn)
	if !l.legacy() {
		t.Fatal("not legacy after an Unimplemented")
	}
	fp.upgraded.Store(true)
	forward(other) // another leader's lane (another connection)
	forward(conn)  // back: asks again
	if batches() != 3 || l.legacy() {
		t.Fatalf("back from another leader: %d batches (legacy %v); want 3, not legacy", batches(), l.legacy())
	}
}

// TestForwardSkipsGoneCallers: a call whose caller gave up (its context canceled, no
// deadline) while it waited for a batch is not sent to the leader, which would charge it;
// the others carry their time left (timeout_ns) and none when they have no deadline.
func TestForwardSkipsGoneCallers(t *testing.T) {
	fp, _, addr := startFakeLeader(t)
	fp.upgraded.Store(true)
	conn := dialTest(t, addr)
	r := &rlsServer{s: &Server{}}
	l := r.lane(conn)
	l.mu.Lock()
	l.inflight = forwardInflight // queue until the test sends
	l.mu.Unlock()
	req := &rlsv3.RateLimitRequest{Domain: "d", Descriptors: []*rlcommon.RateLimitDescriptor{
		{Entries: []*rlcommon.RateLimitDescriptor_Entry{{Key: "k", Value: "v"}}}}}
	gone, cancel := context.WithCancel(context.Background())
	timed, cancelTimed := context.WithTimeout(context.Background(), time.Minute)
	defer cancelTimed()
	errs := make(chan error, 3)
	for _, ctx := range []context.Context{gone, timed, context.Background()} {
		go func() {
			_, err := r.forward(ctx, conn, req)
			errs <- err
		}()
	}
	for {
		l.mu.Lock()
		n := len(l.queue)
		l.mu.Unlock()
		if n == 3 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-errs; status.Code(err) != codes.Canceled {
		t.Fatalf("the caller that gave up got %v", err)
	}
	l.mu.Lock()
	batch := l.take()
	l.mu.Unlock()
	l.send(batch)
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	_, calls := fp.counts()
	if len(calls) != 2 {
		t.Fatalf("the leader got %d calls; want 2 (not the one whose caller gave up)", len(calls))
	}
	var timeouts []time.Duration
	for _, c := range calls {
		timeouts = append(timeouts, time.Duration(c.TimeoutNs))
	}
	if !slices.ContainsFunc(timeouts, func(d time.Duration) bool { return d > 50*time.Second && d <= time.Minute }) || !slices.Contains(timeouts, 0) {
		t.Fatalf("timeouts sent %v; want one near a minute (the caller's time left) and one 0 (no deadline)", timeouts)
	}
}
