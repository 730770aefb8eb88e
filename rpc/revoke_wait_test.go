package rpc_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc"
)

// One unit every 10 s: admissions that wait up to a minute queue behind each other.
const slowLimits = `
domain: provider
descriptors:
  - key: endpoint
    rate_limit: {unit: minute, requests_per_unit: 6, burst: 1}
`

// TestRevokeEndsWaitingAdmissions: admissions a token queued on the leader (through a follower)
// before it was revoked are answered Unauthenticated at the revoke, not granted later as their
// turn comes (before, they kept spending for up to their max_wait_ms, which has no cap), and
// another token's waiter in the same queue keeps waiting and is admitted.
func TestRevokeEndsWaitingAdmissions(t *testing.T) {
	bootstrapFile := filepath.Join(t.TempDir(), "bootstrap")
	bootstrap, _, err := auth.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bootstrapFile, []byte(bootstrap+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, p := authCluster(t, slowLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.BootstrapTokenFile = bootstrapFile })
	ctx := context.Background()
	as := func(tok string) context.Context {
		return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	leader := c.Leader()
	lconn := p.dialAs(c.Addrs()[leader], "")
	fconn := p.dialAs(c.Addrs()[(leader+1)%3], "")
	admin := quotadv1.NewAdminClient(lconn)
	create := func() string {
		t.Helper()
		resp, err := admin.CreateToken(as(bootstrap), &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"provider"}})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Token
	}
	revoked, kept := create(), create()
	racc, _ := auth.TokenAccessor(revoked)
	q := quotadv1.NewQuotaClient(fconn)
	clustertest.Eventually(t, 5*time.Second, func() error { // the follower knows both tokens
		for _, tok := range []string{revoked, kept} {
			if _, err := quotadv1.NewAdminClient(fconn).GetLimits(as(tok), &quotadv1.GetLimitsRequest{}); err != nil {
				return err
			}
		}
		return nil
	})
	if d, err := acquireOne(as(kept), q, "k", admission(1, 1, "endpoint=x")); err != nil || !d.Admitted {
		t.Fatalf("the burst's one unit: %+v %v", d, err)
	}

	type result struct {
		who string
		d   *quotadv1.Decision
		err error
	}
	results := make(chan result, 6)
	wait := func(who, tok string, id uint64) {
		a := admission(id, 1, "endpoint=x")
		a.MaxWaitMs = 60_000
		cctx, cancel := context.WithTimeout(as(tok), 30*time.Second)
		defer cancel()
		d, err := acquireOne(cctx, q, who, a)
		results <- result{who, d, err}
	}
	for i := range 5 {
		go wait("revoked", revoked, uint64(10+i))
	}
	clustertest.Eventually(t, 5*time.Second, func() error {
		if n := rpc.Waiting(c.Agent(leader)); n < 5 {
			return fmt.Errorf("%d admissions waiting on the leader, want 5", n)
		}
		return nil
	})
	go wait("kept", kept, 20)
	clustertest.Eventually(t, 5*time.Second, func() error {
		if n := rpc.Waiting(c.Agent(leader)); n < 6 {
			return fmt.Errorf("%d admissions waiting on the leader, want 6", n)
		}
		return nil
	})

	if _, err := admin.RevokeToken(as(bootstrap), &quotadv1.RevokeTokenRequest{Accessor: racc}); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		r := <-results
		if r.who != "revoked" {
			t.Fatalf("the other token's waiter was answered before the revoked ones: %+v %v", r.d, r.err)
		}
		wantCode(t, r.err, codes.Unauthenticated, racc, "revoked while this admission waited")
	}
	if n := rpc.Waiting(c.Agent(leader)); n != 1 {
		t.Fatalf("%d admissions waiting after the revoke, want 1 (the other token's)", n)
	}
	if r := <-results; r.err != nil || !r.d.Admitted {
		t.Fatalf("the other token's waiter: %+v %v, want admitted", r.d, r.err)
	}
}
