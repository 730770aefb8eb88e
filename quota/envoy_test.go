package quota

import (
	"math"
	"testing"
	"time"
)

func envoyLimits() *Limits {
	return &Limits{Domains: []Domain{
		{Name: "rl", Descriptors: []Node{
			{Key: "tenant", Rate: perMinute(5), Children: []Node{
				{Key: "user", Rate: perMinute(2)},
			}},
			{Key: "path", Value: "files/*", Rate: perMinute(2)},
			{Key: "shared", Value: "x*", ShareThreshold: true, Rate: perMinute(2)},
			{Key: "blocked", Rate: &Rate{Unit: time.Minute}},
			{Key: "free", Unlimited: true},
			{Key: "shadow", Rate: perMinute(1), ShadowMode: true},
			{Key: "quota", Rate: perMinute(1), QuotaMode: true},
			{Key: "category", Value: "account", Rate: perMinute(4), Replaces: []string{"bk"}},
			{Key: "dest", Value: "bk", Rate: perMinute(1), Name: "bk"},
		}},
		{Name: "ceiled", Rate: perMinute(3), Descriptors: []Node{{Key: "k", Rate: perMinute(10)}}},
	}}
}

func rls(domain string, ds ...[]Entry) RLSRequest {
	r := RLSRequest{Domain: domain}
	for _, d := range ds {
		r.Descriptors = append(r.Descriptors, RLSDescriptor{Entries: d})
	}
	return r
}

func ent(kv ...string) []Entry {
	var out []Entry
	for i := 0; i < len(kv); i += 2 {
		out = append(out, Entry{kv[i], kv[i+1]})
	}
	return out
}

func codes(d RLSDecision) []RLSCode {
	out := []RLSCode{d.Code}
	for _, s := range d.Statuses {
		out = append(out, s.Code)
	}
	return out
}

