package rpc_test

import (
	"context"
	"math"
	"strings"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/rpc"
)

// TestSharePathOutsideTheCredentialIsInvalidAlone: a worker's share request naming one path
// its credential may not spend (another domain; for a tenant-bound worker, a path without its
// tenant) gets that path answered invalid with the reason and its other paths lent, through a
// follower too. Refusing the whole request (as before) left every Limiter of such a client
// unlent ("pending", one RPC per Allow) or, once the path was added, its renewals refused —
// user trial, session 11. A request with no path the caller may spend is still refused.
func TestSharePathOutsideTheCredentialIsInvalidAlone(t *testing.T) {
	c, p := authCluster(t, shareLimits+"---\ndomain: billing\nrate_limit: {unit: second, requests_per_unit: 10}\nshares: {}\n")
	p.client(auth.Identity{Name: "w", Role: auth.RoleWorker, Domains: []string{"api"}})
	p.client(auth.Identity{Name: "acme", Role: auth.RoleWorker, Domains: []string{"api"}, Tenant: "acme"})
	leader := c.Leader()
	ctx := context.Background()
	acme := []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}
	// One holder renewing, through a follower, then the leader.
	for i, addr := range []string{c.Addrs()[(leader+1)%3], c.Addrs()[leader]} {
		q := quotadv1.NewQuotaClient(p.dialAs(addr, "w"))
		resp, err := q.Share(ctx, &quotadv1.ShareRequest{HolderId: "h", Incarnation: 1, Seq: uint64(i + 1), AckSeq: uint64(i), Paths: []*quotadv1.SharePath{
			{Domain: "billing", Demand: math.MaxUint64},
			{Domain: "api", Descriptors: acme, Demand: math.MaxUint64, MaxCost: 1},
		}})
		if err != nil {
			t.Fatalf("via %s: %v; want path 0 invalid and path 1 lent", addr, err)
		}
		if len(resp.Paths) != 2 || resp.Paths[0].Status != "invalid" || !strings.Contains(resp.Paths[0].Message, `may not use domain "billing"`) ||
			resp.Paths[1].Status != "lent" || len(resp.Paths[1].Levels) != 2 {
			t.Fatalf("via %s: %+v", addr, resp.Paths)
		}
		// Only paths it may not spend: refused, as before.
		_, err = q.Share(ctx, &quotadv1.ShareRequest{HolderId: "h2-" + addr, Incarnation: 1, Seq: 1, Paths: []*quotadv1.SharePath{{Domain: "billing"}}})
		wantCode(t, err, codes.PermissionDenied, `may not use domain "billing"`)
	}

	// A tenant-bound worker: the domain ceiling alone names no tenant. (Its tenant's path is
	// too_small while holder h keeps the whole bucket: a newcomer; not invalid in any case.)
	q := quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[leader], "acme"))
	resp, err := q.Share(ctx, &quotadv1.ShareRequest{HolderId: "a", Incarnation: 1, Seq: 1, Paths: []*quotadv1.SharePath{
		{Domain: "api", Descriptors: acme, Demand: math.MaxUint64, MaxCost: 1},
		{Domain: "api", Demand: math.MaxUint64},
	}})
	if err != nil || resp.Paths[0].Status == "invalid" || resp.Paths[1].Status != "invalid" || !strings.Contains(resp.Paths[1].Message, "paths[1]") {
		t.Fatalf("tenant-bound worker: %+v %v", resp.GetPaths(), err)
	}
}

// TestShareRetryAfterPermissionChangeIsRefused: a tenant-bound worker's retry of a share
// request (same seq) after a limits change made one of its paths valid is refused
// (FailedPrecondition: send a newer seq), not given the stored answer of the first try —
// which covered one path fewer and, matched by position, would give a path the share of
// another.
func TestShareRetryAfterPermissionChangeIsRefused(t *testing.T) {
	c, p := authCluster(t, shareLimits)
	p.client(auth.Identity{Name: "acme", Role: auth.RoleWorker, Domains: []string{"api"}, Tenant: "acme"})
	p.client(auth.Identity{Name: "op", Role: auth.RoleAdmin})
	leader := c.Leader()
	ctx := context.Background()
	q := quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[leader], "acme"))
	req := &quotadv1.ShareRequest{HolderId: "a", Incarnation: 1, Seq: 1, Paths: []*quotadv1.SharePath{
		{Domain: "api", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}, {Key: "consumer", Value: "x"}}, Demand: math.MaxUint64, MaxCost: 1},
		{Domain: "api", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}, Demand: math.MaxUint64, MaxCost: 1},
	}}
	resp, err := q.Share(ctx, req)
	if err != nil || resp.Paths[0].Status != "invalid" || resp.Paths[1].Status == "invalid" {
		t.Fatalf("first try: %+v %v; want path 0 (consumer undefined) invalid, path 1 not", resp.GetPaths(), err)
	}
	// The consumer level is defined now: path 0 becomes one the worker may spend.
	withConsumer := strings.Replace(shareLimits, "    shares: {}\n", "    shares: {}\n    descriptors:\n      - key: consumer\n", 1)
	if withConsumer == shareLimits {
		t.Fatal("test setup: shareLimits changed shape")
	}
	admin := quotadv1.NewAdminClient(p.dialAs(c.Addrs()[leader], "op"))
	if _, err := admin.ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: withConsumer}); err != nil {
		t.Fatal(err)
	}
	_, err = q.Share(ctx, req)
	wantCode(t, err, codes.FailedPrecondition, "newer seq")
	// A newer seq is answered for both paths.
	req.Seq, req.AckSeq = 2, 1
	resp, err = q.Share(ctx, req)
	if err != nil || len(resp.Paths) != 2 || resp.Paths[0].Status == "invalid" {
		t.Fatalf("newer seq: %+v %v", resp.GetPaths(), err)
	}
}

