package main

import (
	"bytes"
	"context"
	"fmt"
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

// A domain lending per tenant: each holder path on its own tenant is a holder entry.
const sharesBigLimits = `
domain: big
rate_limit: {unit: second, requests_per_unit: 100000000}
shares: {lease: 60s}
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 1000}
    shares: {}
`

// TestSharesListsMoreThanFourMiB: `quotad shares` (every domain since s11-shares2) lists a
// cluster whose holder entries take more than gRPC's default 4 MiB answer — a fleet of a few
// thousand Limiters over per-tenant levels — through a follower. Both the CLI and the
// follower's forward to the leader refused it "received message larger than max".
func TestSharesListsMoreThanFourMiB(t *testing.T) {
	creds, err := pkifiles.EnsureLocal(filepath.Join(t.TempDir(), "creds"), "quotad")
	if err != nil {
		t.Fatal(err)
	}
	c := rpctest.Start(t, 3, sharesBigLimits, rpctest.Secure(t, creds))
	t.Setenv(client.EnvCACert, creds.CAFile)
	t.Setenv(client.EnvToken, creds.Token)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
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
	tok, err := quotadv1.NewAdminClient(cc).CreateToken(ctx, &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"big"}})
	if err != nil {
		t.Fatal(err)
	}
	worker := quotadv1.NewQuotaClient(workerConn(t, c.Addrs()[c.Leader()], tok.Token))
	const holders, paths = 6, 3000
	for h := range holders {
		req := &quotadv1.ShareRequest{HolderId: fmt.Sprintf("%03d-%s", h, strings.Repeat("h", 200)), Incarnation: 1, Seq: 1}
		for p := range paths {
			req.Paths = append(req.Paths, &quotadv1.SharePath{Domain: "big", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: fmt.Sprintf("tenant-%d-%05d", h, p)}}, Demand: math.MaxUint64, MaxCost: 1})
		}
		resp, err := worker.Share(ctx, req)
		if err != nil || len(resp.Paths) != paths || resp.Paths[0].Status != "lent" {
			t.Fatalf("share of holder %d: %v %v", h, err, resp.GetPaths()[0])
		}
	}
	cmd := sharesCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"--addr", follower})
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	if err := cmd.Execute(); err != nil {
		t.Fatalf("quotad shares of %d holder entries: %v", holders*(paths+1), err)
	}
	if n := strings.Count(out.String(), strings.Repeat("h", 200)); n < holders*paths {
		t.Fatalf("quotad shares listed %d holder entries, want at least %d", n, holders*paths)
	}
}
