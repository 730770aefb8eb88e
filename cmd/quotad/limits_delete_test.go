package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

const twoDomains = `domain: keep
rate_limit: {unit: second, requests_per_unit: 100}
---
domain: gone
descriptors:
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 1}
`

// runLimits runs `quotad limits ARGS --addr addr` and returns its stdout and stderr.
func runLimits(t *testing.T, addr string, args ...string) (string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	cmd := limitsCmd()
	cmd.SetArgs(append(args, "--addr", addr))
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	if err := cmd.Execute(); err != nil {
		t.Fatalf("limits %s: %v", strings.Join(args, " "), err)
	}
	return out.String(), errOut.String()
}

// envoyCodes sends Envoy's ShouldRateLimit for tenant acme of domain n times and returns the
// overall codes.
func envoyCodes(t *testing.T, addr, domain string, n int) []rlsv3.RateLimitResponse_Code {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := &rlsv3.RateLimitRequest{Domain: domain, Descriptors: []*rlcommon.RateLimitDescriptor{{
		Entries: []*rlcommon.RateLimitDescriptor_Entry{{Key: "tenant", Value: "acme"}}}}}
	var codes []rlsv3.RateLimitResponse_Code
	for range n {
		r, err := rlsv3.NewRateLimitServiceClient(conn).ShouldRateLimit(ctx, req)
		if err != nil {
			t.Fatalf("ShouldRateLimit(%s): %v", domain, err)
		}
		codes = append(codes, r.OverallCode)
	}
	return codes
}

// TestLimitsDeleteWarnsEnvoyUnlimited: deleting a live domain on nodes with the default
// --rls-unknown-domain allow makes Envoy's traffic for it unlimited (user report: silently).
// The CLI must say so, naming the domain, the flag and what to do — for a dry run too.
func TestLimitsDeleteWarnsEnvoyUnlimited(t *testing.T) {
	c := rpctest.Start(t, 1, twoDomains)
	addr := c.Addrs()[0]
	ok, over := rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OVER_LIMIT
	if got := envoyCodes(t, addr, "gone", 2); got[0] != ok || got[1] != over {
		t.Fatalf("before the delete: %v, want OK then OVER_LIMIT (1 per hour)", got)
	}

	_, stderr := runLimits(t, addr, "delete", "gone", "--dry-run")
	for _, want := range []string{`domain "gone"`, "would be answered OK, NOT rate limited", "--rls-unknown-domain allow", "--rls-unknown-domain deny", "permissive limit"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("dry run's stderr lacks %q:\n%s", want, stderr)
		}
	}
	stdout, stderr := runLimits(t, addr, "delete", "gone")
	if !strings.Contains(stdout, "applied limits version") {
		t.Fatalf("delete did not apply: %s", stdout)
	}
	for _, want := range []string{"warning: ", `domain "gone"`, "are now answered OK, NOT rate limited", "--rls-unknown-domain allow", "--rls-unknown-domain deny", "permissive limit"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("delete's stderr lacks %q:\n%s", want, stderr)
		}
	}
	if strings.Contains(stderr, `"keep"`) {
		t.Errorf("warned about a domain that stays:\n%s", stderr)
	}
	// What the warning says is so: the traffic is no longer limited.
	for i, code := range envoyCodes(t, addr, "gone", 3) {
		if code != ok {
			t.Fatalf("after the delete, request %d: %v, want OK (unlimited)", i, code)
		}
	}
	// A change that removes nothing warns of nothing.
	if _, stderr := runLimits(t, addr, "apply", writeFile(t, "domain: keep\nrate_limit: {unit: second, requests_per_unit: 50}\n")); stderr != "" {
		t.Errorf("an apply that removes no domain warned:\n%s", stderr)
	}
	// --replace-all removes the domains its files do not name: the same warning.
	if _, stderr := runLimits(t, addr, "apply", "--replace-all", writeFile(t, "domain: other\nrate_limit: {unit: second, requests_per_unit: 5}\n")); !strings.Contains(stderr, `domain "keep" removed`) || !strings.Contains(stderr, "NOT rate limited") {
		t.Errorf("apply --replace-all that removed keep: stderr %q, want the warning", stderr)
	}
}

