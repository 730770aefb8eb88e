package rpc_test

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/backup"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// tenants is a single secure node with a worker token for each of two tenants of domain w9
// (token create --role worker --domain w9 --tenant acme / globex).
type tenants struct {
	c            *rpctest.Cluster
	q            quotadv1.QuotaClient
	adminClient  quotadv1.AdminClient
	acme, globex string // the tenants' worker tokens
	admin        string // the bootstrap admin token
}

func startTenants(t *testing.T, limits string, opts ...rpctest.Option) *tenants {
	t.Helper()
	tt := &tenants{}
	bootstrapFile := filepath.Join(t.TempDir(), "bootstrap")
	var err error
	if tt.admin, _, err = auth.NewToken(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bootstrapFile, []byte(tt.admin+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := newPKI(t)
	p.issue("node", []string{auth.ServerName(rpc.DefaultClusterName)}, nil, false)
	all := append([]rpctest.Option{func(_ int, cfg *rpc.AgentConfig) {
		cfg.Insecure, cfg.EnableDebug = false, false
		cfg.TLS = p.files("node")
		cfg.Cluster.GossipSecretKey = []byte("0123456789abcdef0123456789abcdef")
		cfg.BootstrapTokenFile = bootstrapFile
	}}, opts...)
	tt.c = rpctest.Start(t, 1, limits, all...)
	conn := p.dialAs(tt.c.Addrs()[0], "")
	tt.q, tt.adminClient = quotadv1.NewQuotaClient(conn), quotadv1.NewAdminClient(conn)
	create := func(tenant string) string {
		resp, err := tt.adminClient.CreateToken(tt.as(tt.admin), &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"w9"}, Tenant: tenant})
		if err != nil {
			t.Fatalf("token for %s: %v", tenant, err)
		}
		return resp.Token
	}
	tt.acme, tt.globex = create("acme"), create("globex")
	return tt
}

func (tt *tenants) as(tok string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+tok)
}

// w9 gives each tenant 1 request a minute: a tenant's bucket is full until it spends it.
const waiterTenantLimits = `
domain: w9
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 1, burst: 1}
`

// floodWaiters has acme's worker token park six waiting admissions under client IDs
// rotating-0..5, its bucket empty (so each would wait a minute), and returns once every one
// that was refused has its answer; the others wait until ctx ends.
func (tt *tenants) floodWaiters(t *testing.T, ctx context.Context, wg *sync.WaitGroup) map[string]int {
	t.Helper()
	if d, err := acquireOne(tt.as(tt.acme), tt.q, "rotating-x", &quotadv1.Admission{RequestId: 1, Domain: "w9",
		Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}}); err != nil || !d.Admitted {
		t.Fatalf("acme empties its bucket: %+v %v", d, err)
	}
	var mu sync.Mutex
	refused := map[string]int{}
	actx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tt.acme)
	for i := range 6 {
		wg.Go(func() {
			d, err := acquireOne(actx, tt.q, fmt.Sprintf("rotating-%d", i), &quotadv1.Admission{RequestId: 2, Domain: "w9",
				Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}, MaxWaitMs: 120000})
			if err == nil && d.Reason == "too_many_waiters" {
				mu.Lock()
				refused[d.Scope]++
				mu.Unlock()
			}
		})
	}
	// Each of the six either waits or is refused at once.
	clustertest.Eventually(t, 10*time.Second, func() error {
		mu.Lock()
		n := 0
		for _, c := range refused {
			n += c
		}
		mu.Unlock()
		if w := tt.c.Agent(0).FairView().Waiting; w+n != 6 {
			return fmt.Errorf("%d waiting + %d refused, want 6", w, n)
		}
		return nil
	})
	mu.Lock()
	defer mu.Unlock()
	return maps.Clone(refused)
}

