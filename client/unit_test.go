package client

import (
	"context"

	"errors"
	"go.uber.org/goleak"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

func TestBackoffFullJitterBounds(t *testing.T) {
	b := BackoffConfig{Initial: 10 * time.Millisecond, Max: 200 * time.Millisecond, Factor: 2}
	for attempt, ceil := range []time.Duration{10, 20, 40, 80, 160, 200, 200} {
		ceil *= time.Millisecond
		var maxSeen, minSeen time.Duration = 0, time.Hour
		for range 2000 {
			d := b.delay(attempt)
			if d < 0 || d > ceil {
				t.Fatalf("attempt %d: delay %v outside [0, %v]", attempt, d, ceil)
			}
			maxSeen, minSeen = max(maxSeen, d), min(minSeen, d)
		}
		// Full jitter spreads over the whole range, not around the ceiling.
		if maxSeen < ceil*8/10 || minSeen > ceil*2/10 {
			t.Errorf("attempt %d: delays in [%v, %v], want spread over [0, %v]", attempt, minSeen, maxSeen, ceil)
		}
	}
	if d := b.delay(10_000); d > b.Max {
		t.Errorf("huge attempt: %v > Max", d)
	}
}

// TestBackoffCapFromContext: a call's own cap (withBackoffMax: a lease renewal's tenth of
// its TTL) lowers Config.Backoff.Max for that call only, and never raises it.
func TestBackoffCapFromContext(t *testing.T) {
	b := BackoffConfig{Initial: 10 * time.Millisecond, Max: time.Second, Factor: 2}
	capped := backoffFor(withBackoffMax(context.Background(), 300*time.Millisecond), b)
	if capped.delayCeil(20) != 300*time.Millisecond {
		t.Errorf("capped ceiling %v, want 300ms", capped.delayCeil(20))
	}
	if got := backoffFor(context.Background(), b); got != b {
		t.Errorf("uncapped = %+v, want %+v", got, b)
	}
	if got := backoffFor(withBackoffMax(context.Background(), time.Minute), b); got.Max != time.Second {
		t.Errorf("a cap above Max raised it to %v", got.Max)
	}
}

// uniqueIDs takes 16,000 request IDs from c on 16 goroutines and fails unless all are
// distinct and above floor.
func uniqueIDs(t *testing.T, c *Client, floor uint64) {
	t.Helper()
	const goroutines, per = 16, 1000
	ids := make([][]uint64, goroutines)
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for range per {
				ids[g] = append(ids[g], c.nextID())
			}
		})
	}
	wg.Wait()
	seen := map[uint64]bool{}
	for _, l := range ids {
		for _, id := range l {
			if id <= floor || seen[id] {
				t.Fatalf("request ID %d repeated or not above %d", id, floor)
			}
			seen[id] = true
		}
	}
}

