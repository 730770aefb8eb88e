package main

import (
	"context"
	"os"
	"path/filepath"
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

// TestEmptyTenantFlagRefused: `--tenant ""` (a script's `--tenant "$TENANT"` with TENANT unset)
// is refused, naming the flag, and creates nothing — an empty tenant means "every tenant", so
// it made a worker token (or certificate) of every tenant (trial).
func TestEmptyTenantFlagRefused(t *testing.T) {
	c := rpctest.Start(t, 1, "domain: provider\nrate_limit: {unit: second, requests_per_unit: 10}\n")
	for _, tenant := range []string{"", " "} {
		cmd := tokenCmd()
		cmd.SetArgs([]string{"create", "--role", "worker", "--domain", "provider", "--tenant", tenant, "--addr", c.Addrs()[0]})
		cmd.SilenceUsage, cmd.SilenceErrors = true, true
		err := cmd.Execute()
		if err == nil || !strings.Contains(err.Error(), "--tenant") || !strings.Contains(err.Error(), "no token was created") {
			t.Fatalf("token create --tenant %q: %v, want a refusal naming --tenant", tenant, err)
		}
	}
	cc, err := grpc.NewClient(c.Addrs()[0], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	list, err := quotadv1.NewAdminClient(cc).ListTokens(context.Background(), &quotadv1.ListTokensRequest{})
	if err != nil || len(list.Tokens) != 0 {
		t.Fatalf("tokens after refused creates: %v %v, want none", list, err)
	}

	dir := t.TempDir()
	run := func(args ...string) error {
		cmd := tlsCmd()
		cmd.SetArgs(args)
		cmd.SilenceUsage, cmd.SilenceErrors = true, true
		return cmd.Execute()
	}
	if err := run("ca", "create", "--dir", dir); err != nil {
		t.Fatal(err)
	}
	err = run("cert", "create", "--client", "--name", "w", "--role", "worker", "--domain", "provider", "--tenant", "", "--dir", dir)
	if err == nil || !strings.Contains(err.Error(), "--tenant") {
		t.Fatalf("tls cert create --tenant \"\": %v, want a refusal naming --tenant", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "w.pem")); !os.IsNotExist(err) {
		t.Fatalf("a certificate was written for a refused --tenant: %v", err)
	}
}

// TestTokenRevokeAnswerLostThenRetried: a revoke whose committed answer was lost is retried
// (call retries Unavailable) and the retry found the token "already revoked, or no token ever
// had that accessor" — exit 1 for a revoke that worked, in the middle of an incident (trial).
// It now says the lost try revoked it (exit 0); an accessor never listed still fails.
func TestTokenRevokeAnswerLostThenRetried(t *testing.T) {
	var revokes atomic.Int32
	var loseAny atomic.Bool
	lose := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		resp, err := handler(ctx, req)
		if strings.HasSuffix(info.FullMethod, "/RevokeToken") && revokes.Add(1) == 1 && (err == nil || loseAny.Load()) {
			return nil, status.Error(codes.Unavailable, "the answer was lost (test)")
		}
		return resp, err
	}
	c := rpctest.Start(t, 1, "domain: provider\nrate_limit: {unit: second, requests_per_unit: 10}\n", func(_ int, cfg *rpc.AgentConfig) {
		cfg.UnaryInterceptors = append(cfg.UnaryInterceptors, lose)
	})
	cc, err := grpc.NewClient(c.Addrs()[0], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	tok, err := quotadv1.NewAdminClient(cc).CreateToken(context.Background(), &quotadv1.CreateTokenRequest{Role: "reader"})
	if err != nil {
		t.Fatal(err)
	}
	revoke := func(accessor string) error {
		cmd := tokenCmd()
		cmd.SetArgs([]string{"revoke", accessor, "--addr", c.Addrs()[0]})
		cmd.SilenceUsage, cmd.SilenceErrors = true, true
		return cmd.Execute()
	}
	if err := revoke(tok.Accessor); err != nil {
		t.Fatalf("revoke whose first answer was lost after it revoked the token: %v", err)
	}
	if n := revokes.Load(); n != 2 {
		t.Fatalf("%d RevokeToken calls, want the lost one and its retry", n)
	}
	list, err := quotadv1.NewAdminClient(cc).ListTokens(context.Background(), &quotadv1.ListTokensRequest{})
	if err != nil || len(list.Tokens) != 0 {
		t.Fatalf("tokens after the revoke: %v %v, want none", list, err)
	}
	revokes.Store(0)
	loseAny.Store(true)
	if err := revoke("nosuchaccessor"); err == nil || !strings.Contains(err.Error(), "no token ever had that accessor") {
		t.Fatalf("revoke of an accessor never listed, its first answer lost: %v, want it refused", err)
	}
}
