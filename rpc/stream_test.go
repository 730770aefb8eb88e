package rpc_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// streamLimits: "slow" refills a unit every 2 s (burst 1), so a waiter on it waits; "free" can
// always pay; "held" refills a unit a minute (a waiter on it stays undecided for a test) and
// "counted" pays 100,000 and refills nothing in a test (100,000 − remaining counts debits).
const streamLimits = `
domain: slow
rate_limit: {unit: minute, requests_per_unit: 30, burst: 1}
---
domain: free
rate_limit: {unit: second, requests_per_unit: 100000, burst: 100000}
---
domain: other
rate_limit: {unit: second, requests_per_unit: 100000, burst: 100000}
---
domain: held
rate_limit: {unit: minute, requests_per_unit: 1, burst: 1}
---
domain: counted
rate_limit: {unit: hour, requests_per_unit: 1, burst: 100000}
`

// streamCluster is a TLS cluster (no --insecure) with streamLimits, a worker certificate "w"
// for domains slow and free, and the bootstrap admin token.
func streamCluster(t *testing.T, opts ...rpctest.Option) (*rpctest.Cluster, *pki, string) {
	t.Helper()
	bootstrap, _, err := auth.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "bootstrap")
	if err := os.WriteFile(file, []byte(bootstrap+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	opts = append([]rpctest.Option{func(_ int, cfg *rpc.AgentConfig) { cfg.BootstrapTokenFile = file }}, opts...)
	c, p := authCluster(t, streamLimits, opts...)
	p.client(auth.Identity{Name: "w", Role: auth.RoleWorker, Domains: []string{"slow", "free"}})
	return c, p, bootstrap
}

func waiting(id uint64, domain string, maxWait time.Duration) *quotadv1.Admission {
	return &quotadv1.Admission{RequestId: id, Domain: domain, MaxWaitMs: maxWait.Milliseconds()}
}

// drainSlow takes the slow bucket's unit (unary, not waiting), so the next waiter waits ~2 s.
func drainSlow(t *testing.T, q quotadv1.QuotaClient, ctx context.Context) {
	t.Helper()
	clustertest.Eventually(t, 10*time.Second, func() error {
		d, err := acquireOne(ctx, q, "drain", &quotadv1.Admission{RequestId: uint64(time.Now().UnixNano()), Domain: "slow"})
		if err != nil {
			return err
		}
		if !d.Admitted {
			return fmt.Errorf("slow not drained yet: %v", d.Reason)
		}
		return nil
	})
}

// recvWithin receives one response, or fails the test after d.
func recvWithin(t *testing.T, s quotadv1.Quota_AcquireStreamClient, d time.Duration) (*quotadv1.AcquireStreamResponse, error) {
	t.Helper()
	type r struct {
		m   *quotadv1.AcquireStreamResponse
		err error
	}
	ch := make(chan r, 1)
	go func() {
		m, err := s.Recv()
		ch <- r{m, err}
	}()
	select {
	case x := <-ch:
		return x.m, x.err
	case <-time.After(d):
		t.Fatalf("no answer on the stream within %v", d)
		return nil, nil
	}
}

// TestStreamAnswersEachAdmissionWhenDecided: in one message, an admission on a free bucket is
// answered while another on an exhausted bucket still waits on the leader (no head-of-line
// blocking); canceling the waiter takes it out of the leader's queue, it is never granted and
// gets no answer, and after a half-close the stream ends once everything is answered.
func TestStreamAnswersEachAdmissionWhenDecided(t *testing.T) {
	c, p, _ := streamCluster(t)
	leader := c.Leader()
	conn := p.dialAs(c.Addrs()[leader], "w")
	q := quotadv1.NewQuotaClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	drainSlow(t, q, ctx)

	s, err := q.AcquireStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&quotadv1.AcquireStreamRequest{ClientId: "sc", Admissions: []*quotadv1.Admission{
		waiting(1, "slow", 20*time.Second), waiting(2, "free", 20*time.Second)}}); err != nil {
		t.Fatal(err)
	}
	m, err := recvWithin(t, s, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Decisions) != 1 || m.Decisions[0].RequestId != 2 || !m.Decisions[0].GetDecision().GetAdmitted() {
		t.Fatalf("first answer: %v; want only request 2, admitted", m.Decisions)
	}
	if v := c.Agent(leader).FairView(); v.Waiting != 1 {
		t.Fatalf("request 2 answered while request 1 waits: the leader has %d waiting, want 1", v.Waiting)
	}
	if hdr, _ := s.Header(); len(hdr.Get(rpc.LeaderHeader)) == 0 {
		t.Fatalf("the stream's header names no leader: %v", hdr)
	}

	// Cancel request 1: out of the queue at once, and the unit that refills is not its.
	if err := s.Send(&quotadv1.AcquireStreamRequest{Cancels: []uint64{1}}); err != nil {
		t.Fatal(err)
	}
	clustertest.Eventually(t, 5*time.Second, func() error {
		if n := c.Agent(leader).FairView().Waiting; n != 0 {
			return fmt.Errorf("%d still waiting after the cancel", n)
		}
		return nil
	})
	clustertest.Eventually(t, 10*time.Second, func() error {
		st, err := q.Status(ctx, &quotadv1.StatusRequest{Domain: "slow"})
		if err != nil {
			return err
		}
		if st.Buckets[0].Remaining < 1 {
			return fmt.Errorf("slow not refilled yet")
		}
		return nil
	})
	if c.Agent(leader).FSM().Remembers("cert:w", "sc", 1) {
		t.Fatal("the canceled request 1 was decided by the FSM")
	}
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if m, err := recvWithin(t, s, 5*time.Second); !errors.Is(err, io.EOF) {
		t.Fatalf("after the half-close: %v %v, want the end of the stream (a canceled admission gets no answer)", m, err)
	}
}