// TestShareRetryAfterPermissionSwapIsRefused: the same, when the limits change swaps which of
// two paths the worker may spend (the consumer level replaced by a region level): both tries
// propose one path, so counting them cannot tell, and the stored answer for path 0 (lent
// down to its consumer=x bucket) was handed to path 1 (review s11-review).
func TestShareRetryAfterPermissionSwapIsRefused(t *testing.T) {
	level := func(key string) string {
		return strings.Replace(shareLimits, "    shares: {}\n", "    shares: {}\n    descriptors:\n      - key: "+key+"\n        rate_limit: {unit: second, requests_per_unit: 50}\n        shares: {}\n", 1)
	}
	c, p := authCluster(t, level("consumer"))
	p.client(auth.Identity{Name: "acme", Role: auth.RoleWorker, Domains: []string{"api"}, Tenant: "acme"})
	p.client(auth.Identity{Name: "op", Role: auth.RoleAdmin})
	leader := c.Leader()
	ctx := context.Background()
	q := quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[leader], "acme"))
	req := &quotadv1.ShareRequest{HolderId: "a", Incarnation: 1, Seq: 1, Paths: []*quotadv1.SharePath{
		{Domain: "api", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}, {Key: "consumer", Value: "x"}}, Demand: math.MaxUint64, MaxCost: 1},
		{Domain: "api", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}, {Key: "region", Value: "eu"}}, Demand: math.MaxUint64, MaxCost: 1},
	}}
	resp, err := q.Share(ctx, req)
	if err != nil || resp.Paths[0].Status == "invalid" || resp.Paths[1].Status != "invalid" {
		t.Fatalf("first try: %+v %v; want path 0 valid, path 1 (region undefined) invalid", resp.GetPaths(), err)
	}
	admin := quotadv1.NewAdminClient(p.dialAs(c.Addrs()[leader], "op"))
	if _, err := admin.ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: level("region")}); err != nil {
		t.Fatal(err)
	}
	resp, err = q.Share(ctx, req)
	if err == nil {
		for _, l := range resp.Paths[1].Levels {
			if strings.Contains(l.Key, "consumer") {
				t.Fatalf("retry after the swap: path 1 (region=eu) got path 0's consumer=x bucket %q: %+v", l.Key, resp.Paths)
			}
		}
	}
	wantCode(t, err, codes.FailedPrecondition, "newer seq")
	req.Seq, req.AckSeq = 2, 1
	resp, err = q.Share(ctx, req)
	if err != nil || len(resp.Paths) != 2 || resp.Paths[0].Status != "invalid" || resp.Paths[1].Status == "invalid" {
		t.Fatalf("newer seq: %+v %v; want path 0 invalid, path 1 not", resp.GetPaths(), err)
	}
}

// TestShareRefusedByLimitsIsTheLeaders: a tenant-bound worker's share request whose only path
// the limits do not define (tenantPathProblem) is forwarded by a follower and refused by the
// leader, on the leader's limits: a follower whose limits lag the leader's refused it on its
// own (stale) limits, where the leader might accept it. A refusal that depends on the
// credential alone (another tenant) is still made by the follower, without a forward.
func TestShareRefusedByLimitsIsTheLeaders(t *testing.T) {
	var shares [3]atomic.Int32
	count := func(i int, cfg *rpc.AgentConfig) {
		cfg.UnaryInterceptors = append(cfg.UnaryInterceptors, func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			if info.FullMethod == "/quotad.v1.Quota/Share" {
				shares[i].Add(1)
			}
			return handler(ctx, req)
		})
	}
	c, p := authCluster(t, shareLimits, count)
	p.client(auth.Identity{Name: "acme", Role: auth.RoleWorker, Domains: []string{"api"}, Tenant: "acme"})
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[(leader+1)%3], "acme"))
	ctx := context.Background()
	undefined := &quotadv1.ShareRequest{HolderId: "a", Incarnation: 1, Seq: 1, Paths: []*quotadv1.SharePath{
		{Domain: "api", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}, {Key: "consumer", Value: "x"}}, Demand: math.MaxUint64, MaxCost: 1}}}
	_, err := q.Share(ctx, undefined)
	wantCode(t, err, codes.PermissionDenied, "matches no limit")
	if n := shares[leader].Load(); n != 1 {
		t.Fatalf("the leader saw %d Share calls, want 1: the follower refused a path by its own limits", n)
	}
	other := &quotadv1.ShareRequest{HolderId: "a", Incarnation: 1, Seq: 2, Paths: []*quotadv1.SharePath{
		{Domain: "api", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "globex"}}, Demand: math.MaxUint64, MaxCost: 1}}}
	_, err = q.Share(ctx, other)
	wantCode(t, err, codes.PermissionDenied, "may act only for tenant=acme")
	if n := shares[leader].Load(); n != 1 {
		t.Fatalf("the leader saw %d Share calls, want still 1: a credential refusal needs no forward", n)
	}
}
