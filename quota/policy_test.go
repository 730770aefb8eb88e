package quota

import (
	"bytes"
	"errors"
	"fmt"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// providerLimits: a provider app (ceiling) with endpoints, tenants under charges.
func providerLimits() *Limits {
	return &Limits{Domains: []Domain{{
		Name:         "p",
		Rate:         &Rate{Unit: time.Second, RequestsPerUnit: 100},
		ResumeJitter: 2 * time.Second,
		Descriptors: []Node{
			{Key: "endpoint", Value: "charges", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 50},
				Children: []Node{{Key: "tenant", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 10}}}},
			{Key: "endpoint", Value: "refunds", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 50}},
		},
	}}}
}

func ep(v string) Entry     { return Entry{"endpoint", v} }
func tenant(v string) Entry { return Entry{"tenant", v} }

// TestFeedbackPausesExactlyTheNamedScope: what each kind of provider answer pauses.
func TestFeedbackPausesExactlyTheNamedScope(t *testing.T) {
	type probe struct {
		path   []Entry
		paused bool
	}
	charges, refunds := []Entry{ep("charges")}, []Entry{ep("refunds")}
	acme, other := []Entry{ep("charges"), tenant("acme")}, []Entry{ep("charges"), tenant("other")}
	tests := []struct {
		name       string
		fb         Feedback
		attributed bool
		pausedFor  time.Duration
		scope      string
		probes     []probe
	}{
		{"429 with reason on one endpoint pauses that endpoint only",
			Feedback{Domain: "p", Prefix: charges, StatusCode: 429, RetryAfter: 5 * time.Second, Reason: "endpoint-rate"},
			true, 5 * time.Second, "endpoint",
			[]probe{{charges, true}, {acme, true}, {refunds, false}, {nil, false}}},
		{"429 without reason naming the whole domain is not assumed global",
			Feedback{Domain: "p", StatusCode: 429, RetryAfter: 5 * time.Second},
			false, 0, "domain",
			[]probe{{nil, false}, {charges, false}, {refunds, false}}},
		{"429 with reason for the domain pauses everything",
			Feedback{Domain: "p", StatusCode: 429, RetryAfter: 5 * time.Second, Reason: "global-rate"},
			true, 5 * time.Second, "domain",
			[]probe{{nil, true}, {charges, true}, {refunds, true}}},
		{"429 without reason on a tenant credential pauses that tenant only",
			Feedback{Domain: "p", Prefix: acme, StatusCode: 429, RetryAfter: time.Second},
			true, time.Second, "tenant",
			[]probe{{acme, true}, {other, false}, {charges, false}}},
		{"503 with reason for the domain pauses it",
			Feedback{Domain: "p", StatusCode: 503, RetryAfter: 3 * time.Second, Reason: "overloaded"},
			true, 3 * time.Second, "domain",
			[]probe{{refunds, true}}},
		{"attributed 429 without Retry-After pauses nothing",
			Feedback{Domain: "p", Prefix: charges, StatusCode: 429, Reason: "endpoint-rate"},
			true, 0, "endpoint",
			[]probe{{charges, false}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := mustEngine(t, providerLimits())
			res, err := e.Feedback(10*s, tt.fb)
			if err != nil {
				t.Fatal(err)
			}
			if res.Attributed != tt.attributed || res.PausedFor != tt.pausedFor || res.Scope != tt.scope {
				t.Fatalf("Feedback = %+v, want attributed %v paused %v scope %s", res, tt.attributed, tt.pausedFor, tt.scope)
			}
			for _, p := range tt.probes {
				d := e.Acquire(10*s+ms, Request{Domain: "p", Descriptors: p.path, Spread: 1 << 63})
				if got := d.Reason == ReasonPaused; got != p.paused {
					t.Errorf("path %v: %+v, want paused=%v", p.path, d, p.paused)
				}
				if p.paused && d.Scope != tt.scope {
					t.Errorf("path %v: scope %q, want %q", p.path, d.Scope, tt.scope)
				}
			}
			// The pause ends at Retry-After exactly; the jitter only spreads the advice.
			if tt.pausedFor > 0 {
				for _, p := range tt.probes {
					if d := e.Acquire(10*s+Time(tt.pausedFor), Request{Domain: "p", Descriptors: p.path}); d.Reason == ReasonPaused {
						t.Errorf("path %v still paused at the end of Retry-After: %+v", p.path, d)
					}
				}
			}
		})
	}
}