// TestStreamChecksAndCaps: each admission gets Acquire's checks on its own (a domain the
// caller may not use is PERMISSION_DENIED for that admission only, a malformed one invalid),
// one beyond the per-stream cap is denied too_many_waiters (scope stream), and a bad message
// ends the stream with INVALID_ARGUMENT.
func TestStreamChecksAndCaps(t *testing.T) {
	c, p, _ := streamCluster(t, func(_ int, cfg *rpc.AgentConfig) { cfg.Waiters.PerStream = 2 })
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[leader], "w"))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	drainSlow(t, q, ctx)

	s, err := q.AcquireStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&quotadv1.AcquireStreamRequest{ClientId: "cc", Admissions: []*quotadv1.Admission{
		waiting(1, "other", time.Second), // not the worker's domain
		{RequestId: 2, Domain: "free", MaxWaitMs: -1},
		waiting(3, "slow", 20*time.Second),
		waiting(4, "slow", 20*time.Second),
		waiting(5, "slow", 20*time.Second), // third undecided: over the cap of 2
	}}); err != nil {
		t.Fatal(err)
	}
	// 1 and 2 may still count as undecided when 3-5 arrive: at least one of 3-5 (certainly 5)
	// is over the cap, and says so.
	got := map[uint64]*quotadv1.StreamDecision{}
	var refused *quotadv1.StreamDecision
	for got[1] == nil || got[2] == nil || refused == nil {
		m, err := recvWithin(t, s, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range m.Decisions {
			got[d.RequestId] = d
			if d.RequestId >= 3 {
				refused = d
			}
		}
	}
	if d := got[1]; codes.Code(d.Code) != codes.PermissionDenied {
		t.Fatalf("admission on a domain the worker may not use: %v, want PERMISSION_DENIED", d)
	}
	if d := got[2]; d.GetDecision().GetReason() != "invalid" {
		t.Fatalf("admission with a negative max wait: %v, want invalid", d)
	}
	if refused.GetDecision().GetReason() != "too_many_waiters" || refused.GetDecision().GetScope() != rpc.ScopeStreamWaiters {
		t.Fatalf("admission over the per-stream cap: %v, want too_many_waiters scope stream", refused)
	}
	// Another client_id on the same stream ends it.
	if err := s.Send(&quotadv1.AcquireStreamRequest{ClientId: "other", Admissions: []*quotadv1.Admission{waiting(9, "free", time.Second)}}); err != nil {
		t.Fatal(err)
	}
	for {
		_, err := recvWithin(t, s, 10*time.Second)
		if err != nil {
			wantCode(t, err, codes.InvalidArgument, "client_id")
			break
		}
	}
	clustertest.Eventually(t, 5*time.Second, func() error {
		if n := c.Agent(leader).FairView().Waiting; n != 0 {
			return fmt.Errorf("%d still waiting after the stream ended", n)
		}
		return nil
	})
}

