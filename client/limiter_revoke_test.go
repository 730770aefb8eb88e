package client

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/rpc/rpctest"
)

const revokeShareLimits = `
domain: api
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
shares: {lease: 2s, fallback_rate: 500}
`

// TestLimiterRevokedTokenFailsClosed: a Limiter whose token is revoked decides on the grant in
// hand until it ends, then admits nothing — fallback_rate is for a cluster that cannot be
// reached, not for one that refuses the credential. It admitted at its fallback slice forever,
// saying "no answer from the cluster", while quotad shares listed no holder (user trial,
// session 11: 10/s for as long as it ran after the revoke).
func TestLimiterRevokedTokenFailsClosed(t *testing.T) {
	creds, err := pkifiles.EnsureLocal(filepath.Join(t.TempDir(), "creds"), "quotad")
	if err != nil {
		t.Fatal(err)
	}
	c := rpctest.Start(t, 3, revokeShareLimits, rpctest.Secure(t, creds))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	adminCfg := Config{Addrs: c.Addrs(), TLSFiles: TLSFiles{CAFile: creds.CAFile}, TokenFile: creds.TokenFile}
	opts, err := adminCfg.DialCredentials()
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(c.Addrs()[0], opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	admin := quotadv1.NewAdminClient(cc)
	tok, err := admin.CreateToken(ctx, &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"api"}})
	if err != nil {
		t.Fatal(err)
	}

	qc := newTestClient(t, c.Addrs(), func(cfg *Config) {
		cfg.TLSFiles = TLSFiles{CAFile: creds.CAFile}
		cfg.Token = tok.Token
	})
	lim := qc.Limiter(Request{Domain: "api"}, LimiterOptions{})
	defer lim.Close()
	// Spend while waiting: an idle path's observed demand is 0, which is not lent.
	for deadline := time.Now().Add(10 * time.Second); !lim.Share().Local; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no local share: %+v", lim.Share())
		}
		lim.Allow()
	}
	if fb := lim.Share().FallbackRate; fb <= 0 {
		t.Fatalf("fallback slice %v; the test needs one", fb)
	}
	if _, err := admin.RevokeToken(ctx, &quotadv1.RevokeTokenRequest{Accessor: tok.Accessor}); err != nil {
		t.Fatal(err)
	}
	// The grant in hand (2 s lease) ends; a renewal at term/3 is refused meanwhile.
	deadline := time.Now().Add(6 * time.Second)
	for lim.Share().Local && time.Now().Before(deadline) {
		lim.Allow()
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	admitted := 0
	for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		if lim.Allow() {
			admitted++
		}
	}
	if s := lim.Share(); admitted > 0 || s.Local || !strings.Contains(s.Message, "refused its renewal") {
		t.Fatalf("after the revoke and the grant's end: admitted %d in 1 s, share %+v; want 0 and a message saying the renewal was refused", admitted, s)
	}
	// Wait does not block until its deadline (forever without one): it returns the refusal.
	wctx, wcancel := context.WithTimeout(ctx, 5*time.Second)
	defer wcancel()
	start := time.Now()
	err = lim.Wait(wctx)
	if took := time.Since(start); status.Code(err) != codes.Unauthenticated || took > time.Second {
		t.Fatalf("Wait after the grant ended with its renewal refused = %v after %v; want Unauthenticated at once", err, took.Round(time.Millisecond))
	}
}

