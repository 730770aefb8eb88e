package quota

import (
	"errors"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"
)

const (
	ms = Time(time.Millisecond)
	s  = Time(time.Second)
)

func mustEngine(t testing.TB, l *Limits) *Engine {
	t.Helper()
	e := NewEngine()
	if err := e.SetLimits(0, l); err != nil {
		t.Fatal(err)
	}
	return e
}

func oneBucket(rpu uint64, unit time.Duration, burst uint64) *Limits {
	return &Limits{Domains: []Domain{{Name: "d", Rate: &Rate{Unit: unit, RequestsPerUnit: rpu, Burst: burst}}}}
}

// TestAcquireSingleBucket follows x/time/rate's rate_test.go: explicit times, expected outcomes.
func TestAcquireSingleBucket(t *testing.T) {
	type step struct {
		t         Time
		cost      uint64
		ok        bool
		remaining uint64
		retry     time.Duration
	}
	tests := []struct {
		name  string
		rpu   uint64
		unit  time.Duration
		burst uint64
		steps []step
	}{
		{"burst then refill", 10, time.Second, 0, []step{
			{0, 10, true, 0, 0},
			{0, 1, false, 0, 100 * time.Millisecond},
			{50 * ms, 1, false, 0, 50 * time.Millisecond},
			{100 * ms, 1, true, 0, 0},
			{300 * ms, 1, true, 1, 0},
			{300 * ms, 2, false, 1, 100 * time.Millisecond},
			{400 * ms, 2, true, 0, 0},
		}},
		{"burst larger than rate", 1, time.Second, 5, []step{
			{0, 5, true, 0, 0},
			{0, 1, false, 0, time.Second},
			{10 * s, 5, true, 0, 0}, // capped at 5, not 10
			{10 * s, 1, false, 0, time.Second},
		}},
		{"slow rate rounds the wait up", 3, time.Second, 1, []step{
			{0, 1, true, 0, 0},
			// 1/3 s is 333333333.33ns: the wait must not be shorter than that.
			{0, 1, false, 0, 333333334},
			{333333333, 1, false, 0, 1},
			{333333334, 1, true, 0, 0},
		}},
		{"one per day", 1, 24 * time.Hour, 0, []step{
			{0, 1, true, 0, 0},
			{12 * 3600 * s, 1, false, 0, 12 * time.Hour},
			{24 * 3600 * s, 1, true, 0, 0},
		}},
		{"huge rate does not overflow", math.MaxUint64 / microPerUnit, time.Nanosecond, 0, []step{
			{0, math.MaxUint64 / microPerUnit, true, 0, 0},
			{1, math.MaxUint64 / microPerUnit, true, 0, 0},
			{math.MaxInt64, 1, true, math.MaxUint64/microPerUnit - 1, 0},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := mustEngine(t, oneBucket(tt.rpu, tt.unit, tt.burst))
			for i, st := range tt.steps {
				d := e.Acquire(st.t, Request{Domain: "d", Cost: st.cost})
				if d.Admitted != st.ok || d.Remaining != st.remaining || d.RetryAfter != st.retry {
					t.Errorf("step %d at %v cost %d: got admitted=%v remaining=%d retry=%v (%s), want %v %d %v",
						i, time.Duration(st.t), st.cost, d.Admitted, d.Remaining, d.RetryAfter, d.Reason, st.ok, st.remaining, st.retry)
				}
			}
		})
	}
}

// A slow bucket touched far more often than it earns a micro-unit must still refill at its rate:
// refill keeps the fractional remainder instead of dropping it on every touch.
func TestRefillKeepsRemainder(t *testing.T) {
	r, err := newRateParams(&Rate{Unit: time.Hour, RequestsPerUnit: 1, Burst: 2})
	if err != nil {
		t.Fatal(err)
	}
	tokens, last := uint64(0), Time(0)
	for now := Time(0); now <= Time(time.Hour); now += ms {
		tokens, last = r.refill(tokens, last, now)
	}
	// Exactly one unit is due; each crediting step may lose under 1ns of credit.
	if tokens > microPerUnit || tokens < microPerUnit-1 {
		t.Fatalf("after 1h in 1ms steps: %d micro-units, want %d (-1)", tokens, microPerUnit)
	}
	oneShot, _ := r.refill(0, 0, Time(time.Hour))
	if oneShot != microPerUnit {
		t.Fatalf("one-shot refill over 1h: %d, want %d", oneShot, microPerUnit)
	}
}

