package main

import (
	"bytes"
	"context"
	"math"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/rpc/rpctest"
)

// Two domains lending with a long lease: the grant outlives the test.
const sharesAllLimits = `
domain: api
rate_limit: {unit: second, requests_per_unit: 100}
shares: {lease: 30s}
---
domain: billing
rate_limit: {unit: second, requests_per_unit: 10}
shares: {lease: 30s}
`

// TestSharesAllDomainsAndRevoked: `quotad shares` without --domain lists the holders of every
// domain (it required --domain: an operator had no single view of everything lent), through a
// follower; a holder whose token was revoked stays listed, marked "revoked — grant valid
// until": its grant in hand may still be spent (user trial, session 11: the operator took the
// worker for cut off). --descriptor without --domain is refused, naming both.
func TestSharesAllDomainsAndRevoked(t *testing.T) {
	creds, err := pkifiles.EnsureLocal(filepath.Join(t.TempDir(), "creds"), "quotad")
	if err != nil {
		t.Fatal(err)
	}
	c := rpctest.Start(t, 3, sharesAllLimits, rpctest.Secure(t, creds))
	t.Setenv(client.EnvCACert, creds.CAFile)
	t.Setenv(client.EnvToken, creds.Token)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	opts, err := connConfig("").DialCredentials()
	if err != nil {
		t.Fatal(err)
	}
	follower := c.Addrs()[(c.Leader()+1)%3]
	cc, err := grpc.NewClient(follower, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	tok, err := quotadv1.NewAdminClient(cc).CreateToken(ctx, &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"*"}})
	if err != nil {
		t.Fatal(err)
	}
	worker := quotadv1.NewQuotaClient(workerConn(t, follower, tok.Token))
	share := func(holder, domain string) {
		t.Helper()
		resp, err := worker.Share(ctx, &quotadv1.ShareRequest{HolderId: holder, Incarnation: 1, Seq: 1,
			Paths: []*quotadv1.SharePath{{Domain: domain, Demand: math.MaxUint64, MaxCost: 1}}})
		if err != nil || len(resp.Paths) != 1 || resp.Paths[0].Status != "lent" {
			t.Fatalf("share of %s: %v %v", domain, resp, err)
		}
	}
	share("h-api", "api")
	share("h-billing", "billing")

	run := func(args ...string) (string, error) {
		cmd := sharesCmd()
		var out bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetArgs(append([]string{"--addr", follower}, args...))
		cmd.SilenceUsage, cmd.SilenceErrors = true, true
		err := cmd.Execute()
		return out.String(), err
	}
	all, err := run()
	if err != nil {
		t.Fatalf("shares without --domain: %v", err)
	}
	for _, w := range []string{"h-api#1", "h-billing#1", "\napi\n", "\nbilling\n"} {
		if !strings.Contains("\n"+all, w) {
			t.Fatalf("shares without --domain lacks %q:\n%s", w, all)
		}
	}
	if !strings.Contains(all, "demand unknown  seq") || strings.Contains(all, "unknown/s") {
		t.Fatalf("an unknown demand should print as \"demand unknown\":\n%s", all)
	}
	if strings.Contains(all, "revoked") {
		t.Fatalf("a holder marked revoked before the revoke:\n%s", all)
	}
	if one, err := run("--domain", "billing"); err != nil || strings.Contains(one, "h-api") || !strings.Contains(one, "h-billing#1") {
		t.Fatalf("shares --domain billing: %v\n%s", err, one)
	}
	if _, err := run("--descriptor", "tenant=acme"); err == nil || !strings.Contains(err.Error(), "--descriptor needs --domain") {
		t.Fatalf("--descriptor without --domain: %v", err)
	}

	if _, err := quotadv1.NewAdminClient(cc).RevokeToken(ctx, &quotadv1.RevokeTokenRequest{Accessor: tok.Accessor}); err != nil {
		t.Fatal(err)
	}
	after, err := run()
	if err != nil {
		t.Fatalf("shares after the revoke: %v", err)
	}
	if n := strings.Count(after, "revoked — grant valid until "); n != 2 || !strings.Contains(after, "h-api#1") || !strings.Contains(after, "h-billing#1") {
		t.Fatalf("after the revoke: want both holders listed and marked revoked (%d marks):\n%s", n, after)
	}
}

// workerConn dials addr with the CA of the environment and token as the bearer token.
func workerConn(t *testing.T, addr, token string) *grpc.ClientConn {
	t.Helper()
	cfg := connConfig("")
	cfg.Token, cfg.TokenFile = token, ""
	opts, err := cfg.DialCredentials()
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}