func sameCodes(a, b []RLSCode) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestRateLimitEnvoySemantics(t *testing.T) {
	ok, over := RLSOK, RLSOverLimit
	tests := []struct {
		name  string
		reqs  []RLSRequest
		codes [][]RLSCode // per request: overall, then each descriptor
	}{
		{"burst within one window, then over", []RLSRequest{
			rls("rl", ent("tenant", "a", "user", "u")), rls("rl", ent("tenant", "a", "user", "u")),
			rls("rl", ent("tenant", "a", "user", "u")),
		}, [][]RLSCode{{ok, ok}, {ok, ok}, {over, over}}},
		{"only the last entry's rule is charged", []RLSRequest{
			// 4 requests at tenant+user(u1..u4), 2 each allowed: the tenant's 5 are never charged.
			rls("rl", ent("tenant", "a", "user", "1")), rls("rl", ent("tenant", "a", "user", "2")),
			rls("rl", ent("tenant", "a", "user", "3")), rls("rl", ent("tenant", "a", "user", "4")),
			rls("rl", ent("tenant", "a")), rls("rl", ent("tenant", "a")), rls("rl", ent("tenant", "a")),
			rls("rl", ent("tenant", "a")), rls("rl", ent("tenant", "a")), rls("rl", ent("tenant", "a")),
		}, [][]RLSCode{{ok, ok}, {ok, ok}, {ok, ok}, {ok, ok}, {ok, ok}, {ok, ok}, {ok, ok}, {ok, ok}, {ok, ok}, {over, over}}},
		{"deeper than config: no limit", []RLSRequest{
			rls("rl", ent("tenant", "a", "user", "u", "x", "1")), rls("rl", ent("tenant", "a", "user", "u", "x", "1")),
			rls("rl", ent("tenant", "a", "user", "u", "x", "1")),
		}, [][]RLSCode{{ok, ok}, {ok, ok}, {ok, ok}}},
		{"wildcard: one bucket per value", []RLSRequest{
			rls("rl", ent("path", "files/a")), rls("rl", ent("path", "files/a")), rls("rl", ent("path", "files/a")),
			rls("rl", ent("path", "files/b")),
		}, [][]RLSCode{{ok, ok}, {ok, ok}, {over, over}, {ok, ok}}},
		{"share_threshold: one bucket for all values", []RLSRequest{
			rls("rl", ent("shared", "x1")), rls("rl", ent("shared", "x2")), rls("rl", ent("shared", "x3")),
		}, [][]RLSCode{{ok, ok}, {ok, ok}, {over, over}}},
		{"blocked", []RLSRequest{rls("rl", ent("blocked", "v"))}, [][]RLSCode{{over, over}}},
		{"unlimited", []RLSRequest{rls("rl", ent("free", "v")), rls("rl", ent("free", "v"))}, [][]RLSCode{{ok, ok}, {ok, ok}}},
		{"shadow never denies", []RLSRequest{rls("rl", ent("shadow", "v")), rls("rl", ent("shadow", "v"))},
			[][]RLSCode{{ok, ok}, {ok, ok}}},
		{"quota mode never denies", []RLSRequest{rls("rl", ent("quota", "v")), rls("rl", ent("quota", "v"))},
			[][]RLSCode{{ok, ok}, {ok, ok}}},
		{"replaces: the replaced rule does not apply", []RLSRequest{
			rls("rl", ent("category", "account"), ent("dest", "bk")), rls("rl", ent("category", "account"), ent("dest", "bk")),
			rls("rl", ent("dest", "bk")), rls("rl", ent("dest", "bk")),
		}, [][]RLSCode{{ok, ok, ok}, {ok, ok, ok}, {ok, ok}, {over, over}}},
		{"each descriptor on its own", []RLSRequest{
			rls("rl", ent("blocked", "v"), ent("tenant", "b", "user", "u")),
			rls("rl", ent("tenant", "b", "user", "u")), rls("rl", ent("tenant", "b", "user", "u")),
		}, [][]RLSCode{{over, over, ok}, {ok, ok}, {over, over}}}, // the first request charged user u
		{"unknown domain", []RLSRequest{rls("nope", ent("a", "b"))}, [][]RLSCode{{ok, ok}}},
		{"ceiling first, charged once per request", []RLSRequest{
			rls("ceiled", ent("k", "1"), ent("k", "2")), rls("ceiled", ent("k", "1")), rls("ceiled", ent("k", "3")),
			rls("ceiled", ent("k", "4")),
		}, [][]RLSCode{{ok, ok, ok}, {ok, ok}, {ok, ok}, {over, over}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := mustEngine(t, envoyLimits())
			for i, req := range tt.reqs {
				d := e.RateLimit(Time(i)*ms, req)
				if got := codes(d); !sameCodes(got, tt.codes[i]) {
					t.Fatalf("request %d (%v): codes %v, want %v (%+v)", i, req.Descriptors, got, tt.codes[i], d)
				}
			}
		})
	}
}

func TestRateLimitStatuses(t *testing.T) {
	e := mustEngine(t, envoyLimits())
	d := e.RateLimit(0, rls("rl", ent("tenant", "a", "user", "u"), ent("free", "x"), ent("nope", "1"), ent("shadow", "s")))
	u, free, none, sh := d.Statuses[0], d.Statuses[1], d.Statuses[2], d.Statuses[3]
	if !u.Limited || u.Limit != 2 || u.Window != time.Minute || u.Remaining != 1 || u.ResetAfter != 30*time.Second || u.Scope != "user" {
		t.Errorf("user status %+v: want limit 2/min, remaining 1, full again in 30s", u)
	}
	if free.Limited || !free.Unlimited || free.Remaining != math.MaxUint32 {
		t.Errorf("unlimited status %+v: want no limit, remaining MaxUint32", free)
	}
	if none.Limited || none.Remaining != 0 || none.Code != RLSOK {
		t.Errorf("no-rule status %+v", none)
	}
	d = e.RateLimit(0, rls("rl", ent("shadow", "s")))
	if sh = d.Statuses[0]; sh.Code != RLSOK || !sh.Shadow || sh.Remaining != 0 {
		t.Errorf("shadow status over the limit %+v: want OK, Shadow", sh)
	}
	// Over: remaining 0 and the time until the bucket is full.
	e.RateLimit(0, rls("rl", ent("tenant", "a", "user", "u")))
	d = e.RateLimit(0, rls("rl", ent("tenant", "a", "user", "u")))
	if o := d.Statuses[0]; o.Code != RLSOverLimit || o.Remaining != 0 || o.ResetAfter != time.Minute || o.UsedBefore != 2 {
		t.Errorf("over status %+v", o)
	}
	// A refused hit is not charged (token bucket): after 30s one unit is back.
	if d = e.RateLimit(30*s, rls("rl", ent("tenant", "a", "user", "u"))); d.Code != RLSOK {
		t.Errorf("30s later: %v, want OK (the refused hit must not have been charged)", codes(d))
	}
}

