package client

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// refusingNode is a real gRPC Quota server whose Acquire refuses with ResourceExhausted, as
// an overloaded leader does and as a follower does when it forwards the leader's refusal;
// a non-empty leader is set as the x-quotad-leader header first, as the follower's route
// does.
type refusingNode struct {
	quotadv1.UnimplementedQuotaServer
	leader string
}

func (n *refusingNode) Acquire(ctx context.Context, _ *quotadv1.AcquireRequest) (*quotadv1.AcquireResponse, error) {
	if n.leader != "" {
		_ = grpc.SetHeader(ctx, metadata.Pairs(leaderHeader, n.leader))
	}
	return nil, status.Error(codes.ResourceExhausted, "overloaded: the leader is not keeping up")
}

func serveRefusing(t *testing.T, ln net.Listener, leader string) {
	t.Helper()
	g := grpc.NewServer()
	quotadv1.RegisterQuotaServer(g, &refusingNode{leader: leader})
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(g.Stop)
}

// TestOverloadedLeaderHintFollowed: a leader that answers ResourceExhausted is alive. A
// follower's refusal naming it is followed, as before hints from failed forwards were
// filtered (the filter is for a leader that gave no answer: TestDeadLeaderHintNotFollowed).
// Counting the overloaded leader as dead sent every retry for a second round the followers,
// each forwarding to that same leader.
func TestOverloadedLeaderHintFollowed(t *testing.T) {
	lns := make([]net.Listener, 3)
	addrs := make([]string, 3)
	for i := range lns {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns[i], addrs[i] = ln, ln.Addr().String()
	}
	leader := addrs[0]
	serveRefusing(t, lns[0], "") // refused at its headers: no leader header
	serveRefusing(t, lns[1], leader)
	serveRefusing(t, lns[2], leader)
	var (
		mu       sync.Mutex
		attempts []string
	)
	record := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		mu.Lock()
		attempts = append(attempts, cc.Target())
		mu.Unlock()
		return err
	}
	c := newTestClient(t, addrs, func(cfg *Config) {
		cfg.Backoff = BackoffConfig{Initial: time.Millisecond, Max: 5 * time.Millisecond, Factor: 2}
		cfg.DialOptions = []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithUnaryInterceptor(record)}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := c.Allow(ctx, Request{Domain: "fixed"}); err == nil {
		t.Fatal("Allow succeeded against nodes that refuse everything")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(attempts) < 6 {
		t.Fatalf("only %d attempts in 300 ms: %v", len(attempts), attempts)
	}
	for i := 0; i+1 < len(attempts); i++ {
		if attempts[i] != leader && attempts[i+1] != leader {
			t.Fatalf("attempt %d at follower %s, which named the leader %s, was followed by one at %s, not at the leader (first attempts %v)",
				i, attempts[i], leader, attempts[i+1], attempts[:min(len(attempts), 12)])
		}
	}
}

// TestStaleHintOnlyWhileSilent: a leader hint is stale only while the named node's last
// attempt got no answer from it: an answer since (a success, a refusal that names a leader,
// ResourceExhausted) makes hints naming it count again.
func TestStaleHintOnlyWhileSilent(t *testing.T) {
	ns := newNodes([]string{"a:1", "b:1", "c:1"}, Config{}, nil)
	ns.failed("a:1", true)
	if !ns.staleHint("a:1") {
		t.Fatal("a node that just gave no answer is not a stale hint")
	}
	ns.answered("a:1")
	if ns.staleHint("a:1") {
		t.Error("a node that answered since is still a stale hint")
	}
	ns.failed("a:1", true)
	ns.failed("a:1", false)
	if ns.staleHint("a:1") {
		t.Error("a node whose last failure was an answer (ResourceExhausted, say) is a stale hint")
	}
	if n := ns.nsilent.Load(); n != 0 {
		t.Errorf("nsilent = %d with no silent node", n)
	}
}
