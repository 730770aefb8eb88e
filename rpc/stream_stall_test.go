package rpc_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// unreadWindow: a fixed 64 KiB flow-control window (no BDP growth), so a leader writing answers
// to a client that does not read blocks after ~128 KiB (the client's window and the leader's
// write quota).
var unreadWindow = []grpc.DialOption{grpc.WithInitialWindowSize(1 << 16), grpc.WithInitialConnWindowSize(1 << 16)}

// floodUnread opens a stream as clientID and sends n admissions on "counted" (decided at once)
// in messages of 100 (after first, if any, in the first message), never reading an answer.
// It returns the stream once the leader holds at least 1,000 admissions' goroutines more than
// before (their answers cannot be written: the leader's sender is blocked on the client),
// and the last request ID sent.
func floodUnread(t *testing.T, ctx context.Context, q quotadv1.QuotaClient, clientID string, n int, first ...*quotadv1.Admission) (quotadv1.Quota_AcquireStreamClient, uint64) {
	t.Helper()
	before := runtime.NumGoroutine()
	s, err := q.AcquireStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const per = 100
	last := uint64(1000 + n)
	go func() {
		m := &quotadv1.AcquireStreamRequest{ClientId: clientID, Admissions: first}
		for rid := uint64(1001); rid <= last; rid++ {
			m.Admissions = append(m.Admissions, &quotadv1.Admission{RequestId: rid, Domain: "counted"})
			if len(m.Admissions) >= per || rid == last {
				if s.Send(m) != nil {
					return
				}
				m = &quotadv1.AcquireStreamRequest{}
			}
		}
	}()
	clustertest.Eventually(t, 20*time.Second, func() error {
		if grew := runtime.NumGoroutine() - before; grew < 1000 {
			return fmt.Errorf("goroutines grew by %d: the leader's sender is not blocked yet", grew)
		}
		return nil
	})
	return s, last
}

// readToEnd reads s until it ends and returns the request IDs answered and its status error.
func readToEnd(t *testing.T, s quotadv1.Quota_AcquireStreamClient) (map[uint64]*quotadv1.StreamDecision, error) {
	t.Helper()
	got := map[uint64]*quotadv1.StreamDecision{}
	for {
		m, err := recvWithin(t, s, 10*time.Second)
		if err != nil {
			return got, err
		}
		for _, d := range m.Decisions {
			got[d.RequestId] = d
		}
	}
}

// consumedCounted is how many units of "counted" the cluster has debited.
func consumedCounted(t *testing.T, ctx context.Context, q quotadv1.QuotaClient) int64 {
	t.Helper()
	st, err := q.Status(ctx, &quotadv1.StatusRequest{Domain: "counted"})
	if err != nil {
		t.Fatal(err)
	}
	return 100000 - int64(st.Buckets[0].Remaining)
}