// TestLimiterRefusalIsRetriedSoon: a renewal refused once (PermissionDenied: here a limits
// change the operator reverts at once made the tenant-bound worker's path undefined) is
// retried soon, not after a fixed 5 s: with a lease shorter than that, the grant in hand
// ended while the cluster accepted the renewal again, and the Limiter admitted nothing for
// seconds (review s11-review: it was not Local for ~3 s of the 3 s after the revert).
func TestLimiterRefusalIsRetriedSoon(t *testing.T) {
	const withConsumer = `
domain: api
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
shares: {lease: 2s}
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 500}
    shares: {}
    descriptors:
      - key: consumer
        rate_limit: {unit: second, requests_per_unit: 400}
        shares: {}
`
	without := strings.Replace(withConsumer, "    descriptors:\n      - key: consumer\n        rate_limit: {unit: second, requests_per_unit: 400}\n        shares: {}\n", "", 1)
	if without == withConsumer {
		t.Fatal("test setup: limits changed shape")
	}
	creds, err := pkifiles.EnsureLocal(filepath.Join(t.TempDir(), "creds"), "quotad")
	if err != nil {
		t.Fatal(err)
	}
	c := rpctest.Start(t, 3, withConsumer, rpctest.Secure(t, creds))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	adminCfg := Config{Addrs: c.Addrs(), TLSFiles: TLSFiles{CAFile: creds.CAFile}, TokenFile: creds.TokenFile}
	opts, err := adminCfg.DialCredentials()
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(c.Addrs()[c.Leader()], opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	admin := quotadv1.NewAdminClient(cc)
	tok, err := admin.CreateToken(ctx, &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"api"}, Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	qc := newTestClient(t, c.Addrs(), func(cfg *Config) {
		cfg.TLSFiles = TLSFiles{CAFile: creds.CAFile}
		cfg.Token = tok.Token
	})
	lim := qc.Limiter(Request{Domain: "api", Descriptors: []Entry{{"tenant", "acme"}, {"consumer", "x"}}}, LimiterOptions{})
	defer lim.Close()
	for deadline := time.Now().Add(10 * time.Second); !lim.Share().Local; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no local share: %+v", lim.Share())
		}
		lim.Allow()
	}
	apply := func(y string) {
		t.Helper()
		if _, err := admin.ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: y, ReplaceAll: true}); err != nil {
			t.Fatal(err)
		}
	}
	// Renewals come every ~0.67 s (2 s lease / 3): one at least is refused in 1 s.
	apply(without)
	for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		lim.Allow()
	}
	apply(withConsumer)
	var off time.Duration
	const step = 10 * time.Millisecond
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(step) {
		lim.Allow()
		if !lim.Share().Local {
			off += step
		}
	}
	if off > time.Second {
		t.Fatalf("after the revert the Limiter had no local share for %v of 3 s (%+v); want it renewed within a second", off, lim.Share())
	}
}

// TestLimiterWaitOnRefusedPathReturns: Wait on a Limiter whose path the credential may not
// spend (a worker token without the domain: the share answers the path invalid, and the
// central Wait is refused PermissionDenied) returns that refusal. It retried the central Wait
// every 10 ms until ctx ended — a refused caller kept about 100 Acquire RPCs a second per
// waiting goroutine going at the cluster, forever with a context without deadline.
func TestLimiterWaitOnRefusedPathReturns(t *testing.T) {
	creds, err := pkifiles.EnsureLocal(filepath.Join(t.TempDir(), "creds"), "quotad")
	if err != nil {
		t.Fatal(err)
	}
	c := rpctest.Start(t, 1, revokeShareLimits+"---\ndomain: other\nrate_limit: {unit: second, requests_per_unit: 1000}\nshares: {lease: 2s}\n", rpctest.Secure(t, creds))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	adminCfg := Config{Addrs: c.Addrs(), TLSFiles: TLSFiles{CAFile: creds.CAFile}, TokenFile: creds.TokenFile}
	opts, err := adminCfg.DialCredentials()
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(c.Addrs()[0], opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	tok, err := quotadv1.NewAdminClient(cc).CreateToken(ctx, &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"api"}})
	if err != nil {
		t.Fatal(err)
	}
	qc := newTestClient(t, c.Addrs(), func(cfg *Config) {
		cfg.TLSFiles = TLSFiles{CAFile: creds.CAFile}
		cfg.Token = tok.Token
	})
	lim := qc.Limiter(Request{Domain: "other"}, LimiterOptions{})
	defer lim.Close()
	wctx, wcancel := context.WithTimeout(ctx, 3*time.Second)
	defer wcancel()
	start, rpcs := time.Now(), qc.Stats().RPCs
	err = lim.Wait(wctx)
	took, sent := time.Since(start), qc.Stats().RPCs-rpcs
	if status.Code(err) != codes.PermissionDenied || took > 2*time.Second {
		t.Fatalf("Wait on a path the token may not spend: %v after %v (%d Acquire RPCs); want the PermissionDenied refusal at once", err, took.Round(time.Millisecond), sent)
	}
}
