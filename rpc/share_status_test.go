package rpc_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/rpc/rpctest"
)

// TestShareStatusListsHolders: through a follower (forwarded, linearizable), ShareStatus
// lists the holder of a path with its rate, burst, expiry, demand and acknowledgement, the
// bucket with its lend and reserve; a path off the lend lists nothing; the grants counter
// and the reserve gauge show in the leader's metrics.
func TestShareStatusListsHolders(t *testing.T) {
	c := rpctest.Start(t, 3, shareLimits)
	ctx := context.Background()
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[(leader+1)%3]))
	acme := []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}
	req := &quotadv1.ShareRequest{HolderId: "h", Incarnation: 7, Seq: 1, Paths: []*quotadv1.SharePath{
		{Domain: "api", Descriptors: acme, Demand: 40_000_000, MaxCost: 1}}}
	if _, err := q.Share(ctx, req); err != nil {
		t.Fatal(err)
	}
	st, err := q.ShareStatus(ctx, &quotadv1.ShareStatusRequest{Domain: "api", Descriptors: acme})
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Holders) != 2 || len(st.Buckets) != 2 {
		t.Fatalf("status: %v, want the holder at the domain and the tenant bucket", st)
	}
	h := st.Holders[1]
	if h.Key != "api/tenant=acme" || h.HolderId != "h" || h.Incarnation != 7 || h.RateMicro == 0 || h.DemandMicro != 40_000_000 ||
		!h.Acknowledged || h.Unacked != 1 || h.ExpiresInMs <= 5000 || h.ExpiresInMs > 6250 {
		t.Fatalf("holder: %v", h)
	}
	if b := st.Buckets[1]; b.Key != "api/tenant=acme" || b.RateMicro != 100_000_000 || b.Holders != 1 || b.LentRateMicro != h.RateMicro || b.ReserveRateMicro != 10_000_000 {
		t.Fatalf("bucket: %v", b)
	}
	req.Seq, req.AckSeq = 2, 1
	if _, err := q.Share(ctx, req); err != nil {
		t.Fatal(err)
	}
	req.Seq, req.AckSeq = 3, 2
	if _, err := q.Share(ctx, req); err != nil {
		t.Fatal(err)
	}
	st, _ = q.ShareStatus(ctx, &quotadv1.ShareStatusRequest{Domain: "api"})
	if h := st.Holders[len(st.Holders)-1]; h.AckSeq != 2 || h.Seq != 3 {
		t.Fatalf("after two renewals: %v", h)
	}
	other, err := q.ShareStatus(ctx, &quotadv1.ShareStatusRequest{Domain: "api", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "other"}}})
	if err != nil || len(other.Holders) != 1 || other.Holders[0].Key != "api" {
		t.Fatalf("another tenant's path: %v %v, want only the domain's holder", other, err)
	}
	if _, err := q.ShareStatus(ctx, &quotadv1.ShareStatusRequest{Descriptors: acme}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("descriptors without a domain: %v", err)
	}
	// No domain: every domain's (here the one domain's) holders.
	if all, err := q.ShareStatus(ctx, &quotadv1.ShareStatusRequest{}); err != nil || len(all.Holders) != len(st.Holders) || all.Holders[0].OwnerRevoked {
		t.Fatalf("no domain: %v %v, want the domain's %d holders", all, err, len(st.Holders))
	}

	resp, err := http.Get("http://" + c.Agent(leader).HTTPAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`quotad_share_grants_total{kind="first"} 1`, `quotad_share_grants_total{kind="renewal"} 2`,
		`quotad_share_reserve_rate{key="api/tenant=acme"} 10`, `quotad_share_expiries_total 0`} {
		if !strings.Contains(string(body), want) {
			t.Fatalf("metrics lack %s:\n%s", want, grep(string(body), "quotad_share"))
		}
	}
}