// TestStreamUnreadAnswersEndTheStream: a client that sends admissions and stops reading pins
// the leader's sender in a write. After --stream-send-timeout the leader ends the stream
// (DEADLINE_EXCEEDED, naming the flag), cancels its undecided admissions (the waiter leaves the
// queue, never granted) and frees everything the stream held. Answers decided but never
// delivered are not lost or spent twice: retried unary with the same request IDs, every
// admission is admitted and the cluster debited each exactly once.
//
// Without the send timeout the stream stays open for as long as the TCP connection lives.
func TestStreamUnreadAnswersEndTheStream(t *testing.T) {
	c, p, _ := streamCluster(t, func(_ int, cfg *rpc.AgentConfig) { cfg.StreamSendTimeout = 2 * time.Second })
	p.client(auth.Identity{Name: "u", Role: auth.RoleWorker, Domains: []string{"held", "counted"}})
	leader := c.Leader()
	conn := p.dialAs(c.Addrs()[leader], "u", unreadWindow...)
	q := quotadv1.NewQuotaClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if d, err := acquireOne(ctx, q, "drain", &quotadv1.Admission{RequestId: 1, Domain: "held"}); err != nil || !d.Admitted {
		t.Fatalf("draining held: %v %v", d, err)
	}
	if s := conn.GetState(); s != connectivity.Ready {
		t.Fatalf("connection %v after a call, want READY", s)
	}
	baseline := runtime.NumGoroutine()
	const n = 5000
	s, last := floodUnread(t, ctx, q, "stall", n, waiting(1, "held", 2*time.Minute))
	if w := c.Agent(leader).FairView().Waiting; w != 1 {
		t.Fatalf("%d waiting on the leader, want the stream's waiter on held", w)
	}
	start := time.Now()
	clustertest.Eventually(t, 15*time.Second, func() error {
		if n := c.Agent(leader).AcquireStreams(); n != 0 {
			return fmt.Errorf("%d streams still open on the leader %v after the client stopped reading", n, time.Since(start).Round(time.Second))
		}
		if w := c.Agent(leader).FairView().Waiting; w != 0 {
			return fmt.Errorf("%d admissions of the ended stream still waiting", w)
		}
		if grew := runtime.NumGoroutine() - baseline; grew > 300 {
			return fmt.Errorf("%d goroutines more than before the stream", grew)
		}
		return nil
	})
	t.Logf("the stream ended %v after it was blocked", time.Since(start).Round(100*time.Millisecond))
	// Its connection is closed too: grpc-go keeps a stream's unwritten answers until they
	// are read or the connection closes (~3 MB for this one).
	stateCtx, stateCancel := context.WithTimeout(ctx, 10*time.Second)
	defer stateCancel()
	if !conn.WaitForStateChange(stateCtx, connectivity.Ready) {
		t.Fatalf("the connection of the stream that did not read is still %v", conn.GetState())
	}
	answered, err := readToEnd(t, s)
	if status.Code(err) != codes.Unavailable {
		wantCode(t, err, codes.DeadlineExceeded, "--stream-send-timeout") // the status, if it got out before the close
	}
	if _, ok := answered[1]; ok {
		t.Fatalf("the canceled waiter was answered: %v", answered[1])
	}
	t.Logf("%d answers were written before the stream ended", len(answered))

	// Retry every admission unary with its request ID: the decided ones get their decision
	// back from the dedup table, the others are decided now; each is debited once.
	var retry []*quotadv1.Admission
	for rid := uint64(1001); rid <= last; rid++ {
		retry = append(retry, &quotadv1.Admission{RequestId: rid, Domain: "counted"})
	}
	resp, err := q.Acquire(ctx, &quotadv1.AcquireRequest{ClientId: "stall", Admissions: retry})
	if err != nil {
		t.Fatal(err)
	}
	for i, d := range resp.Decisions {
		if !d.Admitted {
			t.Fatalf("retried request %d: %v", retry[i].RequestId, d)
		}
	}
	if got := consumedCounted(t, ctx, q); got != n {
		t.Fatalf("the cluster debited %d units for %d admissions (some decided on the ended stream, then retried)", got, n)
	}
	if c.Agent(leader).FSM().Remembers("cert:u", "stall", 1) {
		t.Fatal("the ended stream's waiter was decided")
	}
}