func TestRefillNeverOverCredits(t *testing.T) {
	rates := []Rate{
		{Unit: time.Second, RequestsPerUnit: 3, Burst: 100},
		{Unit: 7 * time.Millisecond, RequestsPerUnit: 1_000_003, Burst: math.MaxUint64 / microPerUnit},
		{Unit: 24 * time.Hour, RequestsPerUnit: 1, Burst: 1},
	}
	for _, rate := range rates {
		r, _ := newRateParams(&rate)
		tokens, last := uint64(0), Time(0)
		for i, now := 0, Time(0); i < 10000; i++ {
			now += Time(i*7919%100_003 + 1)
			tokens, last = r.refill(tokens, last, now)
			if last > now {
				t.Fatalf("%+v: last %d after now %d", rate, last, now)
			}
			// exact credit since 0 is floor(now*rpuMicro/unit), capped
			if tokens < r.capMicro && float64(tokens) > float64(now)*float64(r.rpuMicro)/float64(r.unit)+1e-6 {
				t.Fatalf("%+v: over-credited: %d at %d", rate, tokens, now)
			}
		}
	}
}

func TestHierarchyAllOrNothing(t *testing.T) {
	l := &Limits{Domains: []Domain{{
		Name: "api",
		Rate: &Rate{Unit: time.Second, RequestsPerUnit: 100},
		Descriptors: []Node{{
			Key:  "tenant",
			Rate: &Rate{Unit: time.Second, RequestsPerUnit: 5},
			Children: []Node{{
				Key:  "consumer",
				Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1},
			}},
		}},
	}}}
	e := mustEngine(t, l)
	req := Request{Domain: "api", Descriptors: []Entry{{"tenant", "a"}, {"consumer", "x"}}}
	d := e.Acquire(0, req)
	wantCharges := []string{"api", "api/tenant=a", "api/tenant=a/consumer=x"}
	if !d.Admitted || strings.Join(d.Charges, " ") != strings.Join(wantCharges, " ") || d.Scope != "consumer" {
		t.Fatalf("first: %+v", d)
	}
	e.Tick(0)
	before := e.Hash()
	d = e.Acquire(0, req)
	if d.Admitted || d.Reason != ReasonRateLimited || d.Scope != "consumer" || d.RetryAfter != time.Second {
		t.Fatalf("second: %+v", d)
	}
	if e.Hash() != before {
		t.Fatal("a denied request changed the state")
	}
	st, err := e.Status(0, "api", req.Descriptors)
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []uint64{99, 4, 0} {
		if st[i].Remaining != want {
			t.Errorf("level %s: remaining %d, want %d", st[i].Scope, st[i].Remaining, want)
		}
	}
}

func TestInvalidRequests(t *testing.T) {
	e := mustEngine(t, &Limits{Domains: []Domain{{
		Name:        "d",
		Descriptors: []Node{{Key: "k", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 2, Burst: 3}}},
	}}})
	tests := []struct {
		req    Request
		reason Reason
		msg    string
	}{
		{Request{}, ReasonInvalid, "domain is empty"},
		{Request{Domain: "d", Descriptors: []Entry{{"", "v"}}}, ReasonInvalid, "empty key"},
		{Request{Domain: "d", LeaseTTL: -1}, ReasonInvalid, "lease TTL"},
		{Request{Domain: "x"}, ReasonUnknownDomain, `"x"`},
		{Request{Domain: "d", Descriptors: []Entry{{"k", "v"}}, Cost: 4}, ReasonInvalid, "cost 4 exceeds the capacity 3"},
		{Request{Domain: "d", Descriptors: []Entry{{"k", "v"}}, Cost: math.MaxUint64}, ReasonInvalid, "exceeds the capacity 3"},
		{Request{Domain: "d", Descriptors: []Entry{{"k", "v"}}, Cost: 3}, ReasonOK, ""},
	}
	for _, tt := range tests {
		h := e.Hash()
		d := e.Acquire(0, tt.req)
		if d.Reason != tt.reason || !strings.Contains(d.Message, tt.msg) {
			t.Errorf("%+v: got %s %q, want %s containing %q", tt.req, d.Reason, d.Message, tt.reason, tt.msg)
		}
		if tt.reason != ReasonOK && e.Hash() != h {
			t.Errorf("%+v: refused request changed the state", tt.req)
		}
	}
}