func TestRateLimitHitsAddend(t *testing.T) {
	e := mustEngine(t, envoyLimits())
	user := ent("tenant", "a", "user", "u")
	req := RLSRequest{Domain: "rl", Hits: 2, Descriptors: []RLSDescriptor{{Entries: user}}}
	if d := e.RateLimit(0, req); d.Code != RLSOK || d.Statuses[0].Remaining != 0 {
		t.Fatalf("hits_addend 2 of 2: %+v", d)
	}
	// A per-descriptor hits_addend of 0 checks without charging: the bucket is empty.
	check := RLSRequest{Domain: "rl", Descriptors: []RLSDescriptor{{Entries: user, HasHits: true}}}
	h := e.Hash()
	if d := e.RateLimit(0, check); d.Code != RLSOverLimit {
		t.Errorf("check of an empty bucket: %v, want OVER_LIMIT", codes(d))
	}
	if e.Hash() != h {
		t.Error("a check without charge changed the state")
	}
	other := RLSRequest{Domain: "rl", Descriptors: []RLSDescriptor{{Entries: ent("tenant", "b", "user", "u"), HasHits: true}}}
	if d := e.RateLimit(0, other); d.Code != RLSOK || d.Statuses[0].Remaining != 2 {
		t.Errorf("check of a full bucket: %+v, want OK remaining 2", d)
	}
	if e.Hash() != h {
		t.Error("a check without charge changed the state")
	}
	big := RLSRequest{Domain: "rl", Hits: math.MaxUint32, Descriptors: []RLSDescriptor{{Entries: ent("tenant", "c", "user", "u")}}}
	if d := e.RateLimit(0, big); d.Code != RLSOverLimit {
		t.Errorf("hits above the capacity: %v, want OVER_LIMIT", codes(d))
	}
}

