package region_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/config"
	"github.com/quotad/quotad/region"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// The limits as the global cluster's operator changes them: the global level's rate halved,
// the regional domain "local" tightened, a new regional domain "eu-only", "strict" removed.
const changedYAML = `
domain: api
rate_limit: {unit: second, requests_per_unit: 50, burst: 50, scope: global}
shares: {lease: 3s, fallback_rate: 10}
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 1000}
---
domain: local
rate_limit: {unit: second, requests_per_unit: 5, burst: 5}
---
domain: eu-only
rate_limit: {unit: second, requests_per_unit: 7}
`

func adminConn(t *testing.T, addr string) quotadv1.AdminClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return quotadv1.NewAdminClient(conn)
}

// regionalLimits returns the limits of every replica of rc, formatted without the version;
// an error unless they all equal want.
func replicasHave(rc *rpctest.Cluster, skip int, want string) error {
	for i := range rc.Len() {
		if i == skip {
			continue
		}
		l := *rc.Agent(i).FSM().Limits()
		l.Version = 0
		if got := string(config.Format(&l)); got != want {
			return fmt.Errorf("replica %d has\n%s\nwant\n%s", i, got, want)
		}
	}
	return nil
}

func formatted(t *testing.T, yaml string) string {
	t.Helper()
	l, err := config.Parse("want", []byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	l.Version = 0
	return string(config.Format(l))
}

// `limits apply` on the global cluster reaches a regional cluster of 3 nodes: the regional
// leader follows the global cluster's limits and applies them through the regional Raft log,
// so every regional replica has them (and a new regional leader keeps them). A regional
// cluster refuses `limits apply` (one source of truth, naming the global cluster). With the
// global cluster down, the region keeps its last limits and goes on deciding with them; once
// it is back, a change made there reaches the region again.
func TestRegionsFollowGlobalLimits(t *testing.T) {
	global := rpctest.Start(t, 1, limitsYAML)
	g := client.Config{Addrs: global.Addrs(), Insecure: true}
	rc := rpctest.Start(t, 3, limitsYAML, func(_ int, c *rpc.AgentConfig) { c.Region = region.Agent("r0", g) })
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	// A regional cluster refuses limits apply, naming the global cluster.
	_, err := adminConn(t, rc.Addrs()[rc.Leader()]).ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: changedYAML})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "global cluster") {
		t.Fatalf("limits apply on a regional cluster: %v, want FailedPrecondition naming the global cluster", err)
	}

	// The operator replaces the global cluster's limits.
	if _, err := adminConn(t, global.Addrs()[0]).ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: changedYAML, ReplaceAll: true}); err != nil {
		t.Fatal(err)
	}
	want := formatted(t, changedYAML)
	start := time.Now()
	clustertest.Eventually(t, 10*time.Second, func() error { return replicasHave(rc, -1, want) })
	t.Logf("every regional replica has the global cluster's new limits %v after the apply", time.Since(start))

	// The region decides with them: eu-only exists, local allows 5 (burst 5).
	c, err := client.New(client.Config{Addrs: rc.Addrs(), Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	admitted := func(domain string, n int) int {
		k := 0
		for range n {
			if d, err := c.Allow(ctx, client.Request{Domain: domain, Cost: 1}); err == nil && d.Admitted {
				k++
			}
		}
		return k
	}
	// The old limits would admit 50 at once (burst 50): the new ones 5 + 5/s.
	t0 := time.Now()
	if n, most := admitted("local", 20), 5+5*time.Since(t0).Seconds()+1; n < 5 || float64(n) > most {
		t.Fatalf("local admitted %d of 20, want the new burst 5 + 5/s (at most %.1f)", n, most)
	}
	if n := admitted("eu-only", 1); n != 1 {
		t.Fatalf("eu-only (new at the global cluster) not admitted in the region")
	}

	// Global cluster down: the region keeps its last limits (and a new regional leader too).
	global.Kill(0)
	time.Sleep(3 * time.Second)
	old := rc.Leader()
	rc.Kill(old)
	rc.WaitLeader(10 * time.Second)
	time.Sleep(2 * time.Second)
	if err := replicasHave(rc, old, want); err != nil {
		t.Fatalf("with the global cluster down: %v", err)
	}
	if n := admitted("eu-only", 1); n != 1 {
		t.Fatalf("eu-only not admitted in the region with the global cluster down")
	}

	// Back: another change reaches the region (through its new leader).
	global.Restart(0)
	global.WaitLeader(15 * time.Second)
	rc.Restart(old)
	again := strings.Replace(changedYAML, "requests_per_unit: 7", "requests_per_unit: 9", 1)
	clustertest.Eventually(t, 15*time.Second, func() error {
		_, err := adminConn(t, global.Addrs()[0]).ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: again, ReplaceAll: true})
		return err
	})
	want = formatted(t, again)
	clustertest.Eventually(t, 15*time.Second, func() error { return replicasHave(rc, -1, want) })
}