func TestFeedbackRejectsBadInput(t *testing.T) {
	e := mustEngine(t, providerLimits())
	h := e.Hash()
	for _, fb := range []Feedback{
		{Domain: "p", StatusCode: 500, Reason: "x"},
		{Domain: "p", StatusCode: 0},
		{Domain: "p", StatusCode: 429, RetryAfter: -1},
		{Domain: "p", Prefix: []Entry{ep("nope"), tenant("a")}, StatusCode: 429},
		{Domain: "", StatusCode: 429},
	} {
		if _, err := e.Feedback(5*s, fb); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("%+v: err %v, want ErrInvalidRequest", fb, err)
		}
	}
	if _, err := e.Feedback(5*s, Feedback{Domain: "q", StatusCode: 429}); !errors.Is(err, ErrUnknownDomain) {
		t.Errorf("unknown domain: %v", err)
	}
	if e.Hash() != h {
		t.Error("a refused feedback changed the state")
	}
}

// TestPausedRetryAfterIsSpreadOverTheJitterWindow: every paused request is told the pause end
// plus its own share of resume_jitter, deterministically, covering the window.
func TestPausedRetryAfterIsSpreadOverTheJitterWindow(t *testing.T) {
	e := mustEngine(t, providerLimits())
	if _, err := e.Feedback(0, Feedback{Domain: "p", Prefix: []Entry{ep("charges")}, StatusCode: 429, RetryAfter: 5 * time.Second, Reason: "r"}); err != nil {
		t.Fatal(err)
	}
	const n = 1000
	lo, hi := time.Duration(1<<62), time.Duration(0)
	var buckets [10]int
	for i := range n {
		spread := mix(uint64(i)) // what the fsm does: a hash of the request's IDs
		req := Request{Domain: "p", Descriptors: []Entry{ep("charges")}, Spread: spread}
		d := e.Acquire(s, req)
		if d.Reason != ReasonPaused {
			t.Fatalf("not paused: %+v", d)
		}
		if again := e.Acquire(s, req); again.RetryAfter != d.RetryAfter {
			t.Fatalf("same request, different advice: %v then %v", d.RetryAfter, again.RetryAfter)
		}
		jitter := d.RetryAfter - 4*time.Second // pause ends 4s after now
		if jitter < 0 || jitter >= 2*time.Second {
			t.Fatalf("retry_after %v outside [4s, 6s)", d.RetryAfter)
		}
		lo, hi = min(lo, jitter), max(hi, jitter)
		buckets[jitter/(200*time.Millisecond)]++
	}
	if hi-lo < 1900*time.Millisecond {
		t.Errorf("resumption spread over %v, want nearly the whole 2s window", hi-lo)
	}
	for i, c := range buckets {
		if c < n/10/2 {
			t.Errorf("jitter decile %d has %d of %d requests: not spread", i, c, n)
		}
	}
}

func adaptiveLimits(a Adaptive) *Limits {
	return &Limits{Domains: []Domain{{
		Name:     "p",
		Rate:     &Rate{Unit: time.Second, RequestsPerUnit: 100, Burst: 10},
		Adaptive: &a,
		Descriptors: []Node{
			{Key: "endpoint", Value: "charges", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 50},
				Adaptive: &Adaptive{Floor: 5, DecreasePercent: 50, Increase: 5, StableWindow: time.Second}},
			{Key: "endpoint", Value: "refunds", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 50}},
		},
	}}}
}

func limitAt(t *testing.T, e *Engine, now Time, path ...Entry) uint64 {
	t.Helper()
	st, err := e.Status(now, "p", path)
	if err != nil {
		t.Fatal(err)
	}
	return st[len(st)-1].Limit
}