func TestGeneratedClientIDIsShortRandomAndCountsFromOne(t *testing.T) {
	c, err := New(Config{Addrs: []string{"127.0.0.1:1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if len(c.ClientID()) != 16 {
		t.Errorf("generated client ID %q, want 16 base64 characters (96 bits)", c.ClientID())
	}
	c2, _ := New(Config{Addrs: []string{"127.0.0.1:1"}})
	defer c2.Close()
	if c.ClientID() == c2.ClientID() {
		t.Error("two clients got the same random ID")
	}
	if id := c2.nextID(); id != 1 {
		t.Errorf("first request ID of a fresh random namespace = %d, want 1", id)
	}
	uniqueIDs(t, c, 0)
}

func TestConfiguredClientIDStartsAtTheClock(t *testing.T) {
	before := uint64(time.Now().UnixNano())
	c, err := New(Config{Addrs: []string{"127.0.0.1:1"}, ClientID: "billing-worker-7"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.ClientID() != "billing-worker-7" {
		t.Errorf("ClientID() = %q, want the configured one", c.ClientID())
	}
	uniqueIDs(t, c, before)
}

func TestConfigValidate(t *testing.T) {
	if err := DefaultConfig("a:1").Validate(); err != nil {
		t.Fatalf("DefaultConfig: %v", err)
	}
	bad := Config{Batch: BatchConfig{MaxSize: 5000}, Backoff: BackoffConfig{Initial: time.Second, Max: time.Millisecond, Factor: 0.5}}
	err := bad.Validate()
	if err == nil {
		t.Fatal("want an error")
	}
	for _, want := range []string{"Addrs is empty", "MaxSize 5000", "Initial 1s and Backoff.Max 1ms", "Factor 0.5"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	if _, err := New(bad); err == nil {
		t.Error("New accepted an invalid config")
	}
}

func TestErrorTaxonomy(t *testing.T) {
	at := time.Now()
	cases := []struct {
		reason   string
		admitted bool
		is       error
	}{
		{"ok", true, nil},
		{"rate_limited", false, ErrDenied},
		{"concurrency_limited", false, ErrDenied},
		{"paused", false, ErrDenied},
		{"retry_budget_exhausted", false, ErrDenied},
		{"some_future_reason", false, ErrDenied},
		{"invalid", false, ErrInvalid},
		{"unknown_domain", false, ErrInvalid},
	}
	for _, tc := range cases {
		d := decisionFromProto(&quotadv1.Decision{Admitted: tc.admitted, Reason: tc.reason, Scope: "tenant", RetryAfterMs: 1500}, 7, at)
		err := decisionError(d)
		if tc.is == nil {
			if err != nil {
				t.Errorf("%s: %v", tc.reason, err)
			}
			continue
		}
		if !errors.Is(err, tc.is) {
			t.Errorf("%s: %v is not %v", tc.reason, err, tc.is)
		}
		for _, other := range []error{ErrDenied, ErrInvalid, ErrUnavailable} {
			if other != tc.is && errors.Is(err, other) {
				t.Errorf("%s: %v also matches %v", tc.reason, err, other)
			}
		}
		if tc.is == ErrDenied {
			var de *DeniedError
			if !errors.As(err, &de) || de.Decision.RequestID != 7 || de.Decision.RetryAt() != at.Add(1500*time.Millisecond) {
				t.Errorf("%s: DeniedError %+v", tc.reason, de)
			}
			if ra, ok := RetryAfter(err); !ok || ra != 1500*time.Millisecond {
				t.Errorf("%s: RetryAfter = %v, %v", tc.reason, ra, ok)
			}
		}
	}
}

func TestRequestValidation(t *testing.T) {
	for _, r := range []Request{
		{},
		{Domain: "d", Descriptors: []Entry{{Key: "", Value: "x"}}},
		{Domain: "d", LeaseTTL: -1},
		{Domain: "d", MaxWait: -1},
	} {
		if err := r.validate(); !errors.Is(err, ErrInvalid) {
			t.Errorf("%+v: err %v, want ErrInvalid", r, err)
		}
	}
	a := (&Request{Domain: "d", Descriptors: Descriptors("tenant", "acme"), LeaseTTL: 1500 * time.Microsecond}).admission(9)
	if a.Attempt != 1 || a.LeaseTtlMs != 2 || a.RequestId != 9 || a.Descriptors[0].Value != "acme" {
		t.Errorf("admission %v", a)
	}
}

func TestUnavailableAndCloseLeakNothing(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	for _, disabled := range []bool{false, true} {
		// Nothing listens on port 1: every attempt fails, and the call must end with
		// ErrUnavailable (wrapping the context's error) when its context does.
		c, err := New(Config{Addrs: []string{"127.0.0.1:1"}, Batch: BatchConfig{Disabled: disabled},
			Backoff: BackoffConfig{Initial: time.Millisecond, Max: 20 * time.Millisecond}})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
		start := time.Now()
		_, err = c.Allow(ctx, Request{Domain: "d"})
		cancel()
		if !errors.Is(err, ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("batching disabled=%v: err %v, want ErrUnavailable and DeadlineExceeded", disabled, err)
		}
		if took := time.Since(start); took > 400*time.Millisecond {
			t.Errorf("Allow returned %v after a 150ms deadline", took)
		}
		if c.Stats().Retries == 0 {
			t.Error("no retries recorded")
		}
		if err := c.Close(); err != nil {
			t.Error(err)
		}
		if _, err := c.Allow(context.Background(), Request{Domain: "d"}); !errors.Is(err, ErrClosed) {
			t.Errorf("Allow after Close: %v, want ErrClosed", err)
		}
	}
}

func TestDurationsFromClusterSaturate(t *testing.T) {
	for _, tc := range []struct {
		ms   int64
		want time.Duration
	}{{-5, 0}, {0, 0}, {1500, 1500 * time.Millisecond}, {math.MaxInt64, time.Duration(math.MaxInt64)}, {math.MaxInt64/1_000_000 + 1, time.Duration(math.MaxInt64)}} {
		if got := millis(tc.ms); got != tc.want {
			t.Errorf("millis(%d) = %v, want %v", tc.ms, got, tc.want)
		}
	}
	d := Decision{RetryAfter: time.Duration(math.MaxInt64)}
	if w := waitAfterDenial(d, 0, DefaultConfig().withDefaults().Backoff); w <= 0 {
		t.Errorf("wait after a 'never' denial = %v; must not overflow", w)
	}
	if got := durationMillisCeil(time.Duration(math.MaxInt64)); got <= 0 {
		t.Errorf("durationMillisCeil(max) = %d", got)
	}
}

// A request ID is not retried past RetryHorizon, even when the caller's context allows it:
// the cluster might no longer remember it and could decide it a second time.
func TestRetriesStopAtTheHorizon(t *testing.T) {
	c, err := New(Config{Addrs: []string{"127.0.0.1:1"}, Batch: BatchConfig{Disabled: true},
		Backoff: BackoffConfig{Initial: time.Millisecond, Max: 20 * time.Millisecond}, RetryHorizon: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	_, err = c.Allow(ctx, Request{Domain: "d"})
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, errRetryHorizon) {
		t.Fatalf("err %v, want ErrUnavailable at the retry horizon", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("gave up after %v with a 100ms horizon", took)
	}
}

// A concurrency denial's RetryAfter is when a permit frees at the latest (the earliest lease
// expiry): Wait polls with its backoff, never later than that.
func TestWaitAfterConcurrencyDenialPollsWithinRetryAfter(t *testing.T) {
	b := BackoffConfig{Initial: 100 * time.Millisecond, Max: time.Second, Factor: 2}
	for n := 0; n < 8; n++ {
		if w := waitAfterDenial(Decision{Reason: ReasonConcurrencyLimited, RetryAfter: 30 * time.Second}, n, b); w <= 0 || w > time.Second {
			t.Fatalf("denial %d with a lease expiring in 30s: wait %v, want the backoff (<= 1s)", n, w)
		}
		if w := waitAfterDenial(Decision{Reason: ReasonConcurrencyLimited, RetryAfter: 5 * time.Millisecond}, n, b); w > 5*time.Millisecond {
			t.Fatalf("denial %d with a lease expiring in 5ms: wait %v, want at most 5ms", n, w)
		}
	}
}