// A retried request (same client ID and request ID) is answered from the regional leader's
// dedup table and spends nothing from the region's share of the global level again.
func TestRegionsRetrySpendsShareOnce(t *testing.T) {
	global := rpctest.Start(t, 1, limitsYAML)
	g := client.Config{Addrs: global.Addrs(), Insecure: true}
	rc := rpctest.Start(t, 1, limitsYAML, func(_ int, c *rpc.AgentConfig) { c.Region = region.Agent("r0", g) })
	var h *region.Holder
	clustertest.Eventually(t, 15*time.Second, func() error {
		h, _ = rc.Agent(rc.Leader()).Region().(*region.Holder)
		if h == nil || len(h.Shares()) == 0 || !h.Shares()[0].Local {
			return fmt.Errorf("no share yet")
		}
		return nil
	})
	conn, err := grpc.NewClient(rc.Addrs()[rc.Leader()], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	q := quotadv1.NewQuotaClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := &quotadv1.AcquireRequest{ClientId: "retrier", Admissions: []*quotadv1.Admission{{RequestId: 42, Domain: "api", Cost: 3}}}
	first, err := q.Acquire(ctx, req)
	if err != nil || !first.Decisions[0].Admitted {
		t.Fatalf("first: %v %v", first, err)
	}
	spent := h.Shares()[0].Admitted
	for range 5 {
		r, err := q.Acquire(ctx, req)
		if err != nil || !r.Decisions[0].Admitted || r.Decisions[0].Remaining != first.Decisions[0].Remaining {
			t.Fatalf("retry: %v %v, want the remembered admission", r, err)
		}
	}
	if got := h.Shares()[0].Admitted; got != spent {
		t.Fatalf("the share spent %d units for 5 retries of an admitted request (admitted units %d → %d); want 0", got-spent, spent, got)
	}
}

// A global cluster rebuilt from scratch numbers its limits from 1 again, so the version a
// region last followed can come back naming other limits: the region compares the text too
// and follows them.
func TestRegionsFollowSameVersionOtherLimits(t *testing.T) {
	global := rpctest.Start(t, 1, limitsYAML)
	g := client.Config{Addrs: global.Addrs(), Insecure: true}
	rc := rpctest.Start(t, 1, limitsYAML, func(_ int, c *rpc.AgentConfig) { c.Region = region.Agent("r0", g) })
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	r, err := adminConn(t, global.Addrs()[0]).ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: changedYAML, ReplaceAll: true})
	if err != nil {
		t.Fatal(err)
	}
	clustertest.Eventually(t, 10*time.Second, func() error { return replicasHave(rc, -1, formatted(t, changedYAML)) })

	// The global cluster is rebuilt: an empty data dir, the first limits again, then an apply
	// of other limits — the same version number as the limits the region follows.
	global.Kill(0)
	global.Reconfigure(0, func(_ int, c *rpc.AgentConfig) { c.Cluster.DataDir = t.TempDir() })
	global.Restart(0)
	global.WaitLeader(15 * time.Second)
	clustertest.Eventually(t, 10*time.Second, func() error {
		if v := global.Agent(0).FSM().Limits().Version; v != 1 {
			return fmt.Errorf("rebuilt global cluster at limits version %d, want its --limits file as 1", v)
		}
		return nil
	})
	again := strings.Replace(changedYAML, "requests_per_unit: 7", "requests_per_unit: 9", 1)
	var r2 *quotadv1.ApplyLimitsResponse
	clustertest.Eventually(t, 15*time.Second, func() error {
		var err error
		r2, err = adminConn(t, global.Addrs()[0]).ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: again, ReplaceAll: true})
		return err
	})
	if r2.Version != r.Version {
		t.Fatalf("the rebuilt global cluster applied version %d, want the same number %d for the test", r2.Version, r.Version)
	}
	clustertest.Eventually(t, 15*time.Second, func() error { return replicasHave(rc, -1, formatted(t, again)) })
}
