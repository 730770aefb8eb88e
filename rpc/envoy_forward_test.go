package rpc

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/quotad/quotad/auth"
)

// oldLeader serves ShouldRateLimit only, as a leader of a version without quotad.v1.Peer
// does; it answers with the forwarding metadata it received, as headers.
type oldLeader struct {
	rlsv3.UnimplementedRateLimitServiceServer
	mu    sync.Mutex
	calls int
}

func (o *oldLeader) ShouldRateLimit(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	o.mu.Lock()
	o.calls++
	o.mu.Unlock()
	md, _ := metadata.FromIncomingContext(ctx)
	resp := &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_OK}
	for _, k := range []string{forwardedHeader, auth.PrincipalHeader, authorizationHeader} {
		for _, v := range md.Get(k) {
			resp.ResponseHeadersToAdd = append(resp.ResponseHeadersToAdd, &corev3.HeaderValue{Key: k, Value: v})
		}
	}
	resp.ResponseHeadersToAdd = append(resp.ResponseHeadersToAdd, &corev3.HeaderValue{Key: "domain", Value: req.Domain})
	return resp, nil
}

func headersOf(r *rlsv3.RateLimitResponse) map[string]string {
	h := map[string]string{}
	for _, kv := range r.GetResponseHeadersToAdd() {
		h[kv.Key] = kv.Value
	}
	return h
}

// TestRLSForwardToOldLeader: during a rolling upgrade the leader may not serve
// ForwardRateLimit yet; a follower then forwards each call on its own, with its caller, as
// before (and keeps doing so for that leader) instead of failing Envoy's calls.
func TestRLSForwardToOldLeader(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	old := &oldLeader{}
	rlsv3.RegisterRateLimitServiceServer(g, old)
	go g.Serve(lis)
	defer g.Stop()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	r := &rlsServer{s: &Server{}}
	req := &rlsv3.RateLimitRequest{Domain: "d", Descriptors: []*rlcommon.RateLimitDescriptor{
		{Entries: []*rlcommon.RateLimitDescriptor_Entry{{Key: "k", Value: "v"}}}}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// A certificate caller: its identity goes as the principal.
	envoy := auth.Identity{Name: "envoy", Role: auth.RoleWorker, Domains: []string{"d"}}
	resp, err := r.forward(context.WithValue(ctx, callerKey{}, caller{id: envoy}), conn, req)
	if err != nil {
		t.Fatalf("forward to a leader without ForwardRateLimit: %v", err)
	}
	h := headersOf(resp)
	if h[forwardedHeader] != "1" || h[auth.PrincipalHeader] != auth.EncodePrincipal(envoy) || h["domain"] != "d" {
		t.Errorf("the old leader got %v; want the forwarded mark, the caller's principal and the request", h)
	}
	if !r.lane(conn).legacy() {
		t.Error("the lane did not remember that the leader lacks ForwardRateLimit")
	}
	// A token caller, now on the direct path: its authorization header goes along.
	tokCtx := context.WithValue(metadata.NewIncomingContext(ctx, metadata.Pairs(authorizationHeader, "Bearer qd_x_y")),
		callerKey{}, caller{id: envoy, viaToken: true})
	wantToken := func(resp *rlsv3.RateLimitResponse, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		if h := headersOf(resp); h[authorizationHeader] != "Bearer qd_x_y" || h[auth.PrincipalHeader] != "" || h[forwardedHeader] != "1" {
			t.Errorf("the old leader got %v; want the token, no principal, the forwarded mark", h)
		}
	}
	wantToken(r.forward(tokCtx, conn, req))
	// A token caller in the batch that finds the old leader.
	wantToken((&rlsServer{s: &Server{}}).forward(tokCtx, conn, req))
	if old.calls != 3 {
		t.Errorf("the old leader answered %d calls; want 3", old.calls)
	}
}