// TestWaiterCapPerIdentity: one tenant's worker token rotating client_id cannot fill the
// domain's waiting slots (--max-waiters-per-identity, by default a quarter of
// --max-waiters-per-domain), so another tenant can still wait.
func TestWaiterCapPerIdentity(t *testing.T) {
	tt := startTenants(t, waiterTenantLimits, func(_ int, cfg *rpc.AgentConfig) {
		cfg.Waiters = rpc.WaiterCaps{PerClient: 2, PerDomain: 4} // per identity: 1
	})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	refused := tt.floodWaiters(t, ctx, &wg)
	if refused["identity"] != 5 || len(refused) != 1 {
		t.Fatalf("acme's six waiters under six client_ids: refused %v, want 5 by the identity cap (1 of 4 slots)", refused)
	}
	// globex spends its unit, then waits (until the test ends): a slot is free for it.
	gctx := tt.as(tt.globex)
	globex := []*quotadv1.Entry{{Key: "tenant", Value: "globex"}}
	if d, err := acquireOne(gctx, tt.q, "g", &quotadv1.Admission{RequestId: 1, Domain: "w9", Descriptors: globex}); err != nil || !d.Admitted {
		t.Fatalf("globex spends its unit: %+v %v", d, err)
	}
	gwait := make(chan *quotadv1.Decision, 1)
	wg.Go(func() {
		wctx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tt.globex)
		d, _ := acquireOne(wctx, tt.q, "g", &quotadv1.Admission{RequestId: 2, Domain: "w9", Descriptors: globex, MaxWaitMs: 120000})
		gwait <- d
	})
	clustertest.Eventually(t, 5*time.Second, func() error {
		select {
		case d := <-gwait:
			t.Fatalf("globex's waiting admission was answered: %+v; want it waiting", d)
		default:
		}
		if w := tt.c.Agent(0).FairView().Waiting; w != 2 {
			return fmt.Errorf("%d waiting, want acme's 1 and globex's 1", w)
		}
		return nil
	})
	// The refusal names the identity and the flag.
	d, err := acquireOne(tt.as(tt.acme), tt.q, "rotating-9", &quotadv1.Admission{RequestId: 3, Domain: "w9",
		Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}, MaxWaitMs: 120000})
	if err != nil || d.Reason != "too_many_waiters" || d.Scope != "identity" ||
		!strings.Contains(d.Message, `already has 1 admissions waiting on the leader in domain "w9", its limit (--max-waiters-per-identity 1)`) {
		t.Fatalf("acme's seventh: %+v %v", d, err)
	}
}

// TestWaiterSlotOnlyToWait: an admission its own bucket can pay now is decided without a
// waiter slot, so a domain whose slots one tenant filled does not refuse another tenant who
// would not have waited; one who would wait is refused (too_many_waiters, domain).
func TestWaiterSlotOnlyToWait(t *testing.T) {
	tt := startTenants(t, waiterTenantLimits, func(_ int, cfg *rpc.AgentConfig) {
		cfg.Waiters = rpc.WaiterCaps{PerClient: 2, PerIdentity: 100, PerDomain: 4}
	})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	refused := tt.floodWaiters(t, ctx, &wg)
	if refused["domain"] != 2 || len(refused) != 1 {
		t.Fatalf("acme's six waiters with a per-identity cap of 100: refused %v, want 2 by the domain cap", refused)
	}
	gctx := tt.as(tt.globex)
	globex := []*quotadv1.Entry{{Key: "tenant", Value: "globex"}}
	start := time.Now()
	d, err := acquireOne(gctx, tt.q, "g", &quotadv1.Admission{RequestId: 1, Domain: "w9", Descriptors: globex, MaxWaitMs: 3000})
	if err != nil || !d.Admitted {
		t.Fatalf("globex, its bucket full, with max_wait in a domain whose slots acme holds: %+v %v; want admitted", d, err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("globex's payable admission took %v: it waited", took)
	}
	// Now globex's bucket is empty: one that cannot be paid within its wait is refused at
	// once (rate_limited, no slot needed); one that would wait finds no slot free.
	d, err = acquireOne(gctx, tt.q, "g", &quotadv1.Admission{RequestId: 2, Domain: "w9", Descriptors: globex, MaxWaitMs: 3000})
	if err != nil || d.Reason != "rate_limited" || d.Scope != "tenant" {
		t.Fatalf("globex, its bucket empty, 3 s wait: %+v %v; want rate_limited at once", d, err)
	}
	d, err = acquireOne(gctx, tt.q, "g", &quotadv1.Admission{RequestId: 3, Domain: "w9", Descriptors: globex, MaxWaitMs: 120000})
	if err != nil || d.Reason != "too_many_waiters" || d.Scope != "domain" {
		t.Fatalf("globex, its bucket empty: %+v %v; want too_many_waiters at scope domain", d, err)
	}
}

// w9 with consumers under tenants: each tenant's consumers fill at most 3 buckets, the
// domain holds at most 8.
const parentKeysLimits = `
domain: w9
max_keys: 8
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 100}
    descriptors:
      - key: consumer
        rate_limit: {unit: minute, requests_per_unit: 1}
        max_keys_per_parent: 3
`

// TestMaxKeysPerParentAcrossTenants: acme's worker token inventing consumers fills only its
// own part (max_keys_per_parent); globex, which had no bucket yet, is still served.
func TestMaxKeysPerParentAcrossTenants(t *testing.T) {
	tt := startTenants(t, parentKeysLimits)
	consumer := func(tok, tenant, c string, id uint64) (*quotadv1.Decision, error) {
		return acquireOne(tt.as(tok), tt.q, "flood", &quotadv1.Admission{RequestId: id, Domain: "w9",
			Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tenant}, {Key: "consumer", Value: c}}})
	}
	var acme []*quotadv1.Decision
	for i := range 20 {
		d, err := consumer(tt.acme, "acme", fmt.Sprintf("rotating-%d", i), uint64(i+1))
		if err != nil {
			t.Fatal(err)
		}
		acme = append(acme, d)
	}
	for i := range 3 {
		if d, err := consumer(tt.globex, "globex", fmt.Sprint("c", i), uint64(i+1)); err != nil || !d.Admitted {
			t.Fatalf("globex's consumer %d after acme's flood: %+v %v; want admitted", i, d, err)
		}
	}
	for i, d := range acme {
		switch {
		case d.Admitted && i < 3:
		case d.Reason == "too_many_keys" && i >= 3 && d.Scope == "consumer" && d.Limit == 3 &&
			strings.Contains(d.Message, `"w9/tenant=acme" holds 3 active "consumer" buckets and that level's max_keys_per_parent is 3`):
		default:
			t.Fatalf("acme's consumer %d: %+v; want the first 3 admitted, the rest too_many_keys at max_keys_per_parent", i, d)
		}
	}
}