// A request above the limit's whole capacity can never pass: duration_until_reset must not say
// "now" (0) when the bucket is full (trial: 70000 against 60000/min answered 0). It is one
// window, as envoyproxy/ratelimit never answers 0 (its window's end), or the time until the
// bucket is full if that is longer; shadow and quota mode, the ceiling and an override alike.
func TestRateLimitHitsAboveCapacityReset(t *testing.T) {
	l := envoyLimits()
	l.Domains = append(l.Domains, Domain{Name: "big", Rate: perMinute(60000), Descriptors: []Node{
		{Key: "k", Rate: perMinute(60000)},
	}})
	e := mustEngine(t, l)
	over := func(now Time, domain string, hits uint64, d RLSDescriptor) RLSStatus {
		t.Helper()
		r := e.RateLimit(now, RLSRequest{Domain: domain, Hits: hits, Descriptors: []RLSDescriptor{d}})
		if r.Code != RLSOverLimit {
			t.Fatalf("%s %v hits %d: %v, want OVER_LIMIT", domain, d.Entries, hits, codes(r))
		}
		return r.Statuses[0]
	}
	// The ceiling (60000/min) refuses first, with the bucket full.
	if st := over(0, "big", 70000, RLSDescriptor{Entries: ent("k", "a")}); st.ResetAfter != time.Minute {
		t.Errorf("70000 against a full 60000/min ceiling: reset after %v, want 1m0s", st.ResetAfter)
	}
	if st := over(0, "rl", 3, RLSDescriptor{Entries: ent("tenant", "a", "user", "u")}); st.ResetAfter != time.Minute {
		t.Errorf("3 against a full 2/min bucket: reset after %v, want 1m0s", st.ResetAfter)
	}
	// A descriptor's own hits_addend above the capacity, the ceiling not involved.
	if st := over(0, "rl", 0, RLSDescriptor{Entries: ent("path", "files/a"), Hits: 5, HasHits: true}); st.ResetAfter != time.Minute {
		t.Errorf("descriptor hits 5 against a full 2/min bucket: reset after %v, want 1m0s", st.ResetAfter)
	}
	// An override: 3 against its own full 2/hour bucket.
	if st := over(0, "rl", 3, withLimit(ent("nope", "o"), 2, time.Hour)); st.ResetAfter != time.Hour {
		t.Errorf("3 against a full 2/hour override: reset after %v, want 1h0m0s", st.ResetAfter)
	}
	// Within the capacity, over what is left: the time until it can pass, unchanged (30s for
	// one of 2/min spent).
	e.RateLimit(0, rls("rl", ent("path", "files/b")))
	if st := over(0, "rl", 2, RLSDescriptor{Entries: ent("path", "files/b")}); st.ResetAfter != 30*time.Second {
		t.Errorf("2 against 1 left of 2/min: reset after %v, want 30s (until full)", st.ResetAfter)
	}
}

func TestRateLimitInvalid(t *testing.T) {
	e := mustEngine(t, envoyLimits())
	h := e.Hash()
	for _, req := range []RLSRequest{
		{Domain: "rl"},
		rls("", ent("a", "b")),
		rls("rl", nil),
		rls("rl", ent("", "b")),
	} {
		if d := e.RateLimit(0, req); d.Code != RLSUnknown || d.Message == "" {
			t.Errorf("%+v: %+v, want RLSUnknown with a message", req, d)
		}
	}
	if e.Hash() != h {
		t.Error("an invalid request changed the state")
	}
}

// The RLS and the native API charge the same buckets, and buckets the RLS created survive a
// snapshot and a limits change like any other.
func TestRateLimitSharesBucketsWithNative(t *testing.T) {
	e := mustEngine(t, envoyLimits())
	e.RateLimit(0, rls("rl", ent("path", "files/a"), ent("shared", "x9")))
	if d := e.Acquire(0, Request{Domain: "rl", Descriptors: ent("path", "files/a")}); !d.Admitted || d.Remaining != 0 {
		t.Errorf("native after one RLS hit: %+v, want admitted with 0 remaining", d)
	}
	if d := e.Acquire(0, Request{Domain: "rl", Descriptors: ent("shared", "x1")}); !d.Admitted || d.Remaining != 0 {
		t.Errorf("native on the shared wildcard bucket: %+v", d)
	}
	if d := e.Acquire(0, Request{Domain: "rl", Descriptors: ent("blocked", "v")}); d.Admitted || d.Reason != ReasonRateLimited || d.Window != time.Minute {
		t.Errorf("native on a blocked level: %+v, want rate_limited", d)
	}
	data, err := e.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	r := NewEngine()
	if err := r.UnmarshalBinary(data); err != nil {
		t.Fatal(err)
	}
	if r.Hash() != e.Hash() {
		t.Error("restored engine differs")
	}
	if err := r.SetLimits(0, envoyLimits()); err != nil {
		t.Fatal(err)
	}
	if got := r.Stats().Buckets; got != 2 {
		t.Errorf("%d buckets after SetLimits, want the 2 wildcard buckets kept", got)
	}
	if d := r.RateLimit(0, rls("rl", ent("shared", "x5"))); d.Code != RLSOverLimit {
		t.Errorf("shared bucket after restore + SetLimits: %v, want OVER_LIMIT", codes(d))
	}
}