// TestAdaptiveDecreaseAndRestore follows one AIMD cycle with explicit times.
func TestAdaptiveDecreaseAndRestore(t *testing.T) {
	e := mustEngine(t, adaptiveLimits(Adaptive{Floor: 10, DecreasePercent: 50, Increase: 10, StableWindow: time.Second}))
	confirmed := Feedback{Domain: "p", StatusCode: 429, Reason: "global", RetryAfter: 2 * time.Second}
	type step struct {
		at    Time
		fb    *Feedback
		limit uint64
		dec   bool
	}
	unconfirmed := Feedback{Domain: "p", StatusCode: 429, RetryAfter: 2 * time.Second}
	overload := Feedback{Domain: "p", StatusCode: 503, Reason: "busy", RetryAfter: time.Second}
	steps := []step{
		{0, nil, 100, false},
		{0, &unconfirmed, 100, false},     // no reason, whole domain: evidence only
		{0, &confirmed, 50, true},         // reset at 2s
		{500 * ms, &confirmed, 50, false}, // same burst: counted once, but it moves the reset to 2.5s
		{3499 * ms, nil, 50, false},       // no increase before reset + one window
		{3500 * ms, nil, 60, false},
		{4500 * ms, nil, 70, false},
		{4600 * ms, &overload, 70, false}, // 503: decreases nothing, holds increases until 5.6s
		{6599 * ms, nil, 70, false},
		{6600 * ms, nil, 80, false},
		{6700 * ms, &confirmed, 40, true},
		{6800 * ms, &confirmed, 40, false}, // within one window of the last decrease
		{7700 * ms, &confirmed, 20, true},
		{8800 * ms, &confirmed, 10, true},
		{9900 * ms, &confirmed, 10, true}, // floor
		{25 * s, nil, 100, false},         // restored gradually, never above the ceiling
	}
	for _, st := range steps {
		if st.fb != nil {
			res, err := e.Feedback(st.at, *st.fb)
			if err != nil {
				t.Fatal(err)
			}
			if res.Decreased != st.dec || res.Limit != st.limit {
				t.Fatalf("at %v: feedback %+v gave %+v, want decreased=%v limit %d", time.Duration(st.at), st.fb, res, st.dec, st.limit)
			}
			continue
		}
		if got := limitAt(t, e, st.at); got != st.limit {
			t.Fatalf("at %v: limit %d, want %d", time.Duration(st.at), got, st.limit)
		}
	}
	e.Tick(25 * s)
	if st := e.Stats(); st.Adapted != 0 {
		t.Errorf("back at the ceiling, the adaptive state should be gone: %+v", st)
	}
	// The endpoint level adapts on its own: the ceiling is untouched.
	if _, err := e.Feedback(26*s, Feedback{Domain: "p", Prefix: []Entry{ep("charges")}, StatusCode: 429, Reason: "ep"}); err != nil {
		t.Fatal(err)
	}
	if a, b, c := limitAt(t, e, 26*s, ep("charges")), limitAt(t, e, 26*s, ep("refunds")), limitAt(t, e, 26*s); a != 25 || b != 50 || c != 100 {
		t.Errorf("after an endpoint 429: charges %d refunds %d ceiling %d, want 25 50 100", a, b, c)
	}
}

// TestAdaptiveRateIsEnforced: admissions follow the effective rate, not the configured one.
func TestAdaptiveRateIsEnforced(t *testing.T) {
	e := mustEngine(t, adaptiveLimits(Adaptive{Floor: 10, DecreasePercent: 50, Increase: 10, StableWindow: time.Hour}))
	if _, err := e.Feedback(0, Feedback{Domain: "p", StatusCode: 429, Reason: "r"}); err != nil {
		t.Fatal(err)
	}
	admitted := 0
	for now := Time(0); now < 10*s; now += ms {
		if e.Acquire(now, Request{Domain: "p"}).Admitted {
			admitted++
		}
	}
	// burst 10 + 50/s for 10s
	if admitted < 500 || admitted > 510 {
		t.Errorf("admitted %d in 10s at an effective 50/s (burst 10), want 500..510", admitted)
	}
}

// gcra is a simulated provider: a token bucket of rate perSecond and burst, in integers.
type gcra struct {
	interval, tolerance time.Duration
	tat                 Time
}

