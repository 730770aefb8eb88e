package quota

import (
	"testing"
	"time"
)

// TestConcurrencyDenialRetryAfter: a concurrency_limited denial says when a permit of the
// refusing level frees up at the latest — the earliest expiry among the leases holding it —
// following renewals, releases, expiries and a snapshot round trip.
func TestConcurrencyDenialRetryAfter(t *testing.T) {
	e := mustEngine(t, &Limits{Domains: []Domain{{
		Name:        "d",
		Concurrency: &Concurrency{MaxInFlight: 3, LeaseTTL: time.Minute},
		Descriptors: []Node{{Key: "job", Concurrency: &Concurrency{MaxInFlight: 2, LeaseTTL: 10 * time.Second}}},
	}}})
	job := func(v string) Request {
		return Request{Domain: "d", Descriptors: []Entry{{"job", v}}, ConcurrencyRetryAfter: true}
	}
	denied := func(at Time, r Request, scope string, want time.Duration) {
		t.Helper()
		d := e.Acquire(at, r)
		if d.Reason != ReasonConcurrencyLimited || d.Scope != scope || d.RetryAfter != want {
			t.Fatalf("at %v: %+v; want concurrency_limited scope %s retry_after %v", time.Duration(at), d, scope, want)
		}
	}
	a := e.Acquire(0, job("x"))   // job=x until 10s
	b := e.Acquire(2*s, job("x")) // job=x until 12s
	if !a.Admitted || !b.Admitted {
		t.Fatalf("a %+v b %+v", a, b)
	}
	denied(3*s, job("x"), "job", 7*time.Second) // a expires first, at 10s
	old := job("x")
	old.ConcurrencyRetryAfter = false // as older log entries are decided
	denied(3*s, old, "job", 0)
	// Renewing a moves it past b: b's expiry (12s) is now the earliest.
	if _, err := e.Renew(4*s, a.LeaseID, 0); err != nil { // a until 14s
		t.Fatal(err)
	}
	denied(5*s, job("x"), "job", 7*time.Second)
	// Many renewals of one lease leave stale index entries behind; the answer stays right and
	// the index stays small.
	for i := 0; i < 1000; i++ {
		if _, err := e.Renew(5*s, a.LeaseID, 0); err != nil { // a until 15s
			t.Fatal(err)
		}
	}
	if h := e.held[BucketKey("d", Entry{"job", "x"})]; h == nil || len(*h) > 2*2+8+1 {
		t.Fatalf("the index of job=x holds %d entries for 2 permits", len(*h))
	}
	denied(6*s, job("x"), "job", 6*time.Second)
	// b released: a free permit — admitted, and c takes it (c until 17s).
	if !e.Release(7*s, b.LeaseID) {
		t.Fatal("release b")
	}
	c := e.Acquire(7*s, job("x"))
	if !c.Admitted {
		t.Fatalf("c after b's release: %+v", c)
	}
	denied(8*s, job("x"), "job", 7*time.Second) // a at 15s
	// The domain level: a (15s), c (17s), y (18s at job=y) hold its 3 permits.
	if y := e.Acquire(8*s, job("y")); !y.Admitted {
		t.Fatalf("y: %+v", y)
	}
	denied(9*s, job("z"), ScopeDomain, 6*time.Second)
	// The index is rebuilt from a snapshot: both engines answer alike.
	data, err := e.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	restored := NewEngine()
	if err := restored.UnmarshalBinary(data); err != nil {
		t.Fatal(err)
	}
	for _, eng := range []*Engine{e, restored} {
		e = eng
		denied(14*s, job("z"), ScopeDomain, 1*time.Second) // a at 15s
	}
}
