package rpc_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc/rpctest"
)

const feedbackLimits = `
domain: provider
rate_limit: {unit: second, requests_per_unit: 1000}
adaptive: {floor: 100, decrease_percent: 50, increase: 10, stable_window: 1h}
retry_budget: {ratio_percent: 10}
resume_jitter: 2s
descriptors:
  - key: endpoint
    value: charges
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: endpoint
    value: search
    rate_limit: {unit: second, requests_per_unit: 100}
`

// TestFeedbackPausesOneEndpointAcrossFailover: a provider 429 (with its reason header) on one
// endpoint pauses that endpoint only, with the pause spread by jitter; a 429 without a reason
// for the whole domain pauses nothing; the pause and the adapted ceiling survive a leader kill.
func TestFeedbackPausesOneEndpointAcrossFailover(t *testing.T) {
	c := rpctest.Start(t, 3, feedbackLimits)
	ctx := context.Background()
	leader := c.Leader()
	follower := (leader + 1) % 3
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[follower])) // forwarded to the leader

	charges := []*quotadv1.Entry{{Key: "endpoint", Value: "charges"}}
	resp, err := q.Feedback(ctx, &quotadv1.FeedbackRequest{Domain: "provider", Descriptors: charges,
		StatusCode: 429, RetryAfterMs: 30_000, Reason: "endpoint-rate-limited"})
	if err != nil || resp.Scope != "endpoint" || resp.PausedForMs != 30_000 || !resp.Attributed {
		t.Fatalf("feedback: %+v %v", resp, err)
	}
	// No reason, whole domain: evidence only.
	resp, err = q.Feedback(ctx, &quotadv1.FeedbackRequest{Domain: "provider", StatusCode: 429, RetryAfterMs: 30_000})
	if err != nil || resp.Attributed || resp.PausedForMs != 0 || resp.Limit != 1000 {
		t.Fatalf("429 without a reason for the domain: %+v %v, want nothing paused", resp, err)
	}
	// A confirmed global 429 without Retry-After halves the adaptive ceiling, pausing nothing.
	resp, err = q.Feedback(ctx, &quotadv1.FeedbackRequest{Domain: "provider", StatusCode: 429, Reason: "global"})
	if err != nil || !resp.Decreased || resp.Limit != 500 || resp.PausedForMs != 0 {
		t.Fatalf("confirmed global 429: %+v %v", resp, err)
	}

	check := func(q quotadv1.QuotaClient, id uint64) {
		t.Helper()
		d, err := acquireOne(ctx, q, "w", admission(id, 1, "endpoint=charges"))
		if err != nil {
			t.Fatal(err)
		}
		if d.Reason != "paused" || d.Scope != "endpoint" || d.RetryAfterMs < 15_000 || d.RetryAfterMs > 32_000 {
			t.Fatalf("charges: %+v, want paused at scope endpoint for about 30s (+ up to 2s jitter)", d)
		}
		if d, err := acquireOne(ctx, q, "w", admission(id+1, 1, "endpoint=search")); err != nil || !d.Admitted {
			t.Fatalf("search should not be paused: %+v %v", d, err)
		}
	}
	check(q, 1)
	spread := map[int64]bool{}
	for id := uint64(10); id < 30; id++ {
		d, err := acquireOne(ctx, q, "w", admission(id, 1, "endpoint=charges"))
		if err != nil {
			t.Fatal(err)
		}
		spread[d.RetryAfterMs] = true
	}
	if len(spread) < 15 {
		t.Errorf("20 paused requests got only %d distinct retry_after values; resumption is not spread", len(spread))
	}

	c.Kill(leader)
	q2 := quotadv1.NewQuotaClient(dial(t, c.Addrs()[(leader+2)%3]))
	clustertest.Eventually(t, 5*time.Second, func() error {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		_, err := acquireOne(cctx, q2, "w", admission(100, 1, "endpoint=search"))
		return err
	})
	check(q2, 200)
	st, err := q2.Status(ctx, &quotadv1.StatusRequest{Domain: "provider"})
	if err != nil || st.Buckets[0].Limit != 500 {
		t.Fatalf("adapted ceiling after failover: %+v %v, want 500", st, err)
	}
}

func TestFeedbackAndRetryBudgetValidation(t *testing.T) {
	c := rpctest.Start(t, 1, feedbackLimits)
	ctx := context.Background()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[0]))
	for _, tc := range []struct {
		req  *quotadv1.FeedbackRequest
		code codes.Code
	}{
		{&quotadv1.FeedbackRequest{Domain: "provider", StatusCode: 500}, codes.InvalidArgument},
		{&quotadv1.FeedbackRequest{Domain: "provider"}, codes.InvalidArgument},
		{&quotadv1.FeedbackRequest{Domain: "nope", StatusCode: 429, Reason: "x"}, codes.NotFound},
		{&quotadv1.FeedbackRequest{Domain: "provider", StatusCode: 429, Descriptors: []*quotadv1.Entry{{Key: "endpoint", Value: "x"}, {Key: "y"}}}, codes.InvalidArgument},
	} {
		if _, err := q.Feedback(ctx, tc.req); status.Code(err) != tc.code {
			t.Errorf("%v: %v, want %v", tc.req, err, tc.code)
		}
	}
	// Retry budget: starts with 10 retries; the 11th is refused with its reason.
	for id := uint64(1); id <= 11; id++ {
		a := admission(id, 1, "endpoint=search")
		a.Attempt = 2
		d, err := acquireOne(ctx, q, "r", a)
		if err != nil {
			t.Fatal(err)
		}
		if want := id <= 10; d.Admitted != want || (!want && (d.Reason != "retry_budget_exhausted" || d.Scope != "domain")) {
			t.Fatalf("retry %d: %+v", id, d)
		}
	}
}