func newGCRA(perSecond, burst int) *gcra {
	iv := time.Second / time.Duration(perSecond)
	return &gcra{interval: iv, tolerance: time.Duration(burst-1) * iv}
}

// allow admits at now or returns how long until it would.
func (g *gcra) allow(now Time) (bool, time.Duration) {
	if earliest := g.tat - Time(g.tolerance); now < earliest {
		return false, earliest.Sub(now)
	}
	g.tat = max(g.tat, now) + Time(g.interval)
	return true, 0
}

// TestAIMDConvergesOnHiddenCapacity: a provider whose real capacity is 60 % of the configured
// ceiling answers 429 (with a reason and Retry-After) to what exceeds it. With feedback, the
// effective rate settles under the hidden capacity: after 30 s fewer than 1 % of the requests
// sent get a 429, and at least 85 % of the hidden capacity is used.
func TestAIMDConvergesOnHiddenCapacity(t *testing.T) {
	const ceiling, hidden = 100, 60
	l := &Limits{Domains: []Domain{{
		Name:     "p",
		Rate:     &Rate{Unit: time.Second, RequestsPerUnit: ceiling, Burst: 5},
		Adaptive: &Adaptive{Floor: 10, DecreasePercent: 85, Increase: 1, StableWindow: time.Second},
	}}}
	e := mustEngine(t, l)
	provider := newGCRA(hidden, 5)
	const step = 2 * time.Millisecond // 500 requests/s offered, far above the ceiling
	const warmup, end = 30 * s, 150 * s
	var sent, ok, throttled, sentWarm, throttledWarm int
	for i, now := 0, Time(0); now < end; i, now = i+1, now+Time(step) {
		d := e.Acquire(now, Request{Domain: "p", Spread: mix(uint64(i))})
		if !d.Admitted {
			continue
		}
		accepted, wait := provider.allow(now)
		if now >= warmup {
			sent++
			if accepted {
				ok++
			} else {
				throttled++
			}
		} else {
			sentWarm++
			if !accepted {
				throttledWarm++
			}
		}
		if !accepted {
			if _, err := e.Feedback(now, Feedback{Domain: "p", StatusCode: 429, RetryAfter: wait, Reason: "rate_limit"}); err != nil {
				t.Fatal(err)
			}
		}
	}
	secs := float64(end-warmup) / float64(s)
	rate429 := float64(throttled) / float64(sent)
	util := float64(ok) / (hidden * secs)
	t.Logf("first 30s: %d sent, %d throttled; after: %d sent, %d throttled (%.2f%%), utilization of hidden capacity %.1f%%",
		sentWarm, throttledWarm, sent, throttled, 100*rate429, 100*util)
	if rate429 >= 0.01 {
		t.Errorf("429 rate after 30s %.2f%%, want < 1%%", 100*rate429)
	}
	if util < 0.85 {
		t.Errorf("utilization of the hidden capacity %.1f%%, want >= 85%%", 100*util)
	}
}

func retryLimits(ratio uint32, minPerSecond uint64) *Limits {
	return &Limits{Domains: []Domain{{
		Name:        "p",
		Rate:        &Rate{Unit: time.Second, RequestsPerUnit: 1000},
		RetryBudget: &RetryBudget{RatioPercent: ratio, MinPerSecond: minPerSecond},
	}}}
}