// TestStreamUnreadStillRechecked: a stream whose client stopped reading, with nothing
// undecided (every admission decided, the answers stuck behind the client's window), is still
// re-checked each second: a revoked token or a leader that hands leadership over ends it long
// before --stream-send-timeout (left at its 30 s default).
func TestStreamUnreadStillRechecked(t *testing.T) {
	for _, how := range []string{"revoke", "transfer"} {
		t.Run(how, func(t *testing.T) {
			// A per-stream cap above the flood: the serve loop never blocks answering a refusal
			// (which re-checks on its own), so only its ticks can end the stream.
			c, p, bootstrap := streamCluster(t, func(_ int, cfg *rpc.AgentConfig) { cfg.Waiters.PerStream = 10000 })
			leader := c.Leader()
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			conn := p.dialAs(c.Addrs()[leader], "", unreadWindow...)
			as := func(tok string) context.Context {
				return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
			}
			tok, err := quotadv1.NewAdminClient(conn).CreateToken(as(bootstrap), &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"counted"}})
			if err != nil {
				t.Fatal(err)
			}
			q := quotadv1.NewQuotaClient(conn)
			s, _ := floodUnread(t, as(tok.Token), q, "recheck", 5000)
			time.Sleep(1500 * time.Millisecond) // every admission decided: nothing undecided left
			start := time.Now()
			switch how {
			case "revoke":
				if _, err := quotadv1.NewAdminClient(conn).RevokeToken(as(bootstrap), &quotadv1.RevokeTokenRequest{Accessor: tok.Accessor}); err != nil {
					t.Fatal(err)
				}
			case "transfer":
				// Under -race on a loaded machine the leader can lose leadership on its own
				// during the flood; the stream must end the same way, so go on.
				if err := c.Agent(leader).Node().TransferLeadership(""); errors.Is(err, cluster.ErrNotLeader) {
					t.Logf("node%d lost leadership before the transfer: %v", leader, err)
				} else if err != nil {
					t.Fatal(err)
				}
			}
			clustertest.Eventually(t, 10*time.Second, func() error {
				if n := c.Agent(leader).AcquireStreams(); n != 0 {
					return fmt.Errorf("%d streams still open on node%d %v after the %s", n, leader, time.Since(start).Round(time.Second), how)
				}
				return nil
			})
			t.Logf("ended %v after the %s", time.Since(start).Round(100*time.Millisecond), how)
			_, err = readToEnd(t, s)
			want := map[string]codes.Code{"revoke": codes.Unauthenticated, "transfer": codes.FailedPrecondition}[how]
			if how == "transfer" && status.Code(err) == codes.Unavailable {
				// The re-check ran while the new leader was still being elected (seen under
				// -race): "no leader, retry" is the answer then; FailedPrecondition names the
				// new leader once it is known. Both end the stream for the client to go on.
				want = codes.Unavailable
			}
			wantCode(t, err, want)
		})
	}
}

