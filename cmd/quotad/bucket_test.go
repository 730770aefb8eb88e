package main

import (
	"bytes"
	"context"
	"math"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/rpc/rpctest"
)

const bucketLentLimits = `
domain: api
rate_limit: {unit: second, requests_per_unit: 100}
shares: {lease: 30s}
---
domain: daily
rate_limit: {unit: day, requests_per_unit: 1, burst: 3}
`

// TestBucketStatusSaysWhatIsLent: `quotad bucket status` of a level that lends to share
// holders says how much is lent and what the configured limit is; it printed only the central
// part, so a 100/s level lending 90/s read "rate 10 per 1s" (user trial, session 12), and the
// API (StatusResponse, client.Status) had no field saying otherwise. A day bucket's refill
// time reads as a duration, not "full in 259199965178ms".
func TestBucketStatusSaysWhatIsLent(t *testing.T) {
	c := rpctest.Start(t, 1, bucketLentLimits)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cc, err := grpc.NewClient(c.Addrs()[0], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	q := quotadv1.NewQuotaClient(cc)
	resp, err := q.Share(ctx, &quotadv1.ShareRequest{HolderId: "h", Incarnation: 1, Seq: 1,
		Paths: []*quotadv1.SharePath{{Domain: "api", Demand: math.MaxUint64, MaxCost: 1}}})
	if err != nil || len(resp.Paths) != 1 || resp.Paths[0].Status != "lent" {
		t.Fatalf("share: %v %v", resp, err)
	}
	if _, err := q.Acquire(ctx, &quotadv1.AcquireRequest{ClientId: "c", Admissions: []*quotadv1.Admission{{RequestId: 1, Domain: "daily", Cost: 1}}}); err != nil {
		t.Fatal(err)
	}
	st, err := q.Status(ctx, &quotadv1.StatusRequest{Domain: "api"})
	if err != nil || len(st.Buckets) != 1 {
		t.Fatalf("status: %v %v", st, err)
	}
	if b := st.Buckets[0]; b.LentLimit == 0 || b.Limit+b.LentLimit != 100 || b.Burst+b.LentBurst != 100 {
		t.Fatalf("status of a lent bucket: limit %d + lent %d, burst %d + lent %d; want the lent part and a sum of 100",
			b.Limit, b.LentLimit, b.Burst, b.LentBurst)
	}
	run := func(args ...string) string {
		t.Helper()
		cmd := bucketCmd()
		var out bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetArgs(append([]string{"status", "--addr", c.Addrs()[0]}, args...))
		cmd.SilenceUsage, cmd.SilenceErrors = true, true
		if err := cmd.Execute(); err != nil {
			t.Fatalf("bucket status %v: %v", args, err)
		}
		return out.String()
	}
	if out := run("--domain", "api"); !strings.Contains(out, "lent ") || !strings.Contains(out, "to share holders") || !strings.Contains(out, "of 100 per 1s, burst 100") {
		t.Fatalf("bucket status of a lent level does not say what is lent and the configured limit:\n%s", out)
	}
	if out := run("--domain", "daily"); !strings.Contains(out, "full in 24h0m0s") && !strings.Contains(out, "full in 23h59m") {
		t.Fatalf("bucket status of a day bucket one unit short: want full in about 24h as a duration:\n%s", out)
	}
}

// TestFeedbackNamesThePausedBucket: `quotad feedback` names the bucket it paused, not only
// its level — a typo in a value (endpoint=chrages) matches the wildcard endpoint level and
// pauses a bucket nobody spends from, and "paused scope endpoint for 3000ms" read as the
// endpoint meant being paused (user trial, session 12).
func TestFeedbackNamesThePausedBucket(t *testing.T) {
	c := rpctest.Start(t, 1, `
domain: provider
strict_keys: true
descriptors:
  - key: endpoint
    value: charges
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: endpoint
    rate_limit: {unit: second, requests_per_unit: 50}
`)
	cmd := feedbackCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"--addr", c.Addrs()[0], "--domain", "provider", "--descriptor", "endpoint=chrages", "--status", "429", "--retry-after", "3s"})
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	if got := out.String(); !strings.Contains(got, "paused provider/endpoint=chrages (scope endpoint) for 3000ms") {
		t.Fatalf("feedback output does not name the paused bucket:\n%s", got)
	}
}

// TestTopOnceErrorPrintedOnce: `quotad top --once` that cannot fetch its frame returns the
// error (printed once, on stderr, by main) and writes nothing to stdout; it printed
// "quotad top: <error>" on stdout and then the same error again on stderr (trial: a reader
// token's 403).
func TestTopOnceErrorPrintedOnce(t *testing.T) {
	creds, err := pkifiles.EnsureLocal(filepath.Join(t.TempDir(), "creds"), "quotad")
	if err != nil {
		t.Fatal(err)
	}
	c := rpctest.Start(t, 1, "domain: d\nrate_limit: {unit: second, requests_per_unit: 10}\n", rpctest.Secure(t, creds))
	t.Setenv(client.EnvCACert, creds.CAFile)
	t.Setenv(client.EnvToken, creds.Token)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	admin := workerConn(t, c.Addrs()[0], creds.Token)
	tok, err := quotadv1.NewAdminClient(admin).CreateToken(ctx, &quotadv1.CreateTokenRequest{Role: "reader"})
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(client.EnvToken, tok.Token) // a reader (and no --enable-debug): /debug/fair refuses
	cmd := topCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"--addr", c.Addrs()[0], "--once"})
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	err = cmd.Execute()
	if err == nil || !strings.Contains(err.Error(), "/debug/fair") {
		t.Fatalf("top --once as a reader without --enable-debug: %v, want /debug/fair's refusal", err)
	}
	if out.Len() != 0 {
		t.Fatalf("top --once failed with %v and also wrote to stdout:\n%s", err, out.String())
	}
}