func TestSetLimitsErrorsLeaveStateUnchanged(t *testing.T) {
	rate := func(rpu uint64, unit time.Duration) *Rate { return &Rate{Unit: unit, RequestsPerUnit: rpu} }
	tests := []struct {
		name string
		l    Limits
		msg  string
	}{
		{"zero rate with burst", Limits{Domains: []Domain{{Name: "x", Descriptors: []Node{{Key: "tenant", Rate: &Rate{Unit: time.Second, Burst: 5}}}}}},
			`domain "x": descriptor tenant: rate_limit.burst 5 with requests_per_unit 0 (blocked)`},
		{"zero domain rate", Limits{Domains: []Domain{{Name: "x", Rate: rate(0, time.Second)}}},
			`domain "x": rate_limit.requests_per_unit must be > 0`},
		{"zero unit", Limits{Domains: []Domain{{Name: "x", Rate: rate(1, 0)}}}, `domain "x": rate_limit.unit must be > 0`},
		{"negative unit", Limits{Domains: []Domain{{Name: "x", Rate: rate(1, -time.Second)}}}, `got -1s`},
		{"rate too big", Limits{Domains: []Domain{{Name: "x", Rate: rate(math.MaxUint64, time.Second)}}}, `requests_per_unit must be <=`},
		{"burst too big", Limits{Domains: []Domain{{Name: "x", Rate: &Rate{Unit: 1, RequestsPerUnit: 1, Burst: math.MaxUint64}}}}, `burst must be <=`},
		{"empty domain", Limits{Domains: []Domain{{}}}, `empty name`},
		{"dup domain", Limits{Domains: []Domain{{Name: "x"}, {Name: "x"}}}, `domain "x" is defined twice`},
		{"empty key", Limits{Domains: []Domain{{Name: "x", Descriptors: []Node{{Key: "a", Children: []Node{{}}}}}}}, `under "a" has an empty key`},
		{"dup wildcard", Limits{Domains: []Domain{{Name: "x", Descriptors: []Node{{Key: "a"}, {Key: "a"}}}}}, `descriptor a: defined twice`},
		{"nested path in message", Limits{Domains: []Domain{{Name: "x", Descriptors: []Node{{Key: "a", Value: "1", Children: []Node{{Key: "b", Rate: rate(1, 0)}}}}}}},
			`domain "x": descriptor a=1/b: rate_limit.unit`},
		{"unlimited with concurrency", Limits{Domains: []Domain{{Name: "x", Descriptors: []Node{{Key: "a", Unlimited: true, Concurrency: &Concurrency{1, time.Second}}}}}}, `mutually exclusive`},
		{"zero max in flight", Limits{Domains: []Domain{{Name: "x", Concurrency: &Concurrency{0, time.Second}}}}, `max_in_flight must be > 0`},
	}
	e := mustEngine(t, oneBucket(10, time.Second, 0))
	e.Acquire(5*s, Request{Domain: "d", Cost: 3})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := e.Hash()
			err := e.SetLimits(10*s, &tt.l)
			if !errors.Is(err, ErrInvalidLimits) || !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("got %v, want ErrInvalidLimits containing %q", err, tt.msg)
			}
			if e.Hash() != h || e.Clock() != 5*s {
				t.Fatal("a rejected SetLimits changed the state")
			}
		})
	}
}

