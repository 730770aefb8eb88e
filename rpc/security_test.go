package rpc_test

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

func TestAdminTokenGuardsChangesEvenWhenForwarded(t *testing.T) {
	tok, _, err := auth.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	c := rpctest.Start(t, 3, testLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.BootstrapToken = tok })
	follower := (c.Leader() + 1) % 3
	admin := quotadv1.NewAdminClient(dial(t, c.Addrs()[follower]))
	req := &quotadv1.ApplyLimitsRequest{Yaml: testLimits}
	_, err = admin.ApplyLimits(context.Background(), req)
	if status.Code(err) != codes.Unauthenticated {
		t.Fatalf("apply without token: %v, want Unauthenticated", err)
	}
	bad := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer nope")
	if _, err := admin.ApplyLimits(bad, req); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("apply with a wrong token: %v", err)
	}
	good := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+tok)
	resp, err := admin.ApplyLimits(good, req)
	if err != nil || resp.Version != 2 {
		t.Fatalf("apply with the token through a follower: %v %v", resp, err)
	}
	// Reads stay open.
	if _, err := admin.GetLimits(context.Background(), &quotadv1.GetLimitsRequest{}); err != nil {
		t.Fatalf("get limits: %v", err)
	}
}