// TestStreamFollowerRefuses: a follower does not serve the stream; it names the leader, so the
// client can open it there.
func TestStreamFollowerRefuses(t *testing.T) {
	c, p, _ := streamCluster(t)
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[(leader+1)%3], "w"))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var hdr metadata.MD
	s, err := q.AcquireStream(ctx, grpc.Header(&hdr))
	if err != nil {
		t.Fatal(err)
	}
	_ = s.Send(&quotadv1.AcquireStreamRequest{ClientId: "f", Admissions: []*quotadv1.Admission{waiting(1, "free", time.Second)}})
	_, err = recvWithin(t, s, 5*time.Second)
	wantCode(t, err, codes.FailedPrecondition, "leader only")
	if got := hdr.Get(rpc.LeaderHeader); len(got) != 1 || got[0] != c.Addrs()[leader] {
		t.Fatalf("leader header %v, want %s", got, c.Addrs()[leader])
	}
}

// TestStreamRevokedTokenStopsServing: a token revoked while its stream is open ends the
// stream (UNAUTHENTICATED) without the client sending anything, its waiter leaves the queue
// and is never granted, and the token cannot open another.
func TestStreamRevokedTokenStopsServing(t *testing.T) {
	c, p, bootstrap := streamCluster(t)
	leader := c.Leader()
	conn := p.dialAs(c.Addrs()[leader], "")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	as := func(tok string) context.Context {
		return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	tok, err := quotadv1.NewAdminClient(conn).CreateToken(as(bootstrap), &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"slow", "free"}})
	if err != nil {
		t.Fatal(err)
	}
	q := quotadv1.NewQuotaClient(conn)
	drainSlow(t, q, as(tok.Token))

	s, err := q.AcquireStream(as(tok.Token))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&quotadv1.AcquireStreamRequest{ClientId: "tc", Admissions: []*quotadv1.Admission{waiting(1, "free", time.Second)}}); err != nil {
		t.Fatal(err)
	}
	if m, err := recvWithin(t, s, 10*time.Second); err != nil || !m.Decisions[0].GetDecision().GetAdmitted() {
		t.Fatalf("before the revoke: %v %v", m, err)
	}
	if err := s.Send(&quotadv1.AcquireStreamRequest{Admissions: []*quotadv1.Admission{waiting(2, "slow", 20*time.Second)}}); err != nil {
		t.Fatal(err)
	}
	clustertest.Eventually(t, 5*time.Second, func() error {
		if n := c.Agent(leader).FairView().Waiting; n != 1 {
			return fmt.Errorf("%d waiting, want 1", n)
		}
		return nil
	})
	if _, err := quotadv1.NewAdminClient(conn).RevokeToken(as(bootstrap), &quotadv1.RevokeTokenRequest{Accessor: tok.Accessor}); err != nil {
		t.Fatal(err)
	}
	// Either the revoke ends the token's waiting admissions (their answer: UNAUTHENTICATED,
	// TestRevokeEndsWaitingAdmissions) and the stream refuses the next message, or the
	// stream's own re-check ends it first.
	m, err := recvWithin(t, s, 10*time.Second)
	if err == nil {
		if len(m.Decisions) != 1 || m.Decisions[0].RequestId != 2 || codes.Code(m.Decisions[0].Code) != codes.Unauthenticated {
			t.Fatalf("after the revoke: %v, want request 2 answered UNAUTHENTICATED or the stream ended", m)
		}
		if err = s.Send(&quotadv1.AcquireStreamRequest{Admissions: []*quotadv1.Admission{waiting(4, "free", time.Second)}}); err == nil {
			_, err = recvWithin(t, s, 10*time.Second)
		} else if errors.Is(err, io.EOF) {
			_, err = s.Recv() // the stream has ended: its status
		}
	}
	wantCode(t, err, codes.Unauthenticated, "not known")
	clustertest.Eventually(t, 5*time.Second, func() error {
		if n := c.Agent(leader).FairView().Waiting; n != 0 {
			return fmt.Errorf("%d still waiting after the revoke", n)
		}
		return nil
	})
	owner := "token:" + tok.Accessor
	clustertest.Eventually(t, 10*time.Second, func() error {
		st, err := q.Status(as(bootstrap), &quotadv1.StatusRequest{Domain: "slow"})
		if err != nil {
			return err
		}
		if st.Buckets[0].Remaining < 1 {
			return fmt.Errorf("slow not refilled yet")
		}
		return nil
	})
	if c.Agent(leader).FSM().Remembers(owner, "tc", 2) {
		t.Fatal("the revoked token's waiter was decided after the revoke")
	}
	s2, err := q.AcquireStream(as(tok.Token))
	if err == nil {
		_ = s2.Send(&quotadv1.AcquireStreamRequest{ClientId: "tc", Admissions: []*quotadv1.Admission{waiting(3, "free", time.Second)}})
		_, err = recvWithin(t, s2, 5*time.Second)
	}
	wantCode(t, err, codes.Unauthenticated)
}