func TestSetLimitsCarriesBalances(t *testing.T) {
	e := mustEngine(t, oneBucket(10, time.Second, 0))
	e.Acquire(0, Request{Domain: "d", Cost: 10}) // empty at 0
	// At 500ms it holds 5. The new rate is 1000/s: it must not be credited retroactively.
	if err := e.SetLimits(500*ms, oneBucket(1000, time.Second, 20)); err != nil {
		t.Fatal(err)
	}
	if d := e.Acquire(500*ms, Request{Domain: "d", Cost: 6}); d.Admitted || d.RetryAfter != time.Millisecond {
		t.Fatalf("after rate change: %+v", d)
	}
	if d := e.Acquire(501*ms, Request{Domain: "d", Cost: 6}); !d.Admitted || d.Remaining != 0 {
		t.Fatalf("after rate change +1ms: %+v", d)
	}
	// Lower capacity clamps.
	e.Acquire(10*s, Request{Domain: "d", Cost: 1}) // 19 left
	if err := e.SetLimits(10*s, oneBucket(1000, time.Second, 3)); err != nil {
		t.Fatal(err)
	}
	st, _ := e.Status(10*s, "d", nil)
	if st[0].Remaining != 3 || e.Limits().Version != 3 {
		t.Fatalf("after clamp: %+v version %d", st[0], e.Limits().Version)
	}
	// Domain gone: its buckets go.
	if err := e.SetLimits(10*s, &Limits{Domains: []Domain{{Name: "other"}}}); err != nil {
		t.Fatal(err)
	}
	if n := e.Stats().Buckets; n != 0 {
		t.Fatalf("%d buckets left after their domain was removed", n)
	}
}

func TestSetLimitsDoesNotAliasInput(t *testing.T) {
	l := oneBucket(10, time.Second, 0)
	e := mustEngine(t, l)
	l.Domains[0].Rate.RequestsPerUnit = 1
	l.Domains[0].Name = "zzz"
	if got := e.Limits(); got.Domains[0].Name != "d" || got.Domains[0].Rate.RequestsPerUnit != 10 || got.Version != 1 {
		t.Fatalf("engine saw the caller's later edit: %+v", got.Domains[0])
	}
	e.Limits().Domains[0].Name = "yyy"
	if e.Limits().Domains[0].Name != "d" {
		t.Fatal("Limits() returned the engine's own copy")
	}
}

func TestLeases(t *testing.T) {
	e := mustEngine(t, &Limits{Domains: []Domain{{
		Name:        "d",
		Concurrency: &Concurrency{MaxInFlight: 2, LeaseTTL: 10 * time.Second},
		Descriptors: []Node{{Key: "job", Concurrency: &Concurrency{MaxInFlight: 1, LeaseTTL: 3 * time.Second}}},
	}}})
	job := func(v string) Request { return Request{Domain: "d", Descriptors: []Entry{{"job", v}}} }

	a := e.Acquire(0, job("a"))
	if !a.Admitted || a.LeaseID != 1 || a.LeaseTTL != 3*time.Second || a.Scope != "job" {
		t.Fatalf("a: %+v", a)
	}
	if d := e.Acquire(0, job("a")); d.Reason != ReasonConcurrencyLimited || d.Scope != "job" || d.Limit != 1 {
		t.Fatalf("a again: %+v", d)
	}
	// A requested TTL above the configured lease_ttl is clamped to it (3s, the smallest).
	b := e.Acquire(0, Request{Domain: "d", Descriptors: []Entry{{"job", "b"}}, LeaseTTL: time.Minute})
	if !b.Admitted || b.LeaseTTL != 3*time.Second {
		t.Fatalf("b: %+v", b)
	}
	if ttl, err := e.Renew(3*s-1, b.LeaseID, 10*365*24*time.Hour); err != nil || ttl != 3*time.Second {
		t.Fatalf("renew b for ten years: %v %v (want clamped to 3s)", ttl, err)
	}
	if d := e.Acquire(0, job("c")); d.Reason != ReasonConcurrencyLimited || d.Scope != ScopeDomain {
		t.Fatalf("c: %+v", d)
	}
	// a's lease ends at exactly 3s, freeing a slot for c.
	if d := e.Acquire(3*s-1, job("c")); d.Admitted {
		t.Fatalf("c just before a's expiry: %+v", d)
	}
	c := e.Acquire(3*s, job("c"))
	if !c.Admitted {
		t.Fatalf("c at a's expiry: %+v", c)
	}
	if e.Release(3*s, a.LeaseID) {
		t.Fatal("released an expired lease")
	}
	if ttl, err := e.Renew(4*s, c.LeaseID, 0); err != nil || ttl != 3*time.Second {
		t.Fatalf("renew c: %v %v", ttl, err)
	}
	if ttl, err := e.Renew(5*s, b.LeaseID, 2*time.Second); err != nil || ttl != 2*time.Second {
		t.Fatalf("renew b for less than the cap: %v %v", ttl, err)
	}
	if ttl, err := e.Renew(5*s, b.LeaseID, 0); err != nil || ttl != 3*time.Second {
		t.Fatalf("renew b with its granted TTL: %v %v", ttl, err)
	}
	if _, err := e.Renew(7*s, c.LeaseID, 0); !errors.Is(err, ErrLeaseNotFound) {
		t.Fatalf("renew at expiry: %v", err)
	}
	if _, err := e.Renew(7*s, b.LeaseID, -1); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("negative renew: %v", err)
	}
	if !e.Release(8*s-1, b.LeaseID) || e.Stats().Leases != 0 {
		t.Fatalf("release b: %+v", e.Stats())
	}
	st, _ := e.Status(8*s-1, "d", []Entry{{"job", "b"}})
	if st[0].InFlight != 0 || st[1].InFlight != 0 {
		t.Fatalf("permits not returned: %+v", st)
	}
}

