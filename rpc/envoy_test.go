package rpc_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/rpc"
)

const rlsLimits = `
domain: platform
rate_limit: {unit: minute, requests_per_unit: 100}
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 5}
    descriptors:
      - key: consumer
        rate_limit: {unit: minute, requests_per_unit: 2, name: consumer}
  - key: path
    value: files/*
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: banned
    rate_limit: {unit: minute, requests_per_unit: 0}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
---
domain: other
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1}
`

func rlsReq(domain string, descs ...[]string) *rlsv3.RateLimitRequest {
	r := &rlsv3.RateLimitRequest{Domain: domain}
	for _, kv := range descs {
		d := &rlcommon.RateLimitDescriptor{}
		for i := 0; i+1 < len(kv); i += 2 {
			d.Entries = append(d.Entries, &rlcommon.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
		}
		r.Descriptors = append(r.Descriptors, d)
	}
	return r
}

func rlsCodes(r *rlsv3.RateLimitResponse) []rlsv3.RateLimitResponse_Code {
	out := []rlsv3.RateLimitResponse_Code{r.OverallCode}
	for _, s := range r.Statuses {
		out = append(out, s.Code)
	}
	return out
}

func wantRLS(t *testing.T, r *rlsv3.RateLimitResponse, err error, want ...rlsv3.RateLimitResponse_Code) {
	t.Helper()
	if err != nil {
		t.Fatalf("ShouldRateLimit: %v", err)
	}
	got := rlsCodes(r)
	if len(got) != len(want) {
		t.Fatalf("codes %v, want %v", got, want)
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("codes %v, want %v (%v)", got, want, r)
		}
	}
}