func TestRetryBudget(t *testing.T) {
	e := mustEngine(t, retryLimits(10, 0))
	retry := Request{Domain: "p", Attempt: 2}
	for i := range 10 { // starts full: capacity 10
		if d := e.Acquire(0, retry); !d.Admitted {
			t.Fatalf("retry %d: %+v", i, d)
		}
	}
	d := e.Acquire(0, retry)
	if d.Admitted || d.Reason != ReasonRetryBudgetExhausted || d.Scope != ScopeDomain || d.RetryAfter != 0 {
		t.Fatalf("11th retry: %+v, want retry_budget_exhausted at scope domain", d)
	}
	for range 9 {
		e.Acquire(ms, Request{Domain: "p"})
	}
	if d := e.Acquire(ms, retry); d.Admitted {
		t.Fatalf("9 first attempts at 10%% earned a whole retry: %+v", d)
	}
	e.Acquire(ms, Request{Domain: "p", Attempt: 1})
	if d := e.Acquire(ms, retry); !d.Admitted {
		t.Fatalf("10 first attempts should earn one retry: %+v", d)
	}
	if st, _ := e.Status(ms, "p", nil); st[0].RetryTokens != 0 {
		t.Errorf("status retry tokens %d, want 0", st[0].RetryTokens)
	}

	// The floor refills with time and says when.
	e = mustEngine(t, retryLimits(10, 2))
	for range 20 { // capacity max(10, 10·2)
		e.Acquire(0, retry)
	}
	d = e.Acquire(0, retry)
	if d.Reason != ReasonRetryBudgetExhausted || d.RetryAfter != 500*time.Millisecond {
		t.Fatalf("with min_per_second 2: %+v, want retry after 500ms", d)
	}
	if d := e.Acquire(500*ms, retry); !d.Admitted {
		t.Fatalf("after 500ms: %+v", d)
	}

	// A retry still pays the normal rate, and a rate denial spends no retry token.
	e = mustEngine(t, &Limits{Domains: []Domain{{Name: "p", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1},
		RetryBudget: &RetryBudget{RatioPercent: 10}}}})
	e.Acquire(0, Request{Domain: "p"})
	if d := e.Acquire(0, retry); d.Reason != ReasonRateLimited {
		t.Fatalf("retry over the rate: %+v", d)
	}
	if st, _ := e.Status(0, "p", nil); st[0].RetryTokens != 10 {
		t.Errorf("a refused retry spent budget: %d tokens left", st[0].RetryTokens)
	}
}

// TestRetryBudgetBound: over any history from the start, admitted retries never exceed
// capacity + ratio·first attempts + min_per_second·elapsed.
func TestRetryBudgetBound(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		ratio := rapid.Uint32Range(0, 100).Draw(t, "ratio")
		minPS := rapid.Uint64Range(0, 5).Draw(t, "min")
		if ratio == 0 && minPS == 0 {
			ratio = 1
		}
		e := NewEngine()
		if err := e.SetLimits(0, retryLimits(ratio, minPS)); err != nil {
			t.Fatal(err)
		}
		capacity := (&RetryBudget{RatioPercent: ratio, MinPerSecond: minPS}).Capacity()
		var now Time
		firsts, retries := 0, 0
		for i, n := 0, rapid.IntRange(1, 400).Draw(t, "n"); i < n; i++ {
			now += Time(rapid.Int64Range(0, int64(300*time.Millisecond)).Draw(t, "dt"))
			attempt := uint32(1)
			if rapid.IntRange(0, 3).Draw(t, "kind") > 0 {
				attempt = 2
			}
			if rapid.IntRange(0, 20).Draw(t, "tick") == 0 {
				e.Tick(now)
			}
			d := e.Acquire(now, Request{Domain: "p", Attempt: attempt})
			if !d.Admitted {
				if d.Reason != ReasonRetryBudgetExhausted || attempt == 1 {
					t.Fatalf("unexpected denial %+v", d)
				}
				continue
			}
			if attempt == 1 {
				firsts++
			} else {
				retries++
			}
			// bound in micro-units to stay exact
			bound := capacity*microPerUnit + uint64(firsts)*uint64(ratio)*(microPerUnit/100) +
				uint64(now)*minPS*microPerUnit/uint64(time.Second)
			if uint64(retries)*microPerUnit > bound {
				t.Fatalf("at %v: %d retries admitted after %d first attempts; bound %d", time.Duration(now), retries, firsts, bound/microPerUnit)
			}
		}
	})
}