func TestClockNeverGoesBack(t *testing.T) {
	e := mustEngine(t, oneBucket(1, time.Second, 0))
	e.Acquire(10*s, Request{Domain: "d"})
	if e.Clock() != 10*s {
		t.Fatalf("clock %v", e.Clock())
	}
	d := e.Acquire(0, Request{Domain: "d"})
	if d.Admitted || d.RetryAfter != time.Second || e.Clock() != 10*s {
		t.Fatalf("late timestamp: %+v clock %v", d, e.Clock())
	}
	if _, err := e.Status(0, "d", nil); err != nil || e.Clock() != 10*s {
		t.Fatal("Status moved the clock")
	}
}

func TestRefund(t *testing.T) {
	e := mustEngine(t, &Limits{Domains: []Domain{{
		Name:        "d",
		Rate:        &Rate{Unit: time.Second, RequestsPerUnit: 100},
		Descriptors: []Node{{Key: "t", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 10}}},
	}}})
	remaining := func(now Time, tenant string) uint64 {
		t.Helper()
		st, err := e.Status(now, "d", []Entry{{"t", tenant}})
		if err != nil || len(st) != 2 {
			t.Fatalf("status: %+v %v", st, err)
		}
		return st[1].Remaining
	}
	d := e.Acquire(0, Request{Domain: "d", Descriptors: []Entry{{"t", "a"}}, Cost: 10})
	if got := e.Refund(0, d.Charges, 4, d.DebitSeq); got != (RefundResult{Restored: 2}) {
		t.Fatalf("refund 4: %+v", got)
	}
	if got := remaining(0, "a"); got != 4 {
		t.Fatalf("tenant a after refunding 4 of 10: %d remaining, want 4", got)
	}
	if got := e.Refund(0, d.Charges, 10, d.DebitSeq); got != (RefundResult{Kept: 2}) || remaining(0, "a") != 4 {
		t.Fatalf("a second refund of one admission: %+v, %d remaining", got, remaining(0, "a"))
	}
	if got := e.Refund(0, []string{"d/t=nobody"}, 1, d.DebitSeq); got != (RefundResult{Restored: 1}) {
		t.Fatalf("refund to an absent (full) bucket: %+v", got)
	}
	if got := e.Refund(0, nil, 1, d.DebitSeq); got != (RefundResult{}) {
		t.Fatalf("refund nothing: %+v", got)
	}
	d2 := e.Acquire(0, Request{Domain: "d", Descriptors: []Entry{{"t", "b"}}, Cost: 10})
	if got := e.Refund(0, d2.Charges, 10, d2.DebitSeq); got != (RefundResult{Restored: 2}) || remaining(0, "b") != 10 {
		t.Fatalf("refund 10 right after the debit: %+v, %d remaining", got, remaining(0, "b"))
	}
}