// TestStreamUnreadAnswersAreCapped: a client that sends admissions but never reads its answers
// holds at most --max-stream-admissions of them on the leader. An admission counts against the
// per-stream cap until its answer is queued for sending, not only until it is decided: once the
// client's flow-control window is full, every decided admission's goroutine waits to queue its
// answer, and without counting those, a client sending small messages that never read held one
// goroutine (and one decision) per admission, without bound.
func TestStreamUnreadAnswersAreCapped(t *testing.T) {
	c, p, _ := streamCluster(t)
	leader := c.Leader()
	// A fixed 64 KiB window (no BDP growth): the leader's sends block after ~64 KiB of answers.
	conn := p.dialAs(c.Addrs()[leader], "w", grpc.WithInitialWindowSize(1<<16), grpc.WithInitialConnWindowSize(1<<16))
	q := quotadv1.NewQuotaClient(conn)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := acquireOne(ctx, q, "warm", &quotadv1.Admission{RequestId: 1, Domain: "free"}); err != nil {
		t.Fatal(err)
	}
	s, err := q.AcquireStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	before := runtime.NumGoroutine()
	const msgs, per = 200, 100 // each message far below the cap: no admission is refused by it
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		rid := uint64(0)
		for i := 0; i < msgs; i++ {
			m := &quotadv1.AcquireStreamRequest{ClientId: "unread"}
			for j := 0; j < per; j++ {
				rid++
				m.Admissions = append(m.Admissions, &quotadv1.Admission{RequestId: rid, Domain: "free"})
			}
			if s.Send(m) != nil {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	// The sender stops when done or blocked by the leader no longer reading; give it time.
	select {
	case <-sent:
	case <-time.After(15 * time.Second):
	}
	time.Sleep(2 * time.Second)
	grew := runtime.NumGoroutine() - before
	t.Logf("goroutines grew by %d after %d admissions sent, none read", grew, msgs*per)
	if limit := 2 * rpc.DefaultMaxStreamAdmissions; grew > limit {
		t.Fatalf("a stream whose client never reads holds %d goroutines on the leader, want at most ~%d (--max-stream-admissions)", grew, limit)
	}
}
