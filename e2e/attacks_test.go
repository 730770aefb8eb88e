package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/internal/proccluster"
)

const attackLimits = `domain: provider
max_pause: 2m
descriptors:
  - key: endpoint
    value: reports
    concurrency: {max_in_flight: 4, lease_ttl: 30s}
  - key: endpoint
    value: search
    rate_limit: {unit: second, requests_per_unit: 100}
    descriptors:
      - key: tenant
        rate_limit: {unit: second, requests_per_unit: 50}
`

// TestCallerAttacksAreRefused replays, against agent processes of a secure cluster, the
// caller-side attacks issue 11 measured on the old cluster: anyone applying limits, a worker
// releasing another's lease (IDs are sequential), 10-year leases, an hour-long domain pause
// through Feedback with no way to lift it, spending as another tenant, a request ID reused for
// a different request, and the debug endpoints open to anyone. Each must be refused and change
// nothing.
func TestCallerAttacksAreRefused(t *testing.T) {
	c := startClusterWith(t, 3, attackLimits)
	waitFor(t, 20*time.Second, "every node to have the limits", func() bool {
		for i := range c.Nodes {
			if s, err := c.State(context.Background(), i); err != nil || s.LimitsVersion == 0 {
				return false
			}
		}
		return true
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	// A connection that authenticates the server only (the CA), as a token caller has.
	pool := x509.NewCertPool()
	ca, err := os.ReadFile(c.Credentials().CAFile)
	if err != nil {
		t.Fatal(err)
	}
	pool.AppendCertsFromPEM(ca)
	anon, err := grpc.NewClient(c.Nodes[0].GRPCAddr, grpc.WithTransportCredentials(credentials.NewTLS(
		&tls.Config{RootCAs: pool, ServerName: auth.ServerName(proccluster.ClusterName)})))
	if err != nil {
		t.Fatal(err)
	}
	defer anon.Close()
	as := func(token string) context.Context {
		if token == "" {
			return ctx
		}
		return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	q, adm := quotadv1.NewQuotaClient(anon), quotadv1.NewAdminClient(anon)
	admin := c.Credentials().Token

	// 1. Anyone applying limits.
	apply := &quotadv1.ApplyLimitsRequest{Yaml: "domain: provider\n"}
	if _, err := adm.ApplyLimits(as(""), apply); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("ApplyLimits without a credential: %v, want Unauthenticated", err)
	}
	token := func(role string, domains []string, tenant string) string {
		t.Helper()
		r, err := adm.CreateToken(as(admin), &quotadv1.CreateTokenRequest{Role: role, Domains: domains, Tenant: tenant})
		if err != nil {
			t.Fatalf("create %s token: %v", role, err)
		}
		return r.Token
	}
	alice, bob := token("worker", []string{"provider"}, ""), token("worker", []string{"provider"}, "")
	acme, reader := token("worker", []string{"provider"}, "acme"), token("reader", nil, "")
	if _, err := adm.ApplyLimits(as(alice), apply); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("ApplyLimits as a worker: %v, want PermissionDenied", err)
	}

	acquire := func(who string, reqID uint64, ttlMs int64, descs ...string) (*quotadv1.Decision, error) {
		adm := &quotadv1.Admission{RequestId: reqID, Domain: "provider", LeaseTtlMs: ttlMs}
		for i := 0; i+1 < len(descs); i += 2 {
			adm.Descriptors = append(adm.Descriptors, &quotadv1.Entry{Key: descs[i], Value: descs[i+1]})
		}
		r, err := q.Acquire(as(who), &quotadv1.AcquireRequest{ClientId: "attack", Admissions: []*quotadv1.Admission{adm}})
		if err != nil {
			return nil, err
		}
		return r.Decisions[0], nil
	}

	acquireWaiting := func(who string, reqID uint64, descs ...string) (*quotadv1.Decision, error) {
		adm := &quotadv1.Admission{RequestId: reqID, Domain: "provider", MaxWaitMs: 2000}
		for i := 0; i+1 < len(descs); i += 2 {
			adm.Descriptors = append(adm.Descriptors, &quotadv1.Entry{Key: descs[i], Value: descs[i+1]})
		}
		r, err := q.Acquire(as(who), &quotadv1.AcquireRequest{ClientId: "attack-wait", Admissions: []*quotadv1.Admission{adm}})
		if err != nil {
			return nil, err
		}
		return r.Decisions[0], nil
	}

	// 2. A 10-year lease is clamped to the limit's lease_ttl.
	tenYears := int64(10 * 365 * 24 * time.Hour / time.Millisecond)
	d, err := acquire(alice, 1, tenYears, "endpoint", "reports")
	if err != nil || !d.Admitted || d.LeaseId == 0 {
		t.Fatalf("alice's lease: %+v %v", d, err)
	}
	if d.LeaseTtlMs > 30_000 {
		t.Fatalf("a lease asked for 10 years was granted %d ms, want at most the configured 30 s", d.LeaseTtlMs)
	}

	// 3. Another worker cannot release it (the lease stays held); its owner can.
	if _, err := q.Release(as(bob), &quotadv1.ReleaseRequest{LeaseId: d.LeaseId}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("bob releasing alice's lease: %v, want PermissionDenied", err)
	}
	st, err := q.Status(as(reader), &quotadv1.StatusRequest{Domain: "provider", Descriptors: []*quotadv1.Entry{{Key: "endpoint", Value: "reports"}}})
	held := false
	for _, b := range st.GetBuckets() {
		held = held || (b.Scope == "endpoint" && b.InFlight == 1)
	}
	if err != nil || !held {
		t.Fatalf("after bob's release attempt the permit must still be held: %+v %v", st, err)
	}
	if r, err := q.Release(as(alice), &quotadv1.ReleaseRequest{LeaseId: d.LeaseId}); err != nil || !r.Released {
		t.Fatalf("alice releasing her lease: %+v %v", r, err)
	}

	// 3b. The same for a lease granted through the fair scheduler (a waiting admission): its
	// grant batches carry the owner too.
	// Fill the 4 permits, queue a waiting admission, then free one: the scheduler grants it.
	var full []uint64
	for i := range 4 {
		d, err := acquire(alice, uint64(20+i), 0, "endpoint", "reports")
		if err != nil || !d.Admitted {
			t.Fatalf("permit %d: %+v %v", i, d, err)
		}
		full = append(full, d.LeaseId)
	}
	type waited struct {
		d   *quotadv1.Decision
		err error
	}
	wch := make(chan waited, 1)
	go func() { d, err := acquireWaiting(alice, 11, "endpoint", "reports"); wch <- waited{d, err} }()
	time.Sleep(300 * time.Millisecond) // let it queue on the leader
	if r, err := q.Release(as(alice), &quotadv1.ReleaseRequest{LeaseId: full[0]}); err != nil || !r.Released {
		t.Fatalf("freeing a permit: %+v %v", r, err)
	}
	w := <-wch
	wd, err := w.d, w.err
	if err != nil || !wd.Admitted || wd.LeaseId == 0 {
		t.Fatalf("alice's waiting acquire: %+v %v", wd, err)
	}
	defer func() {
		for _, id := range full[1:] {
			_, _ = q.Release(as(alice), &quotadv1.ReleaseRequest{LeaseId: id})
		}
	}()
	if _, err := q.Release(as(bob), &quotadv1.ReleaseRequest{LeaseId: wd.LeaseId}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("bob releasing alice's scheduled lease: %v, want PermissionDenied", err)
	}
	if r, err := q.Release(as(alice), &quotadv1.ReleaseRequest{LeaseId: wd.LeaseId}); err != nil || !r.Released {
		t.Fatalf("alice releasing her scheduled lease: %+v %v", r, err)
	}

	// 4. An hour-long pause through Feedback is clamped to max_pause, and an admin lifts it.
	fb, err := q.Feedback(as(alice), &quotadv1.FeedbackRequest{Domain: "provider", StatusCode: 429, RetryAfterMs: int64(time.Hour / time.Millisecond), Reason: "app-rate-limit"})
	if err != nil {
		t.Fatalf("feedback: %v", err)
	}
	if fb.PausedForMs <= 0 || fb.PausedForMs > 120_000 {
		t.Fatalf("a Retry-After of 1h paused the domain for %d ms, want (0, 2m]", fb.PausedForMs)
	}
	if d, err := acquire(alice, 2, 0, "endpoint", "search"); err != nil || d.Admitted || d.Reason != "paused" {
		t.Fatalf("while paused: %+v %v, want reason paused", d, err)
	}
	if _, err := adm.LiftPause(as(alice), &quotadv1.LiftPauseRequest{Domain: "provider"}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a worker lifting a pause: %v, want PermissionDenied", err)
	}
	if r, err := adm.LiftPause(as(admin), &quotadv1.LiftPauseRequest{Domain: "provider"}); err != nil || !r.Lifted {
		t.Fatalf("admin lifting the pause: %+v %v", r, err)
	}
	if d, err := acquire(alice, 3, 0, "endpoint", "search"); err != nil || !d.Admitted {
		t.Fatalf("after the lift: %+v %v", d, err)
	}

	// 5. A worker bound to tenant acme cannot spend as another tenant; a reader cannot spend.
	if _, err := acquire(acme, 1, 0, "endpoint", "search", "tenant", "globex"); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("acme's worker spending as globex: %v, want PermissionDenied", err)
	}
	if d, err := acquire(acme, 2, 0, "endpoint", "search", "tenant", "acme"); err != nil || !d.Admitted {
		t.Fatalf("acme's worker spending as acme: %+v %v", d, err)
	}
	// ... nor skip its own level with an entry the limits do not define before it (the walk
	// stops there and would charge only the domain ceiling).
	for i, path := range [][]string{{"bogus", "x", "tenant", "acme"}, {"endpoint", "search", "bogus", "x", "tenant", "acme"}} {
		if _, err := acquire(acme, uint64(30+i), 0, path...); status.Code(err) != codes.PermissionDenied {
			t.Fatalf("acme's worker sending %v: %v, want PermissionDenied", path, err)
		}
	}
	if _, err := acquire(reader, 1, 0, "endpoint", "search"); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a reader spending: %v, want PermissionDenied", err)
	}

	// 6. A request ID reused for a different request is a conflict, not the old decision.
	if d, err := acquire(alice, 3, 0, "endpoint", "search", "tenant", "initech"); err == nil && (d.Admitted || d.Reason != "request_id_conflict") {
		t.Fatalf("request ID 3 reused for another request: %+v, want request_id_conflict", d)
	} else if err != nil && !strings.Contains(err.Error(), "request_id_conflict") {
		t.Fatalf("request ID 3 reused for another request: %v, want request_id_conflict", err)
	}

	// 7. Debug endpoints need the admin credential; /metrics does not.
	hc := c.HTTPClient()
	for _, path := range []string{"/debug/state?hash=1", "/debug/pprof/cmdline"} {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, c.URL(0, path), nil)
		// HTTPClient presents the admin certificate; strip it with a CA-only client.
		anonHTTP := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: auth.ServerName(proccluster.ClusterName)}}}
		resp, err := anonHTTP.Do(req)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Fatalf("GET %s without a credential: %d, want 401", path, resp.StatusCode)
		}
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, c.URL(0, "/metrics"), nil)
	if resp, err := hc.Do(req); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %v %v", resp, err)
	}
}