// An admission of a concurrency-only domain takes permits and no rate tokens: no Charges, no
// DebitSeq. Refunding it gives back nothing (an empty RefundResult, which the FSM answers as
// nothing_to_refund) and leaves the permits in flight; a mixed domain's admission has both.
func TestRefundOfConcurrencyOnlyAdmissionIsEmpty(t *testing.T) {
	e := mustEngine(t, &Limits{Domains: []Domain{
		{Name: "slots", Concurrency: &Concurrency{MaxInFlight: 1, LeaseTTL: time.Minute}},
		{Name: "rated", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 10}},
	}})
	d := e.Acquire(0, Request{Domain: "slots", Cost: 5})
	if !d.Admitted || d.LeaseID == 0 || len(d.Charges) != 0 || d.DebitSeq != 0 {
		t.Fatalf("concurrency-only admission: %+v, want a lease and no charges", d)
	}
	if got := e.Refund(0, d.Charges, d.Cost, d.DebitSeq); got != (RefundResult{}) {
		t.Fatalf("refund of a concurrency-only admission: %+v, want nothing restored or kept", got)
	}
	if d2 := e.Acquire(0, Request{Domain: "slots"}); d2.Admitted {
		t.Fatalf("the refund returned the permit: a second lease of max_in_flight 1 was admitted: %+v", d2)
	}
	r := e.Acquire(0, Request{Domain: "rated", Cost: 2})
	if len(r.Charges) != 1 || r.DebitSeq == 0 {
		t.Fatalf("rated admission: %+v, want one charge and a DebitSeq", r)
	}
	if got := e.Refund(0, r.Charges, r.Cost, r.DebitSeq); got != (RefundResult{Restored: 1}) {
		t.Fatalf("refund of a rated admission: %+v, want 1 restored", got)
	}
}

// The user trial behind RefundResult: a fast domain ceiling refills between the spend and the
// refund and takes nothing back, while the slow tenant's bucket goes 4 -> 5. Both are restored
// (the old answer, the least any bucket took back, was 0). A later admission on the tenant
// makes it keep the units.
func TestRefundFastCeilingRestoresBoth(t *testing.T) {
	e := mustEngine(t, &Limits{Domains: []Domain{{
		Name:        "d",
		Rate:        &Rate{Unit: time.Millisecond, RequestsPerUnit: 100},
		Descriptors: []Node{{Key: "t", Rate: &Rate{Unit: time.Hour, RequestsPerUnit: 5}}},
	}}})
	req := Request{Domain: "d", Descriptors: []Entry{{"t", "a"}}, Cost: 1}
	d := e.Acquire(0, req)
	later := Time(time.Millisecond)
	if st, _ := e.Status(later, "d", req.Descriptors); st[0].Remaining != st[0].Burst || st[1].Remaining != 4 {
		t.Fatalf("setup: %+v; want the ceiling full again and the tenant at 4", st)
	}
	if got := e.Refund(later, d.Charges, 1, d.DebitSeq); got != (RefundResult{Restored: 2}) {
		t.Fatalf("refund: %+v, want both buckets restored", got)
	}
	if st, _ := e.Status(later, "d", req.Descriptors); st[1].Remaining != 5 {
		t.Fatalf("tenant after the refund: %d remaining, want 5", st[1].Remaining)
	}
	a := e.Acquire(later, req)
	e.Acquire(later, Request{Domain: "d", Descriptors: []Entry{{"t", "b"}}, Cost: 1}) // debits the ceiling only
	if got := e.Refund(later, a.Charges, 1, a.DebitSeq); got != (RefundResult{Restored: 1, Kept: 1}) {
		t.Fatalf("refund after another tenant's admission: %+v, want the tenant restored and the ceiling kept", got)
	}
}