// TestRLSSecureCluster: Envoy's ShouldRateLimit on the agents' gRPC port, mTLS client
// certificate with the worker role for the domain, through the leader and a follower (which
// forwards), with Envoy's meaning; per-rule statistics on the leader's /metrics.
func TestRLSSecureCluster(t *testing.T) {
	c, p := authCluster(t, rlsLimits, func(_ int, cfg *rpc.AgentConfig) {
		cfg.RLS = rpc.RLSOptions{Headers: rpc.RLSHeadersXRateLimit, AllowLimitOverride: true}
	})
	p.client(auth.Identity{Name: "envoy", Role: auth.RoleWorker, Domains: []string{"platform"}})
	p.client(auth.Identity{Name: "reader", Role: auth.RoleReader})
	leader := c.Leader()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	viaLeader := rlsv3.NewRateLimitServiceClient(p.dialAs(c.Addrs()[leader], "envoy"))
	viaFollower := rlsv3.NewRateLimitServiceClient(p.dialAs(c.Addrs()[(leader+1)%3], "envoy"))
	ok, over := rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OVER_LIMIT

	// Authentication and authorization as for every call.
	_, err := rlsv3.NewRateLimitServiceClient(p.dialAs(c.Addrs()[leader], "")).ShouldRateLimit(ctx, rlsReq("platform", []string{"tenant", "a"}))
	wantCode(t, err, codes.Unauthenticated)
	_, err = rlsv3.NewRateLimitServiceClient(p.dialAs(c.Addrs()[leader], "reader")).ShouldRateLimit(ctx, rlsReq("platform", []string{"tenant", "a"}))
	wantCode(t, err, codes.PermissionDenied, "worker")
	_, err = viaFollower.ShouldRateLimit(ctx, rlsReq("other", []string{"k", "1"}))
	wantCode(t, err, codes.PermissionDenied, `may not use domain "other"`)
	_, err = viaLeader.ShouldRateLimit(ctx, rlsReq("platform"))
	wantCode(t, err, codes.InvalidArgument, "no descriptors")

	// The last entry's rule only: two per consumer, the tenant's five untouched.
	consumer := []string{"tenant", "acme", "consumer", "app"}
	r, err := viaFollower.ShouldRateLimit(ctx, rlsReq("platform", consumer))
	wantRLS(t, r, err, ok, ok)
	if st := r.Statuses[0]; st.CurrentLimit.GetRequestsPerUnit() != 2 || st.CurrentLimit.GetUnit() != rlsv3.RateLimitResponse_RateLimit_MINUTE ||
		st.CurrentLimit.GetName() != "consumer" || st.LimitRemaining != 1 || st.DurationUntilReset.AsDuration() != 30*time.Second {
		t.Errorf("status %v: want 2/MINUTE named consumer, 1 remaining, reset in 30s", st)
	}
	r, err = viaLeader.ShouldRateLimit(ctx, rlsReq("platform", consumer))
	wantRLS(t, r, err, ok, ok)
	r, err = viaFollower.ShouldRateLimit(ctx, rlsReq("platform", consumer, []string{"tenant", "acme"}))
	wantRLS(t, r, err, over, over, ok)
	headers := map[string]string{}
	for _, h := range r.ResponseHeadersToAdd {
		headers[h.Key] = h.Value
	}
	if headers["X-RateLimit-Limit"] != "2" || headers["X-RateLimit-Remaining"] != "0" || headers["X-RateLimit-Scope"] != "consumer" || headers["X-RateLimit-Reset"] != "60" {
		t.Errorf("headers %v: want the consumer's limit 2, remaining 0, reset 60, scope consumer", headers)
	}

	// Wildcards, blocked values, shadow mode, deeper than config, unknown domain.
	r, err = viaLeader.ShouldRateLimit(ctx, rlsReq("platform", []string{"path", "files/a"}, []string{"path", "files/b"}))
	wantRLS(t, r, err, ok, ok, ok)
	r, err = viaLeader.ShouldRateLimit(ctx, rlsReq("platform", []string{"path", "files/a"}))
	wantRLS(t, r, err, over, over)
	r, err = viaLeader.ShouldRateLimit(ctx, rlsReq("platform", []string{"banned", "x"}))
	wantRLS(t, r, err, over, over)
	for range 3 {
		r, err = viaLeader.ShouldRateLimit(ctx, rlsReq("platform", []string{"shadow", "x"}))
		wantRLS(t, r, err, ok, ok)
	}
	for range 3 {
		r, err = viaLeader.ShouldRateLimit(ctx, rlsReq("platform", []string{"tenant", "b", "consumer", "c", "deeper", "1"}))
		wantRLS(t, r, err, ok, ok)
	}
	// hits_addend: 0 checks without charging.
	check := rlsReq("platform", []string{"tenant", "z", "consumer", "c"})
	check.Descriptors[0].HitsAddend = wrapperspb.UInt64(0)
	for range 3 {
		r, err = viaLeader.ShouldRateLimit(ctx, check)
		wantRLS(t, r, err, ok, ok)
	}
	big := rlsReq("platform", []string{"tenant", "z", "consumer", "c"})
	big.HitsAddend = 3
	r, err = viaLeader.ShouldRateLimit(ctx, big)
	wantRLS(t, r, err, over, over)

	// A descriptor's own limit (Envoy's override) travels in the log op, via a follower too;
	// UNKNOWN units and is_negative_hits are refused.
	ovr := rlsReq("platform", []string{"tenant", "o", "consumer", "c", "deeper", "1"})
	ovr.Descriptors[0].Limit = &rlcommon.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 1, Unit: typev3.RateLimitUnit_HOUR}
	r, err = viaFollower.ShouldRateLimit(ctx, ovr)
	wantRLS(t, r, err, ok, ok)
	if st := r.Statuses[0]; st.CurrentLimit.GetRequestsPerUnit() != 1 || st.CurrentLimit.GetUnit() != rlsv3.RateLimitResponse_RateLimit_HOUR || st.CurrentLimit.GetName() != "" {
		t.Errorf("override status %v: want 1/HOUR without a name", st)
	}
	r, err = viaLeader.ShouldRateLimit(ctx, ovr)
	wantRLS(t, r, err, over, over)
	// The rule's own limit shares the rule's bucket (one hit by the rule, one by the override).
	same := rlsReq("platform", []string{"tenant", "s", "consumer", "c"})
	r, err = viaLeader.ShouldRateLimit(ctx, same)
	wantRLS(t, r, err, ok, ok)
	same.Descriptors[0].Limit = &rlcommon.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 2, Unit: typev3.RateLimitUnit_MINUTE}
	r, err = viaFollower.ShouldRateLimit(ctx, same)
	wantRLS(t, r, err, ok, ok)
	if st := r.Statuses[0]; st.LimitRemaining != 0 {
		t.Errorf("override of the rule's own limit: %v, want the rule's bucket (0 remaining)", st)
	}
	ovr.Descriptors[0].Limit.Unit = typev3.RateLimitUnit_UNKNOWN
	_, err = viaFollower.ShouldRateLimit(ctx, ovr)
	wantCode(t, err, codes.InvalidArgument, "descriptors[0].limit.unit")
	neg := rlsReq("platform", []string{"tenant", "a"})
	neg.Descriptors[0].IsNegativeHits = true
	_, err = viaLeader.ShouldRateLimit(ctx, neg)
	wantCode(t, err, codes.InvalidArgument, "is_negative_hits")

	// Statistics on the leader (where every decision is made).
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: p.pool}}}
	resp, err := hc.Get("https://" + c.Agent(leader).HTTPAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics: %s", resp.Status)
	}
	for _, want := range []string{
		`quotad_rate_limit_total_hits_total{domain="platform",key="tenant.consumer"} 7`,
		`quotad_rate_limit_over_limit_total{domain="platform",key="tenant.consumer"} 2`,
		`quotad_rate_limit_within_limit_total{domain="platform",key="tenant.consumer"} 3`,
		`quotad_rate_limit_near_limit_total{domain="platform",key="tenant.consumer"} 2`,
		`quotad_rate_limit_over_limit_total{domain="platform",key="banned"} 1`,
		`quotad_rate_limit_shadow_mode_total{domain="platform",key="shadow"} 2`,
		`quotad_rate_limit_total_hits_total{domain="platform",key="path_files/*"} 3`,
		`quotad_rate_limit_over_limit_total{domain="platform",key="tenant_o.consumer_c.deeper_1"} 1`,
		`quotad_rls_requests_total{code="over_limit"} 5`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

// TestRLSUnknownDomain: OK by default (Envoy's answer), OVER_LIMIT when configured to deny;
// either way the requests count as quotad_rls_requests_total{code="unknown_domain"} and the
// leader logs the domain once per interval, not once per request (user trial: an unknown
// domain was answered OK and nothing recorded it).
func TestRLSUnknownDomain(t *testing.T) {
	for _, deny := range []bool{false, true} {
		var logs lockedBuffer
		c, p := authCluster(t, rlsLimits, func(i int, cfg *rpc.AgentConfig) {
			cfg.RLS.DenyUnknownDomain = deny
			cfg.Cluster.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn})).With("node", i)
		})
		p.client(auth.Identity{Name: "gw", Role: auth.RoleWorker, Domains: []string{"nope"}})
		leader := c.Leader()
		cl := rlsv3.NewRateLimitServiceClient(p.dialAs(c.Addrs()[leader], "gw"))
		want := rlsv3.RateLimitResponse_OK
		if deny {
			want = rlsv3.RateLimitResponse_OVER_LIMIT
		}
		for range 3 {
			r, err := cl.ShouldRateLimit(context.Background(), rlsReq("nope", []string{"a", "b"}))
			wantRLS(t, r, err, want, want)
		}
		body := httpsGet(t, p, c.Agent(leader).HTTPAddr(), "/metrics")
		if !strings.Contains(body, `quotad_rls_requests_total{code="unknown_domain"} 3`) {
			t.Errorf("deny=%v: /metrics lacks quotad_rls_requests_total{code=\"unknown_domain\"} 3", deny)
		}
		if n := strings.Count(logs.String(), "domain=nope"); n != 1 {
			t.Errorf("deny=%v: %d log lines name domain=nope, want 1 (rate-limited):\n%s", deny, n, logs.String())
		}
	}
}