// policyLimits has every policy feature at once, for the determinism properties.
func policyLimits(t *rapid.T) *Limits {
	return &Limits{Domains: []Domain{{
		Name:         "p",
		Rate:         &Rate{Unit: time.Second, RequestsPerUnit: rapid.Uint64Range(5, 50).Draw(t, "ceiling"), Burst: rapid.Uint64Range(0, 10).Draw(t, "burst")},
		Adaptive:     &Adaptive{Floor: 2, DecreasePercent: rapid.Uint32Range(1, 99).Draw(t, "keep"), Increase: 1, StableWindow: 300 * time.Millisecond},
		RetryBudget:  &RetryBudget{RatioPercent: 20, MinPerSecond: rapid.Uint64Range(0, 2).Draw(t, "min")},
		ResumeJitter: 500 * time.Millisecond,
		Descriptors: []Node{{Key: "endpoint", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 5},
			Adaptive: &Adaptive{Floor: 1, DecreasePercent: 50, Increase: 1, StableWindow: time.Second}}},
	}}}
}

// TestPolicyStateSnapshotAndReplicas: a replica restored from a snapshot at any point and a
// replica that applied everything agree on Hash and on every later decision; the snapshot of a
// restored engine is byte-identical; Tick drops exactly the full buckets even while rates adapt.
func TestPolicyStateSnapshotAndReplicas(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		l := policyLimits(t)
		a, b := NewEngine(), NewEngine()
		for _, e := range []*Engine{a, b} {
			if err := e.SetLimits(0, l); err != nil {
				t.Fatal(err)
			}
		}
		var now Time
		endpoints := []string{"x", "y"}
		for i, n := 0, rapid.IntRange(1, 150).Draw(t, "n"); i < n; i++ {
			now += Time(rapid.Int64Range(-int64(10*time.Millisecond), int64(400*time.Millisecond)).Draw(t, "dt"))
			ep := endpoints[rapid.IntRange(0, 1).Draw(t, "ep")]
			var out [2]string
			kind := rapid.IntRange(0, 9).Draw(t, "kind")
			for j, e := range []*Engine{a, b} {
				switch {
				case kind < 6:
					out[j] = fmt.Sprintf("%+v", e.Acquire(now, Request{Domain: "p", Descriptors: []Entry{{"endpoint", ep}},
						Attempt: uint32(kind%3 + 1), Spread: uint64(i) * 0x9e3779b97f4a7c15}))
				case kind < 8:
					var prefix []Entry
					if kind == 7 {
						prefix = []Entry{{"endpoint", ep}}
					}
					res, err := e.Feedback(now, Feedback{Domain: "p", Prefix: prefix, StatusCode: []uint32{429, 503}[i%2],
						RetryAfter: time.Duration(i%4) * 100 * time.Millisecond, Reason: []string{"", "r"}[i%3%2]})
					out[j] = fmt.Sprint(res, err)
				default:
					keep := map[string]bool{}
					tnow := max(now, e.Clock())
					for k, bk := range storedBuckets(e) {
						if tokens, _ := bk.rate.refill(bk.tokens, bk.last, tnow); tokens < bk.lvl.rate.capMicro {
							keep[k] = true
						}
					}
					e.Tick(now)
					if len(keep) != e.buckets.live {
						t.Fatalf("tick kept %d buckets, want the %d not full", e.buckets.live, len(keep))
					}
				}
			}
			if out[0] != out[1] {
				t.Fatalf("replicas disagree at op %d:\n%s\n%s", i, out[0], out[1])
			}
			if a.Hash() != b.Hash() {
				t.Fatalf("hashes differ after op %d", i)
			}
			if rapid.IntRange(0, 10).Draw(t, "restore") == 0 {
				snap, err := b.MarshalBinary()
				if err != nil {
					t.Fatal(err)
				}
				r := NewEngine()
				if err := r.UnmarshalBinary(snap); err != nil {
					t.Fatal(err)
				}
				again, _ := r.MarshalBinary()
				if !bytes.Equal(snap, again) || r.Hash() != b.Hash() {
					t.Fatalf("snapshot round trip changed the state")
				}
				b = r
			}
		}
	})
}