// A refund must not hand back capacity the bucket already gave out again (review finding):
// rate 1/s, burst 10. A takes 10 at 0; the bucket refills; B takes 10 at 99 s; A's refund at
// 99.5 s must not let C take another 10 — B and C in half a second would be 20 > 10.5.
func TestRefundAfterRefillAndOtherDebitsReturnsNothing(t *testing.T) {
	e := mustEngine(t, oneBucket(1, time.Second, 10))
	a := e.Acquire(0, Request{Domain: "d", Cost: 10})
	b := e.Acquire(Time(99*time.Second), Request{Domain: "d", Cost: 10})
	if !a.Admitted || !b.Admitted {
		t.Fatalf("setup: %+v %+v", a, b)
	}
	if got := e.Refund(Time(99500*time.Millisecond), a.Charges, 10, a.DebitSeq); got != (RefundResult{Kept: 1}) {
		t.Fatalf("refund of A after B's debit: %+v, want the bucket to keep the units", got)
	}
	if c := e.Acquire(Time(99500*time.Millisecond), Request{Domain: "d", Cost: 10}); c.Admitted {
		t.Fatalf("C admitted: 20 units in 0.5 s on a 1/s bucket of burst 10")
	}
}

// TestStatusRefusesUndefinedKeyInStrictDomain: Status refuses what Acquire refuses in a
// strict_keys domain (user trial: `quotad bucket status --descriptor endpont=x` listed only
// the domain bucket, exit 0, while acquire named the typo); a value that is not configured
// still just ends the path, as it does for Acquire.
func TestStatusRefusesUndefinedKeyInStrictDomain(t *testing.T) {
	e := mustEngine(t, &Limits{Domains: []Domain{{
		Name: "d", StrictKeys: true,
		Rate:        &Rate{Unit: time.Second, RequestsPerUnit: 10},
		Descriptors: []Node{{Key: "endpoint", Value: "charges", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 5}}},
	}}})
	_, err := e.Status(0, "d", []Entry{{"endpont", "charges"}})
	if !errors.Is(err, ErrInvalidRequest) || !strings.Contains(err.Error(), `"endpont"`) || !strings.Contains(err.Error(), "strict_keys") {
		t.Fatalf("status with an undefined key: %v, want ErrInvalidRequest naming the key", err)
	}
	if d := e.Acquire(0, Request{Domain: "d", Descriptors: []Entry{{"endpont", "charges"}}}); d.Reason != ReasonInvalid {
		t.Fatalf("acquire with the same key: %+v", d)
	}
	bs, err := e.Status(0, "d", []Entry{{"endpoint", "search"}})
	if err != nil || len(bs) != 1 {
		t.Fatalf("status of a value not configured: %v %+v, want the domain bucket only", err, bs)
	}
}

func TestStatusErrors(t *testing.T) {
	e := mustEngine(t, oneBucket(1, time.Second, 0))
	if _, err := e.Status(0, "x", nil); !errors.Is(err, ErrUnknownDomain) {
		t.Fatalf("unknown domain: %v", err)
	}
	if _, err := e.Status(0, "d", []Entry{{"", "v"}}); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("empty key: %v", err)
	}
}

func TestBucketKeyRoundTrip(t *testing.T) {
	entries := []Entry{{"a/b", "c=d"}, {"%", ""}, {"k", "%2F"}}
	key := BucketKey("dom/ain", entries...)
	dom, got, ok := parseKey(key)
	if !ok || dom != "dom/ain" || len(got) != len(entries) {
		t.Fatalf("parse %q: %q %v %v", key, dom, got, ok)
	}
	for i := range entries {
		if got[i] != entries[i] {
			t.Fatalf("entry %d: %v != %v", i, got[i], entries[i])
		}
	}
	for _, bad := range []string{"d/x", "d/k=%", "d/k=%zz", "%4"} {
		if _, _, ok := parseKey(bad); ok {
			t.Errorf("parseKey(%q) accepted a malformed key", bad)
		}
	}
}