// lockedBuffer is a bytes.Buffer safe for the concurrent writes of several agents' loggers.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// httpsGet returns the body of path on a TLS agent's HTTP port.
func httpsGet(t *testing.T, p *pki, addr, path string) string {
	t.Helper()
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: p.pool}}}
	resp, err := hc.Get("https://" + addr + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %s", path, resp.Status)
	}
	return string(body)
}

// TestRLSLimitOverrideOffByDefault: without --rls-limit-overrides a descriptor's own limit is
// refused (review: a worker bound to one tenant raised its 5/min limit to a million/s with it),
// on the leader and through a follower, and the refused request charged nothing.
func TestRLSLimitOverrideOffByDefault(t *testing.T) {
	c, p := authCluster(t, rlsLimits)
	p.client(auth.Identity{Name: "envoy", Role: auth.RoleWorker, Domains: []string{"platform"}, Tenant: "acme"})
	leader := c.Leader()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	ovr := rlsReq("platform", []string{"tenant", "acme"})
	ovr.Descriptors[0].Limit = &rlcommon.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 1000000, Unit: typev3.RateLimitUnit_SECOND}
	for _, i := range []int{leader, (leader + 1) % 3} {
		_, err := rlsv3.NewRateLimitServiceClient(p.dialAs(c.Addrs()[i], "envoy")).ShouldRateLimit(ctx, ovr)
		wantCode(t, err, codes.PermissionDenied, "--rls-limit-overrides")
	}
	// tenant: 5/min, untouched by the refused calls.
	cl := rlsv3.NewRateLimitServiceClient(p.dialAs(c.Addrs()[leader], "envoy"))
	for i := range 6 {
		r, err := cl.ShouldRateLimit(ctx, rlsReq("platform", []string{"tenant", "acme"}))
		want := rlsv3.RateLimitResponse_OK
		if i == 5 {
			want = rlsv3.RateLimitResponse_OVER_LIMIT
		}
		wantRLS(t, r, err, want, want)
	}
}

