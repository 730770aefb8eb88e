package main

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// TestPauseLiftAnswerLostThenRetried: the first LiftPause commits (the pause ends) but its
// answer is lost; the CLI's retry finds no pause on the path. That is the lift having
// worked, so `pause lift` must not exit 1 saying "nothing was lifted" (as it does for a path
// that had no pause): it says an earlier try may have lifted it and exits 0, as `members
// remove` does for its own retry.
func TestPauseLiftAnswerLostThenRetried(t *testing.T) {
	var lifts atomic.Int32
	lose := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		resp, err := handler(ctx, req)
		if err == nil && strings.HasSuffix(info.FullMethod, "/LiftPause") && lifts.Add(1) == 1 {
			if !resp.(*quotadv1.LiftPauseResponse).Lifted {
				return nil, status.Error(codes.Internal, "the first lift lifted nothing (test setup)")
			}
			return nil, status.Error(codes.Unavailable, "the answer was lost (test)")
		}
		return resp, err
	}
	c := rpctest.Start(t, 1, "domain: provider\nrate_limit: {unit: second, requests_per_unit: 10}\ndescriptors:\n  - key: endpoint\n", func(_ int, cfg *rpc.AgentConfig) {
		cfg.UnaryInterceptors = append(cfg.UnaryInterceptors, lose)
	})
	cc, err := grpc.NewClient(c.Addrs()[0], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	fb, err := quotadv1.NewQuotaClient(cc).Feedback(ctx, &quotadv1.FeedbackRequest{Domain: "provider",
		Descriptors: []*quotadv1.Entry{{Key: "endpoint", Value: "search"}}, StatusCode: 429, RetryAfterMs: 60_000})
	if err != nil || fb.PausedForMs == 0 {
		t.Fatalf("feedback: %v %v, want a pause", fb, err)
	}
	cmd := pauseCmd()
	cmd.SetArgs([]string{"lift", "--domain", "provider", "--descriptor", "endpoint=search", "--addr", c.Addrs()[0]})
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	if err := cmd.Execute(); err != nil {
		t.Fatalf("pause lift whose first answer was lost after it lifted the pause: %v", err)
	}
	if n := lifts.Load(); n != 2 {
		t.Fatalf("%d LiftPause calls, want the lost one and its retry", n)
	}
	// A path that never had a pause still fails (the trial fix stays).
	cmd = pauseCmd()
	cmd.SetArgs([]string{"lift", "--domain", "provider", "--descriptor", "endpoint=charges", "--addr", c.Addrs()[0]})
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), "nothing was lifted") {
		t.Fatalf("pause lift on a path without a pause: %v, want it refused", err)
	}
}
