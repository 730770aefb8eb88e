package main

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// TestTokenCreateNotRetriedOnLostAnswer: when the answer of a committed CreateToken is lost,
// `token create` does not send it again (each try makes a new token nobody would hold) and
// says to check `quotad token list` (user trial: the shared retry helper retried it on
// Unavailable/DeadlineExceeded).
func TestTokenCreateNotRetriedOnLostAnswer(t *testing.T) {
	var creates atomic.Int32
	lose := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		resp, err := handler(ctx, req)
		if err == nil && strings.HasSuffix(info.FullMethod, "/CreateToken") {
			creates.Add(1)
			return nil, status.Error(codes.Unavailable, "the answer was lost (test)")
		}
		return resp, err
	}
	c := rpctest.Start(t, 1, "domain: provider\nrate_limit: {unit: second, requests_per_unit: 10}\n", func(_ int, cfg *rpc.AgentConfig) {
		cfg.UnaryInterceptors = append(cfg.UnaryInterceptors, lose)
	})
	cmd := tokenCmd()
	cmd.SetArgs([]string{"create", "--role", "reader", "--addr", c.Addrs()[0]})
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	err := cmd.Execute()
	if err == nil || !strings.Contains(err.Error(), "quotad token list") {
		t.Fatalf("token create with its answer lost: %v, want an error saying to check quotad token list", err)
	}
	if n := creates.Load(); n != 1 {
		t.Fatalf("CreateToken committed %d times, want 1 (not retried)", n)
	}
	cc, err := grpc.NewClient(c.Addrs()[0], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	list, err := quotadv1.NewAdminClient(cc).ListTokens(context.Background(), &quotadv1.ListTokensRequest{})
	if err != nil || len(list.Tokens) != 1 {
		t.Fatalf("tokens after one lost create: %v %v, want exactly 1", list, err)
	}
}