// rlsForwardLimits: every tenant 5 per minute, under a roomy domain ceiling.
const rlsForwardLimits = `
domain: platform
rate_limit: {unit: minute, requests_per_unit: 1000000}
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 5}
    descriptors:
      - key: consumer
        rate_limit: {unit: minute, requests_per_unit: 1000}
---
domain: other
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1}
`

// TestRLSForwardBatchesKeepCallers: concurrent Envoy calls through a follower go to the
// leader in shared ForwardRateLimit RPCs (fewer RPCs than calls), and every call in a batch
// keeps its own caller and its own answer: a certificate caller's domain scope, a
// tenant-bound token's tenant, and each request's hits_addend are decided per call.
func TestRLSForwardBatchesKeepCallers(t *testing.T) {
	bootstrapFile := filepath.Join(t.TempDir(), "bootstrap")
	bootstrap, _, err := auth.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bootstrapFile, []byte(bootstrap+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, p := authCluster(t, rlsForwardLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.BootstrapTokenFile = bootstrapFile })
	p.client(auth.Identity{Name: "envoy", Role: auth.RoleWorker, Domains: []string{"platform"}})
	p.client(auth.Identity{Name: "stranger", Role: auth.RoleWorker, Domains: []string{"other"}})
	leader := c.Leader()
	follower := c.Addrs()[(leader+1)%3]
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tok, err := quotadv1.NewAdminClient(p.dialAs(c.Addrs()[leader], "")).CreateToken(
		metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+bootstrap),
		&quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"platform"}, Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	// The follower must know the token before the burst (it authenticates the call first).
	tokCtx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok.Token)
	viaFollower := func(name string) rlsv3.RateLimitServiceClient {
		return rlsv3.NewRateLimitServiceClient(p.dialAs(follower, name))
	}
	envoy, stranger, token := viaFollower("envoy"), viaFollower("stranger"), viaFollower("")
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := token.ShouldRateLimit(tokCtx, rlsReq("platform", []string{"tenant", "acme", "consumer", "warm"}))
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the token never worked through the follower: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}

	const nEnvoy, nStranger, nToken = 150, 30, 30
	start := make(chan struct{})
	errs := make(chan string, nEnvoy+nStranger+nToken)
	var wg sync.WaitGroup
	for i := range nEnvoy {
		wg.Go(func() {
			<-start
			// Tenant t<i> is fresh: 5 per minute, this call spends h of them.
			h := uint32(i%5 + 1)
			req := rlsReq("platform", []string{"tenant", fmt.Sprintf("t%d", i)})
			req.HitsAddend = h
			r, err := envoy.ShouldRateLimit(ctx, req)
			switch {
			case err != nil:
				errs <- fmt.Sprintf("envoy call %d: %v", i, err)
			case r.OverallCode != rlsv3.RateLimitResponse_OK || r.Statuses[0].LimitRemaining != 5-h ||
				r.Statuses[0].CurrentLimit.GetRequestsPerUnit() != 5:
				errs <- fmt.Sprintf("envoy call %d (hits %d): %v; want OK with %d of 5 remaining", i, h, r, 5-h)
			}
		})
	}
	for i := range nStranger {
		wg.Go(func() {
			<-start
			_, err := stranger.ShouldRateLimit(ctx, rlsReq("platform", []string{"tenant", "x"}))
			if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), `may not use domain "platform"`) {
				errs <- fmt.Sprintf("stranger call %d: %v; want PermissionDenied (domain)", i, err)
			}
		})
	}
	for i := range nToken {
		wg.Go(func() {
			<-start
			tenant := []string{"acme", "bob"}[i%2]
			_, err := token.ShouldRateLimit(tokCtx, rlsReq("platform", []string{"tenant", tenant, "consumer", fmt.Sprint(i)}))
			switch {
			case tenant == "acme" && err != nil:
				errs <- fmt.Sprintf("token call %d for its own tenant: %v", i, err)
			case tenant == "bob" && (status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "may act only for tenant=acme")):
				errs <- fmt.Sprintf("token call %d for another tenant: %v; want PermissionDenied (tenant)", i, err)
			}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}

	// The follower's counters: every call forwarded, in fewer RPCs.
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: p.pool}}}
	resp, err := hc.Get("https://" + c.Agent((leader+1)%3).HTTPAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	metric := func(name string) float64 {
		for _, l := range strings.Split(string(body), "\n") {
			if v, ok := strings.CutPrefix(l, name+" "); ok {
				f, _ := strconv.ParseFloat(v, 64)
				return f
			}
		}
		t.Fatalf("/metrics lacks %s", name)
		return 0
	}
	calls, batches := metric("quotad_rls_forwarded_total"), metric("quotad_rls_forward_batches_total")
	if total := float64(nEnvoy + nStranger + nToken); calls < total || batches >= total {
		t.Errorf("follower forwarded %v calls in %v RPCs; want all %v calls (+ warm-up) in fewer RPCs than calls", calls, batches, total)
	}
	t.Logf("%v calls forwarded in %v RPCs", calls, batches)
}

// TestRLSForwardNeedsServerRole: a client cannot call the peers' ForwardRateLimit to act as
// someone else: the method needs a server certificate, and the principal it names is believed
// from nobody else.
func TestRLSForwardNeedsServerRole(t *testing.T) {
	c, p := authCluster(t, rlsLimits)
	p.client(auth.Identity{Name: "envoy", Role: auth.RoleWorker, Domains: []string{"other"}})
	data, err := proto.Marshal(rlsReq("platform", []string{"tenant", "a"}))
	if err != nil {
		t.Fatal(err)
	}
	claim := auth.EncodePrincipal(auth.Identity{Name: "gw", Role: auth.RoleAdmin})
	_, err = quotadv1.NewPeerClient(p.dialAs(c.Addrs()[c.Leader()], "envoy")).ForwardRateLimit(context.Background(),
		&quotadv1.ForwardRateLimitRequest{Calls: []*quotadv1.ForwardedCall{{Request: data, Principal: claim}}})
	wantCode(t, err, codes.PermissionDenied, "server")
}
