package quota

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func maxKeysLimits(maxKeys uint64) *Limits {
	return &Limits{Domains: []Domain{{
		Name:        "d",
		MaxKeys:     maxKeys,
		Descriptors: []Node{{Key: "tenant", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1}}},
	}, {
		// Another domain's buckets do not count against d's max_keys.
		Name:        "other",
		MaxKeys:     1,
		Rate:        &Rate{Unit: time.Second, RequestsPerUnit: 100},
		Descriptors: []Node{{Key: "tenant", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1}}},
	}}}
}

func tenantReq(domain, v string) Request {
	return Request{Domain: domain, Descriptors: []Entry{{"tenant", v}}}
}

func TestMaxKeys(t *testing.T) {
	e := mustEngine(t, maxKeysLimits(3))
	for _, v := range []string{"a", "b", "c"} {
		if d := e.Acquire(0, tenantReq("d", v)); !d.Admitted {
			t.Fatalf("tenant %s: %+v", v, d)
		}
	}
	before, stats := e.Hash(), e.Stats()
	d := e.Acquire(0, tenantReq("d", "fresh"))
	if d.Admitted || d.Reason != ReasonTooManyKeys || d.Scope != "tenant" || d.Limit != 3 || d.RetryAfter != time.Second ||
		!strings.Contains(d.Message, `"d/tenant=fresh"`) || !strings.Contains(d.Message, "max_keys is 3") {
		t.Fatalf("a fourth key: %+v", d)
	}
	if e.Hash() != before || e.Stats() != stats {
		t.Fatal("a too_many_keys denial changed the state")
	}
	// Existing keys are decided as before: the cap only refuses new buckets.
	if d := e.Acquire(0, tenantReq("d", "a")); d.Reason != ReasonRateLimited {
		t.Fatalf("existing key: %+v", d)
	}
	// The other domain's cap is its own: one stored bucket (its ceiling) fills it.
	if d := e.Acquire(0, tenantReq("other", "x")); d.Reason != ReasonTooManyKeys || d.Scope != ScopeDomain || d.Limit != 1 {
		t.Fatalf("other domain, two new buckets with max_keys 1: %+v", d)
	}
	if e.Stats().Buckets != 3 {
		t.Fatalf("buckets: %+v", e.Stats())
	}

	// A snapshot restores the count.
	snap, err := e.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	r := NewEngine()
	if err := r.UnmarshalBinary(snap); err != nil {
		t.Fatal(err)
	}
	if d := r.Acquire(0, tenantReq("d", "fresh")); d.Reason != ReasonTooManyKeys {
		t.Fatalf("restored engine, fourth key: %+v", d)
	}

	// Buckets that refilled are dropped by Tick, which makes room.
	for _, x := range []*Engine{e, r} {
		x.Tick(1 * s)
		if x.Stats().Buckets != 0 {
			t.Fatalf("buckets after the sweep: %+v", x.Stats())
		}
		if d := x.Acquire(1*s, tenantReq("d", "fresh")); !d.Admitted {
			t.Fatalf("after the sweep: %+v", d)
		}
	}
	if e.Hash() != r.Hash() {
		t.Fatal("restored replica diverged")
	}

	// New limits recount: lowering max_keys below what is stored refuses new keys only.
	for _, v := range []string{"a", "b"} {
		e.Acquire(1*s, tenantReq("d", v))
	}
	if err := e.SetLimits(1*s, maxKeysLimits(2)); err != nil {
		t.Fatal(err)
	}
	if d := e.Acquire(1*s, tenantReq("d", "c")); d.Reason != ReasonTooManyKeys || d.Limit != 2 {
		t.Fatalf("after lowering max_keys: %+v", d)
	}
	if err := e.SetLimits(1*s, maxKeysLimits(0)); err != nil { // 0: the default
		t.Fatal(err)
	}
	if d := e.Acquire(1*s, tenantReq("d", "c")); !d.Admitted {
		t.Fatalf("default max_keys: %+v", d)
	}
	if err := e.SetLimits(1*s, maxKeysLimits(MaxMaxKeys+1)); !errors.Is(err, ErrInvalidLimits) || !strings.Contains(err.Error(), "max_keys") {
		t.Fatalf("max_keys above the maximum: %v", err)
	}
}

// TestMaxKeysFlood: a flood of fresh values stops at max_keys, and the count follows the
// sweeps as the buckets refill (memory follows active keys, not keys ever seen).
func TestMaxKeysFlood(t *testing.T) {
	e := mustEngine(t, maxKeysLimits(1000))
	admitted, refused := 0, 0
	for i := range 5000 {
		now := Time(i) * ms
		if i%1000 == 0 {
			e.Tick(now)
		}
		switch d := e.Acquire(now, tenantReq("d", "t"+itoa(i))); d.Reason {
		case ReasonOK:
			admitted++
		case ReasonTooManyKeys:
			refused++
		default:
			t.Fatalf("fresh key %d: %+v", i, d)
		}
		if n := e.Stats().Buckets; n > 1000 {
			t.Fatalf("%d buckets stored with max_keys 1000", n)
		}
	}
	// With a sweep a second (as the fsm runs them), keys admitted in one second are full
	// during the next and dropped by the sweep after: max_keys fresh keys every other second.
	if admitted != 5000-refused || refused == 0 || admitted < 3000 {
		t.Fatalf("admitted %d, refused %d", admitted, refused)
	}
}

func itoa(i int) string {
	var b [20]byte
	n := len(b)
	for {
		n--
		b[n] = byte('0' + i%10)
		if i /= 10; i == 0 {
			return string(b[n:])
		}
	}
}

func TestFieldCaps(t *testing.T) {
	e := mustEngine(t, maxKeysLimits(0))
	long := strings.Repeat("x", MaxFieldBytes+1)
	ok := strings.Repeat("x", MaxFieldBytes)
	many := make([]Entry, MaxDescriptors+1)
	for i := range many {
		many[i] = Entry{"tenant", "a"}
	}
	before := e.Hash()
	for name, tc := range map[string]struct {
		req  Request
		want string
	}{
		"domain":     {Request{Domain: long}, "domain is 257 bytes; the limit is 256"},
		"key":        {Request{Domain: "d", Descriptors: []Entry{{long, "a"}}}, "descriptor entry #0 key is 257 bytes"},
		"value":      {Request{Domain: "d", Descriptors: []Entry{{"tenant", long}}}, "descriptor entry #0 (tenant) value is 257 bytes"},
		"work_class": {Request{Domain: "d", WorkClass: long}, "work_class is 257 bytes; the limit is 256"},
		"entries":    {Request{Domain: "d", Descriptors: many}, "17 descriptor entries; at most 16"},
	} {
		d := e.Acquire(0, tc.req)
		if d.Reason != ReasonInvalid || !strings.Contains(d.Message, tc.want) {
			t.Errorf("%s: %+v, want invalid with %q", name, d, tc.want)
		}
	}
	if e.Hash() != before {
		t.Fatal("refused requests changed the state")
	}
	if d := e.Acquire(0, Request{Domain: "d", Descriptors: []Entry{{"tenant", ok}}, WorkClass: ok}); !d.Admitted {
		t.Fatalf("fields of exactly %d bytes: %+v", MaxFieldBytes, d)
	}
	if _, err := e.Feedback(0, Feedback{Domain: "d", StatusCode: StatusTooManyRequests, Reason: long}); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("feedback reason of 257 bytes: %v", err)
	}
	if _, err := e.Pause(0, "d", []Entry{{"tenant", long}}, s); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("pause with a 257-byte value: %v", err)
	}
}