// TestMaxKeysPerParentNeedsEveryNode: while a node advertises an fsm command version before
// 6 (a build that would ignore max_keys_per_parent), ApplyLimits refuses limits that use it,
// naming the field, the node and what to do, and nothing is replicated; limits without it
// still apply. Node 2 stands in for the older build (cluster.Config.AdvertisedCommandVersion).
func TestMaxKeysPerParentNeedsEveryNode(t *testing.T) {
	c := rpctest.Start(t, 3, waiterTenantLimits, func(i int, cfg *rpc.AgentConfig) {
		if i == 2 {
			cfg.Cluster.AdvertisedCommandVersion = 5
		}
	})
	leader := c.Leader()
	admin := quotadv1.NewAdminClient(dial(t, c.Addrs()[leader]))
	ctx := context.Background()
	clustertest.Eventually(t, 10*time.Second, func() error {
		for _, m := range c.Agent(leader).Node().Members() {
			if m.Suffrage == "" || (m.ID == c.ClusterConfig(2).ID) != (m.CommandVersion == 5) || m.CommandVersion == 0 {
				return fmt.Errorf("members not all seen yet: %+v", m)
			}
		}
		return nil
	})
	before := c.Agent(leader).FSM().Limits().Version
	_, err := admin.ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: parentKeysLimits})
	wantCode(t, err, codes.FailedPrecondition, "max_keys_per_parent", "fsm command version 6 on every node",
		"node "+c.ClusterConfig(2).ID+" advertises command version 5", "upgrade it first")
	if v := c.Agent(leader).FSM().Limits().Version; v != before {
		t.Fatalf("refused limits were replicated: version %d -> %d", before, v)
	}
	if _, err := admin.ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: strings.ReplaceAll(parentKeysLimits, "max_keys_per_parent: 3", "")}); err != nil {
		t.Fatalf("the same limits without max_keys_per_parent: %v", err)
	}
}

// TestRestoreMaxKeysPerParentNeedsEveryNode: restoring a snapshot whose limits use
// max_keys_per_parent is refused like applying them while a node runs command version 5 (it
// would drop the field from the restored limits): FailedPrecondition naming the node, and the
// state stays as it was.
func TestRestoreMaxKeysPerParentNeedsEveryNode(t *testing.T) {
	ctx := context.Background()
	src := rpctest.Start(t, 1, parentKeysLimits)
	file := filepath.Join(t.TempDir(), "s.snap")
	if _, err := backup.Save(ctx, quotadv1.NewSnapshotClient(dial(t, src.Addrs()[src.WaitLeader(10*time.Second)])), file); err != nil {
		t.Fatal(err)
	}

	c := rpctest.Start(t, 3, waiterTenantLimits, func(i int, cfg *rpc.AgentConfig) {
		if i == 2 {
			cfg.Cluster.AdvertisedCommandVersion = 5
		}
	})
	leader := c.Leader()
	clustertest.Eventually(t, 10*time.Second, func() error {
		for _, m := range c.Agent(leader).Node().Members() {
			if m.Suffrage == "" || (m.ID == c.ClusterConfig(2).ID) != (m.CommandVersion == 5) || m.CommandVersion == 0 {
				return fmt.Errorf("members not all seen yet: %+v", m)
			}
		}
		return nil
	})
	_, err := backup.Restore(ctx, quotadv1.NewSnapshotClient(dial(t, c.Addrs()[leader])), file, false)
	wantCode(t, err, codes.FailedPrecondition, "max_keys_per_parent", "fsm command version 6 on every node",
		"node "+c.ClusterConfig(2).ID+" advertises command version 5", "upgrade it first")
	if l := c.Agent(leader).FSM().Limits(); l.UsesMaxKeysPerParent() {
		t.Fatalf("the refused restore installed the file's limits: %+v", l)
	}
}