func TestSnapshotFormats(t *testing.T) {
	e := mustEngine(t, providerLimits())
	snap, _ := e.MarshalBinary()
	if snap[0] != 1 {
		t.Errorf("a state without debits, adaptive rates or retry budgets should stay format 1, got %d", snap[0])
	}
	e = mustEngine(t, retryLimits(10, 0))
	e.Acquire(0, Request{Domain: "p", Attempt: 2})
	snap, _ = e.MarshalBinary()
	if snap[0] != 3 {
		t.Errorf("format %d after a debit, want 3 (refund section)", snap[0])
	}
	r := NewEngine()
	if err := r.UnmarshalBinary(snap); err != nil || r.Hash() != e.Hash() {
		t.Fatalf("format 3 round trip: %v", err)
	}
	for i := 1; i < len(snap); i++ {
		if err := NewEngine().UnmarshalBinary(snap[:i]); err == nil {
			t.Fatalf("truncated snapshot (%d of %d bytes) accepted", i, len(snap))
		}
	}
}

func TestPolicyLimitsValidation(t *testing.T) {
	base := func() Domain { return Domain{Name: "p", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 10}} }
	tests := []struct {
		name string
		mod  func(d *Domain)
		want string
	}{
		{"adaptive without rate", func(d *Domain) {
			d.Rate = nil
			d.Adaptive = &Adaptive{Floor: 1, DecreasePercent: 50, Increase: 1, StableWindow: 1}
		}, "adaptive needs a rate_limit"},
		{"floor above ceiling", func(d *Domain) { d.Adaptive = &Adaptive{Floor: 11, DecreasePercent: 50, Increase: 1, StableWindow: 1} }, "floor must be between 1 and the requests_per_unit 10 (got 11)"},
		{"decrease 100", func(d *Domain) { d.Adaptive = &Adaptive{Floor: 1, DecreasePercent: 100, Increase: 1, StableWindow: 1} }, "decrease_percent must be between 1 and 99 (got 100)"},
		{"no window", func(d *Domain) { d.Adaptive = &Adaptive{Floor: 1, DecreasePercent: 50, Increase: 1} }, "stable_window must be > 0"},
		{"reserves over 100", func(d *Domain) {
			d.WorkClasses = []WorkClass{{Name: "a", ReservePercent: 60}, {Name: "b", ReservePercent: 50}}
		}, "reserve 110% in total"},
		{"class twice", func(d *Domain) { d.WorkClasses = []WorkClass{{Name: "a"}, {Name: "a"}} }, `work class "a" is defined twice`},
		{"budget of nothing", func(d *Domain) { d.RetryBudget = &RetryBudget{} }, "admits no retry at all"},
		{"ratio over 100", func(d *Domain) { d.RetryBudget = &RetryBudget{RatioPercent: 101} }, "ratio_percent must be <= 100"},
		{"negative jitter", func(d *Domain) { d.ResumeJitter = -1 }, "resume_jitter must be between 0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := base()
			tt.mod(&d)
			err := NewEngine().SetLimits(0, &Limits{Domains: []Domain{d}})
			if !errors.Is(err, ErrInvalidLimits) || !bytes.Contains([]byte(err.Error()), []byte(tt.want)) {
				t.Errorf("err %v, want one containing %q", err, tt.want)
			}
		})
	}
}

// TestSetLimitsCarriesAdaptiveState: a limits change keeps the adapted rate (clamped into the
// new range) and drops it where the level is no longer adaptive.
func TestSetLimitsCarriesAdaptiveState(t *testing.T) {
	l := adaptiveLimits(Adaptive{Floor: 10, DecreasePercent: 50, Increase: 10, StableWindow: time.Hour})
	e := mustEngine(t, l)
	e.Feedback(0, Feedback{Domain: "p", StatusCode: 429, Reason: "r"})
	if got := limitAt(t, e, 0); got != 50 {
		t.Fatalf("limit %d", got)
	}
	l.Domains[0].Adaptive.Floor = 60
	if err := e.SetLimits(s, l); err != nil {
		t.Fatal(err)
	}
	if got := limitAt(t, e, s); got != 60 {
		t.Errorf("after raising the floor to 60: limit %d", got)
	}
	l.Domains[0].Adaptive = nil
	if err := e.SetLimits(2*s, l); err != nil {
		t.Fatal(err)
	}
	if got := limitAt(t, e, 2*s); got != 100 || e.Stats().Adapted != 0 {
		t.Errorf("after removing adaptive: limit %d, %d adapted", got, e.Stats().Adapted)
	}
}