// TestLimitsDeleteWarnsEnvoyDenied: with --rls-unknown-domain deny the removed domain's Envoy
// traffic is refused instead, and the warning says that.
func TestLimitsDeleteWarnsEnvoyDenied(t *testing.T) {
	c := rpctest.Start(t, 1, twoDomains, func(_ int, cfg *rpc.AgentConfig) { cfg.RLS.DenyUnknownDomain = true })
	addr := c.Addrs()[0]
	_, stderr := runLimits(t, addr, "delete", "gone")
	for _, want := range []string{`domain "gone"`, "refused OVER_LIMIT", "--rls-unknown-domain deny", "permissive limit"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr lacks %q:\n%s", want, stderr)
		}
	}
	if strings.Contains(stderr, "NOT rate limited") {
		t.Errorf("deny cluster warned of unlimited traffic:\n%s", stderr)
	}
	if got := envoyCodes(t, addr, "gone", 1); got[0] != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("after the delete on a deny cluster: %v, want OVER_LIMIT", got)
	}
}

func writeFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "limits.yaml")
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestLimitsDeleteAnswerLostThenRetried: `quotad limits delete` retries a call answered
// Unavailable (call does, 2 s a try), also one that committed; the retry then found the
// domain gone and exited 1 "not in force; nothing was changed" while the first try had removed
// it (trial, as pause lift's df06d14). It now says the lost try removed it, exit 0 — and a
// domain that was never there still fails.
func TestLimitsDeleteAnswerLostThenRetried(t *testing.T) {
	var applies atomic.Int32
	var loseAny atomic.Bool // lose the first answer even when it is an error
	lose := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		resp, err := handler(ctx, req)
		if strings.HasSuffix(info.FullMethod, "/ApplyLimits") && applies.Add(1) == 1 && (err == nil || loseAny.Load()) {
			return nil, status.Error(codes.Unavailable, "the answer was lost (test)")
		}
		return resp, err
	}
	c := rpctest.Start(t, 1, twoDomains, func(_ int, cfg *rpc.AgentConfig) {
		cfg.UnaryInterceptors = append(cfg.UnaryInterceptors, lose)
	})
	out, _ := runLimits(t, c.Addrs()[0], "delete", "gone")
	if !strings.Contains(out, "gone") || !strings.Contains(out, "answer was lost") {
		t.Fatalf("limits delete whose first answer was lost after it removed the domain:\n%s", out)
	}
	if n := applies.Load(); n != 2 {
		t.Fatalf("%d ApplyLimits calls, want the lost one and its retry", n)
	}
	cc, err := grpc.NewClient(c.Addrs()[0], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	got, err := quotadv1.NewAdminClient(cc).GetLimits(context.Background(), &quotadv1.GetLimitsRequest{})
	if err != nil || strings.Contains(got.Yaml, "domain: gone") || !strings.Contains(got.Yaml, "domain: keep") {
		t.Fatalf("limits after the delete: %v\n%s", err, got.GetYaml())
	}
	// A domain never there (a typo) still fails, its first answer lost too.
	applies.Store(0)
	loseAny.Store(true)
	cmd := limitsCmd()
	cmd.SetArgs([]string{"delete", "kep", "--addr", c.Addrs()[0]})
	cmd.SetOut(&bytes.Buffer{})
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), "kep") {
		t.Fatalf("limits delete of a domain not in force, its first answer lost: %v, want it refused", err)
	}
	if n := applies.Load(); n != 2 {
		t.Fatalf("%d ApplyLimits calls for the typo, want the lost one and its retry", n)
	}
	// An apply whose first answer was lost: the retry finds nothing left to change and says
	// why instead of a bare "no changes".
	applies.Store(0)
	loseAny.Store(false)
	file := filepath.Join(t.TempDir(), "keep.yaml")
	if err := os.WriteFile(file, []byte("domain: keep\nrate_limit: {unit: second, requests_per_unit: 7}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, _ := runLimits(t, c.Addrs()[0], "apply", file); !strings.Contains(out, "no changes left to make") || !strings.Contains(out, "answer was lost") {
		t.Fatalf("limits apply whose first answer was lost:\n%s", out)
	}
}
