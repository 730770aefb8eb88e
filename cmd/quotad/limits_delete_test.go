package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

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
