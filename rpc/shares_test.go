package rpc_test

import (
	"context"
	"io"
	"math"
	"net/http"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/rpc/rpctest"
)

const shareLimits = `
domain: api
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
shares: {lease: 6s}
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100}
    shares: {}
  - key: plain
    rate_limit: {unit: second, requests_per_unit: 100}
`

// TestShareOverTheCluster: a holder obtains shares through a follower (forwarded), a retry of
// its seq gets the stored answer, a replay of an older seq is refused, the lend shows in the
// leader's metrics and survives a leader kill, and a release puts the tokens back.
func TestShareOverTheCluster(t *testing.T) {
	c := rpctest.Start(t, 3, shareLimits)
	ctx := context.Background()
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[(leader+1)%3]))
	req := &quotadv1.ShareRequest{HolderId: "h", Incarnation: 7, Seq: 1, Paths: []*quotadv1.SharePath{
		{Domain: "api", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}, Demand: math.MaxUint64, MaxCost: 1},
		{Domain: "api", Descriptors: []*quotadv1.Entry{{Key: "plain", Value: "x"}}, Demand: math.MaxUint64},
	}}
	resp, err := q.Share(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	p := resp.Paths[0]
	if p.Status != "lent" || len(p.Levels) != 2 || p.Levels[1].Key != "api/tenant=acme" || p.Levels[1].Rate != 90_000_000 || !p.Levels[1].First {
		t.Fatalf("tenant path: %+v", p)
	}
	if resp.TermNs != 6e9 || resp.MarginNs <= 0 || resp.Paths[1].Status != "central" {
		t.Fatalf("answer: %+v", resp)
	}
	again, err := q.Share(ctx, req)
	if err != nil || !again.Duplicate || again.Paths[0].Levels[1].Initial != p.Levels[1].Initial {
		t.Fatalf("retry of seq 1: %+v %v", again, err)
	}
	req.Seq, req.AckSeq = 2, 1
	if _, err := q.Share(ctx, req); err != nil {
		t.Fatal(err)
	}
	old := proto.Clone(req).(*quotadv1.ShareRequest)
	old.Seq = 1
	if _, err := q.Share(ctx, old); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("replayed seq 1: %v, want FailedPrecondition", err)
	}
	if _, err := q.Share(ctx, &quotadv1.ShareRequest{HolderId: "", Seq: 1}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("empty holder id: %v", err)
	}

	// Metrics on the leader name the lent bucket.
	resp2, err := http.Get("http://" + c.Agent(leader).HTTPAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp2.Body)
	resp2.Body.Close()
	if !strings.Contains(string(body), `quotad_share_lent_rate{key="api/tenant=acme"} 90`) {
		t.Fatalf("metrics lack the lend:\n%s", grep(string(body), "quotad_share"))
	}

	// The lend survives a leader kill: the new leader still charges it (central part 10/s).
	c.Kill(leader)
	leader = c.WaitLeader(10e9)
	q = quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	st, err := q.Status(ctx, &quotadv1.StatusRequest{Domain: "api", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}})
	if err != nil {
		t.Fatal(err)
	}
	if b := st.Buckets[1]; b.Limit != 10 || b.Burst != 10 {
		t.Fatalf("central part after failover: %+v, want 10/s and 10", b)
	}
	rel, err := q.ReleaseShare(ctx, &quotadv1.ReleaseShareRequest{HolderId: "h", Incarnation: 7, Seq: 3,
		Tokens: []*quotadv1.LevelTokens{{Key: "api/tenant=acme", Tokens: 50_000_000}}})
	if err != nil || rel.Returned != 50_000_000 {
		t.Fatalf("release: %+v %v", rel, err)
	}
	st, _ = q.Status(ctx, &quotadv1.StatusRequest{Domain: "api", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}})
	if b := st.Buckets[1]; b.Limit != 100 || b.Remaining < 60 {
		t.Fatalf("after release: %+v, want the whole rate and the tokens back", b)
	}
}

const shareKeyCapsLimits = `
domain: capsh
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100}
    shares: {}
    descriptors:
      - key: consumer
        max_keys_per_parent: 1
        rate_limit: {unit: second, requests_per_unit: 100}
        shares: {}
`

// TestShareLendsObeyKeyCapsOverTheCluster: through a follower (forwarded to the leader, applied
// by every replica), a lend that would store a consumer bucket beyond its tenant's
// max_keys_per_parent is not made: the path is answered central with the reason, and the same
// path decided centrally is refused too_many_keys by the same cap.
func TestShareLendsObeyKeyCapsOverTheCluster(t *testing.T) {
	c := rpctest.Start(t, 3, shareKeyCapsLimits)
	ctx := context.Background()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[(c.Leader()+1)%3]))
	path := func(consumer string) *quotadv1.SharePath {
		return &quotadv1.SharePath{Domain: "capsh", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}, {Key: "consumer", Value: consumer}},
			Demand: math.MaxUint64, MaxCost: 1}
	}
	resp, err := q.Share(ctx, &quotadv1.ShareRequest{HolderId: "gw", Incarnation: 1, Seq: 1, Paths: []*quotadv1.SharePath{path("c0"), path("c1")}})
	if err != nil {
		t.Fatal(err)
	}
	if p := resp.Paths[0]; p.Status != "lent" || len(p.Levels) != 2 {
		t.Fatalf("first consumer: %+v", p)
	}
	if p := resp.Paths[1]; p.Status != "central" || len(p.Levels) != 0 ||
		!strings.Contains(p.Message, "max_keys_per_parent is 1") || !strings.Contains(p.Message, `"capsh/tenant=acme/consumer=c1"`) {
		t.Fatalf("second consumer beyond max_keys_per_parent 1: %+v, want central naming the cap", p)
	}
	d, err := acquireOne(ctx, q, "x", &quotadv1.Admission{RequestId: 1, Domain: "capsh", Descriptors: path("c1").Descriptors})
	if err != nil || d.Reason != "too_many_keys" || d.Scope != "consumer" || d.Limit != 1 {
		t.Fatalf("the second consumer decided centrally: %+v %v", d, err)
	}
}

func grep(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