// TestStreamRequestIDSentAgain: a client cancels X and sends X again — in the same message
// (cancels apply first) or in the next — while the first X's goroutine may still be finishing.
// The first X must neither answer in the second's name nor take the second's entry away (which
// made the second uncancelable: it stayed queued for its whole max wait, granted to nobody who
// listens).
func TestStreamRequestIDSentAgain(t *testing.T) {
	c, p, _ := streamCluster(t)
	p.client(auth.Identity{Name: "u", Role: auth.RoleWorker, Domains: []string{"held", "counted"}})
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[leader], "u"))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if d, err := acquireOne(ctx, q, "drain", &quotadv1.Admission{RequestId: 1, Domain: "held"}); err != nil || !d.Admitted {
		t.Fatalf("draining held: %v %v", d, err)
	}
	s, err := q.AcquireStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	send := func(m *quotadv1.AcquireStreamRequest) {
		t.Helper()
		if err := s.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	answers := make(chan *quotadv1.StreamDecision, 1000)
	ended := make(chan error, 1)
	go func() {
		for {
			m, err := s.Recv()
			if err != nil {
				ended <- err
				return
			}
			for _, d := range m.Decisions {
				answers <- d
			}
		}
	}()
	send(&quotadv1.AcquireStreamRequest{ClientId: "again"})
	const rounds = 40
	for i := range rounds {
		x := uint64(100 + i)
		send(&quotadv1.AcquireStreamRequest{Admissions: []*quotadv1.Admission{waiting(x, "held", 2*time.Minute)}})
		if i%2 == 0 {
			send(&quotadv1.AcquireStreamRequest{Cancels: []uint64{x}, Admissions: []*quotadv1.Admission{waiting(x, "held", 2*time.Minute)}})
		} else {
			send(&quotadv1.AcquireStreamRequest{Cancels: []uint64{x}})
			send(&quotadv1.AcquireStreamRequest{Admissions: []*quotadv1.Admission{waiting(x, "held", 2*time.Minute)}})
		}
	}
	clustertest.Eventually(t, 10*time.Second, func() error {
		if w := c.Agent(leader).FairView().Waiting; w != rounds {
			return fmt.Errorf("%d waiting, want the %d admissions sent again", w, rounds)
		}
		return nil
	})
	// Every second X is still undecided on the stream: its cancel takes it out of the queue.
	var cancels []uint64
	for i := range rounds {
		cancels = append(cancels, uint64(100+i))
	}
	send(&quotadv1.AcquireStreamRequest{Cancels: cancels})
	clustertest.Eventually(t, 10*time.Second, func() error {
		if w := c.Agent(leader).FairView().Waiting; w != 0 {
			return fmt.Errorf("%d admissions still waiting after every request ID was canceled: their stream entries were lost", w)
		}
		return nil
	})
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-ended:
		if !errors.Is(err, io.EOF) {
			t.Fatalf("stream ended with %v, want its end after the half-close", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the stream did not end after the half-close")
	}
	close(answers)
	for d := range answers {
		t.Errorf("request %d answered (code %v %q, decision %v): every admission on the stream was canceled, none may be answered", d.RequestId, codes.Code(d.Code), d.Message, d.Decision)
	}
}

// TestStreamsPerIdentityCapped: one identity may hold --max-streams-per-identity streams on
// the leader; one more is refused RESOURCE_EXHAUSTED naming the limit and the flag, another
// identity is not affected, and a stream that ends frees its slot. With --insecure (every
// caller the same identity) streams are counted per client_id.
func TestStreamsPerIdentityCapped(t *testing.T) {
	open := func(t *testing.T, q quotadv1.QuotaClient, ctx context.Context, clientID string) (quotadv1.Quota_AcquireStreamClient, error) {
		t.Helper()
		s, err := q.AcquireStream(ctx)
		if err != nil {
			return nil, err
		}
		if err := s.Send(&quotadv1.AcquireStreamRequest{ClientId: clientID, Admissions: []*quotadv1.Admission{waiting(uint64(time.Now().UnixNano()), "free", time.Second)}}); err != nil && !errors.Is(err, io.EOF) {
			return nil, err
		}
		if _, err := recvWithin(t, s, 10*time.Second); err != nil {
			return nil, err
		}
		return s, nil
	}
	closeStream := func(t *testing.T, s quotadv1.Quota_AcquireStreamClient) {
		t.Helper()
		_ = s.CloseSend()
		if _, err := recvWithin(t, s, 10*time.Second); !errors.Is(err, io.EOF) {
			t.Fatalf("closing: %v", err)
		}
	}
	t.Run("identity", func(t *testing.T) {
		c, p, _ := streamCluster(t, func(_ int, cfg *rpc.AgentConfig) { cfg.MaxStreamsPerIdentity = 2 })
		p.client(auth.Identity{Name: "u", Role: auth.RoleWorker, Domains: []string{"free"}})
		addr := c.Addrs()[c.Leader()]
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		w, u := quotadv1.NewQuotaClient(p.dialAs(addr, "w")), quotadv1.NewQuotaClient(p.dialAs(addr, "u"))
		s1, err := open(t, w, ctx, "a")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := open(t, w, ctx, "b"); err != nil {
			t.Fatal(err)
		}
		_, err = open(t, w, ctx, "c")
		wantCode(t, err, codes.ResourceExhausted, `identity "cert:w"`, "2 AcquireStreams", "--max-streams-per-identity 2")
		if _, err := open(t, u, ctx, "a"); err != nil {
			t.Fatalf("another identity: %v", err)
		}
		closeStream(t, s1)
		if _, err := open(t, w, ctx, "c"); err != nil {
			t.Fatalf("after one of its streams ended: %v", err)
		}
	})
	t.Run("insecure", func(t *testing.T) {
		c := rpctest.Start(t, 3, streamLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.MaxStreamsPerIdentity = 1 })
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := grpc.NewClient(c.Addrs()[c.Leader()], grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		q := quotadv1.NewQuotaClient(conn)
		if _, err := open(t, q, ctx, "a"); err != nil {
			t.Fatal(err)
		}
		_, err = open(t, q, ctx, "a")
		wantCode(t, err, codes.ResourceExhausted, `client_id "a"`, "--max-streams-per-identity 1")
		if got := scrape(t, c.Agent(c.Leader()).HTTPAddr(), "quotad_acquire_streams_capped_total")["quotad_acquire_streams_capped_total"]; got != 1 {
			t.Fatalf("quotad_acquire_streams_capped_total %v after one refusal, want 1", got)
		}
		if _, err := open(t, q, ctx, "b"); err != nil {
			t.Fatalf("another client_id: %v", err)
		}
	})
}