func TestUnmarshalRejectsGarbage(t *testing.T) {
	e := mustEngine(t, oneBucket(10, time.Second, 0))
	e.Acquire(0, Request{Domain: "d"})
	good, err := e.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	h := e.Hash()
	for _, bad := range [][]byte{nil, {}, {99}, good[:len(good)-1], append(append([]byte{}, good...), 0)} {
		if err := e.UnmarshalBinary(bad); !errors.Is(err, ErrBadSnapshot) {
			t.Errorf("UnmarshalBinary(%x): %v", bad, err)
		}
		if e.Hash() != h {
			t.Fatal("a failed UnmarshalBinary changed the state")
		}
	}
}

// FuzzUnmarshalBinary: arbitrary input must produce an error or a usable engine, never a panic.
func FuzzUnmarshalBinary(f *testing.F) {
	e := mustEngine(f, &Limits{Domains: []Domain{{
		Name:        "d",
		Rate:        &Rate{Unit: time.Second, RequestsPerUnit: 10},
		Concurrency: &Concurrency{MaxInFlight: 3, LeaseTTL: time.Second},
		Descriptors: []Node{{Key: "t", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 5}}},
	}}})
	e.Acquire(0, Request{Domain: "d", Descriptors: []Entry{{"t", "a"}}})
	e.Acquire(1, Request{Domain: "d", Descriptors: []Entry{{"t", "b"}}})
	e.Pause(1, "d", nil, 5*s)
	seed, _ := e.MarshalBinary()
	f.Add(seed)
	f.Fuzz(func(t *testing.T, data []byte) {
		n := NewEngine()
		if err := n.UnmarshalBinary(data); err != nil {
			return
		}
		n.Acquire(n.Clock()+1, Request{Domain: "d", Descriptors: []Entry{{"t", "a"}}})
		n.Tick(n.Clock() + Time(time.Hour))
		n.Hash()
	})
}

// TestTickDropsExactlyFullBuckets drives both Tick paths (popping a few due entries, sweeping
// when many are due) over thousands of buckets with scattered full-at times, some debited again
// or refunded after they were scheduled, against a brute-force oracle.
func TestTickDropsExactlyFullBuckets(t *testing.T) {
	e := mustEngine(t, &Limits{Domains: []Domain{{
		Name:        "d",
		Descriptors: []Node{{Key: "k", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 10, Burst: 100}}},
	}}})
	req := func(i int, cost uint64) Request {
		return Request{Domain: "d", Descriptors: []Entry{{"k", "v" + strconv.Itoa(i)}}, Cost: cost}
	}
	const n = 5000
	var charges [][]string
	var seqs []uint64
	for i := 0; i < n; i++ {
		d := e.Acquire(Time(i)*ms, req(i, uint64(i%97+1)))
		charges, seqs = append(charges, d.Charges), append(seqs, d.DebitSeq)
	}
	for i := 0; i < n; i += 3 { // debit again: full later than first scheduled
		e.Acquire(Time(n)*ms, req(i, 1))
	}
	for i := 1; i < n; i += 7 { // refund: full earlier than first scheduled
		e.Refund(Time(n)*ms, charges[i], uint64(i%50), seqs[i])
	}
	for now := Time(n) * ms; e.buckets.live > 0; now += 750 * ms {
		want := 0
		for _, b := range storedBuckets(e) {
			if tokens, _ := b.lvl.rate.refill(b.tokens, b.last, now); tokens < b.lvl.rate.capMicro {
				want++
			}
		}
		e.Tick(now)
		if e.buckets.live != want {
			t.Fatalf("tick at %v: %d buckets stored, %d not full", time.Duration(now), e.buckets.live, want)
		}
		for k, b := range storedBuckets(e) {
			if tokens, _ := b.lvl.rate.refill(b.tokens, b.last, now); tokens >= b.lvl.rate.capMicro {
				t.Fatalf("tick at %v kept full bucket %q", time.Duration(now), k)
			}
		}
		if now > Time(time.Hour) {
			t.Fatal("buckets never drained")
		}
	}
}