// Replicas applying the same RLS requests agree.
func TestRateLimitDeterministic(t *testing.T) {
	a, b := mustEngine(t, envoyLimits()), mustEngine(t, envoyLimits())
	for i := range 200 {
		req := rls("rl", ent("tenant", string(rune('a'+i%5)), "user", string(rune('a'+i%3))), ent("path", "files/"+string(rune('a'+i%4))))
		now := Time(i) * 100 * ms
		if da, db := a.RateLimit(now, req), b.RateLimit(now, req); !sameCodes(codes(da), codes(db)) {
			t.Fatalf("replicas disagree at %d", i)
		}
	}
	if a.Hash() != b.Hash() {
		t.Fatal("replica hashes differ")
	}
}

func withLimit(entries []Entry, rpu uint32, unit time.Duration) RLSDescriptor {
	return RLSDescriptor{Entries: entries, Limit: &RLSLimit{RequestsPerUnit: rpu, Unit: unit}}
}

// A descriptor's own limit (Envoy's override) replaces the configuration for it, with
// envoyproxy/ratelimit's meaning; its buckets survive snapshots, limits changes and expiry.
func TestRateLimitOverride(t *testing.T) {
	ok, over := RLSOK, RLSOverLimit
	one := func(d RLSDescriptor) RLSRequest { return RLSRequest{Domain: "rl", Descriptors: []RLSDescriptor{d}} }
	tests := []struct {
		name  string
		reqs  []RLSRequest
		codes [][]RLSCode
	}{
		{"a descriptor without a rule gets the override", []RLSRequest{
			one(withLimit(ent("nope", "1"), 2, time.Minute)), one(withLimit(ent("nope", "1"), 2, time.Minute)),
			one(withLimit(ent("nope", "1"), 2, time.Minute)), one(withLimit(ent("nope", "2"), 2, time.Minute)),
		}, [][]RLSCode{{ok, ok}, {ok, ok}, {over, over}, {ok, ok}}},
		{"deeper than the configuration", []RLSRequest{
			one(withLimit(ent("free", "x", "deeper", "y"), 1, time.Hour)), one(withLimit(ent("free", "x", "deeper", "y"), 1, time.Hour)),
		}, [][]RLSCode{{ok, ok}, {over, over}}},
		{"overrides unlimited, shadow and quota mode", []RLSRequest{
			one(withLimit(ent("free", "x"), 1, time.Minute)), one(withLimit(ent("free", "x"), 1, time.Minute)),
			one(withLimit(ent("shadow", "s"), 1, time.Second)), one(withLimit(ent("shadow", "s"), 1, time.Second)),
			one(withLimit(ent("quota", "q"), 1, time.Second)), one(withLimit(ent("quota", "q"), 1, time.Second)),
		}, [][]RLSCode{{ok, ok}, {over, over}, {ok, ok}, {over, over}, {ok, ok}, {over, over}}},
		{"requests_per_unit 0 blocks", []RLSRequest{one(withLimit(ent("tenant", "a"), 0, time.Minute))}, [][]RLSCode{{over, over}}},
		{"the same limit as the rule shares its bucket", []RLSRequest{
			rls("rl", ent("tenant", "a", "user", "u")),
			one(withLimit(ent("tenant", "a", "user", "u"), 2, time.Minute)),
			rls("rl", ent("tenant", "a", "user", "u")),
		}, [][]RLSCode{{ok, ok}, {ok, ok}, {over, over}}},
		{"another limit has a bucket of its own", []RLSRequest{
			rls("rl", ent("tenant", "a", "user", "u")), rls("rl", ent("tenant", "a", "user", "u")),
			one(withLimit(ent("tenant", "a", "user", "u"), 3, time.Minute)),
			one(withLimit(ent("tenant", "a", "user", "u"), 2, time.Hour)),
		}, [][]RLSCode{{ok, ok}, {ok, ok}, {ok, ok}, {ok, ok}}},
		{"a rule replaced by name elsewhere still applies as an override", []RLSRequest{
			{Domain: "rl", Descriptors: []RLSDescriptor{{Entries: ent("category", "account")}, withLimit(ent("dest", "bk"), 1, time.Minute)}},
			{Domain: "rl", Descriptors: []RLSDescriptor{{Entries: ent("category", "account")}, withLimit(ent("dest", "bk"), 1, time.Minute)}},
		}, [][]RLSCode{{ok, ok, ok}, {over, ok, over}}},
		{"unknown domain: no limit", []RLSRequest{
			{Domain: "nope", Descriptors: []RLSDescriptor{withLimit(ent("a", "b"), 0, time.Minute)}},
		}, [][]RLSCode{{ok, ok}}},
		{"the ceiling still applies", []RLSRequest{
			{Domain: "ceiled", Hits: 3, Descriptors: []RLSDescriptor{withLimit(ent("k", "1"), 100, time.Minute)}},
			{Domain: "ceiled", Descriptors: []RLSDescriptor{withLimit(ent("k", "1"), 100, time.Minute)}},
		}, [][]RLSCode{{ok, ok}, {over, over}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := mustEngine(t, envoyLimits())
			for i, req := range tt.reqs {
				d := e.RateLimit(Time(i)*ms, req)
				if got := codes(d); !sameCodes(got, tt.codes[i]) {
					t.Fatalf("request %d (%+v): codes %v, want %v (%+v)", i, req.Descriptors, got, tt.codes[i], d)
				}
			}
		})
	}

	e := mustEngine(t, envoyLimits())
	d := e.RateLimit(0, one(withLimit(ent("tenant", "a", "user", "u"), 7, time.Hour)))
	if st := d.Statuses[0]; !st.Limited || st.Limit != 7 || st.Window != time.Hour || st.Name != "" || st.Remaining != 6 || st.Scope != ScopeOverride {
		t.Errorf("override status %+v: want 7/hour, no name, 6 remaining, scope override", st)
	}
	if d := e.RateLimit(0, RLSRequest{Domain: "rl", Descriptors: []RLSDescriptor{withLimit(ent("a", "b"), 1, 1500*time.Millisecond)}}); d.Code != RLSUnknown {
		t.Errorf("override unit 1.5s: %v, want refused", codes(d))
	}
	// Snapshot, limits change and refill keep the override bucket's own rate.
	data, err := e.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	r := NewEngine()
	if err := r.UnmarshalBinary(data); err != nil {
		t.Fatal(err)
	}
	if r.Hash() != e.Hash() {
		t.Fatal("restored engine differs")
	}
	l := envoyLimits()
	l.Domains[0].Descriptors = l.Domains[0].Descriptors[1:] // "tenant" is gone; the override stays
	if err := r.SetLimits(0, l); err != nil {
		t.Fatal(err)
	}
	if d := r.RateLimit(0, one(withLimit(ent("tenant", "a", "user", "u"), 7, time.Hour))); d.Statuses[0].Remaining != 5 {
		t.Errorf("after restore + SetLimits: %+v, want 5 remaining", d.Statuses[0])
	}
	r.Tick(Time(2 * time.Hour))
	if got := r.Stats().Buckets; got != 0 {
		t.Errorf("%d buckets 2 hours later, want the full override bucket dropped", got)
	}
	l.Domains = l.Domains[1:] // the domain is gone: its override buckets too
	e.SetLimits(0, l)
	if got := e.Stats().Buckets; got != 0 {
		t.Errorf("%d buckets after the domain was removed, want 0", got)
	}
}

// Overrides count against the domain's max_keys like every other bucket.
func TestRateLimitOverrideMaxKeys(t *testing.T) {
	l := envoyLimits()
	l.Domains[0].MaxKeys = 3
	e := mustEngine(t, l)
	for i := range 5 {
		d := e.RateLimit(0, RLSRequest{Domain: "rl", Descriptors: []RLSDescriptor{withLimit(ent("u", string(rune('a'+i))), 10, time.Minute)}})
		if want := i >= 3; (d.Code == RLSOverLimit) != want || d.Statuses[0].TooManyKeys != want {
			t.Errorf("override bucket %d with max_keys 3: %+v", i, d.Statuses[0])
		}
	}
}
