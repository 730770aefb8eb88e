package quota

import (
	"testing"
	"time"
)

// Scheduled grants put a batch of admissions into one command at the bucket's pace: at burst
// 1 and 1000/s, five requests decided at the same now take effect 1 ms apart, back to back
// (no token is lost while they are in flight), and a request that may not wait gets only what
// they left: nothing before the last slot.
func TestScheduledGrantsTakeTokensBackToBack(t *testing.T) {
	e := mustEngine(t, &Limits{Domains: []Domain{{Name: "d", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1000, Burst: 1}},
		{Name: "h", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1000, Burst: 1},
			Descriptors: []Node{{Key: "t", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 500, Burst: 1}}}}}})
	now := 10 * s
	for i := range 5 {
		d := e.Acquire(now, Request{Domain: "d", ScheduleWithin: 10 * time.Millisecond})
		if want := time.Duration(i) * time.Millisecond; !d.Admitted || d.RetryAfter != want {
			t.Fatalf("grant %d: %+v, want admitted taking effect after %v", i, d, want)
		}
	}
	// Not allowed to wait: refused, told when the bucket can pay after the scheduled grants.
	if d := e.Acquire(now, Request{Domain: "d"}); d.Admitted || d.RetryAfter != 5*time.Millisecond {
		t.Fatalf("non-waiting request beside scheduled grants: %+v, want rate_limited retry 5ms", d)
	}
	// Allowed to wait less than that: refused the same way, and nothing changes.
	h := e.Hash()
	if d := e.Acquire(now, Request{Domain: "d", ScheduleWithin: 4 * time.Millisecond}); d.Admitted || d.RetryAfter != 5*time.Millisecond {
		t.Fatalf("request that cannot wait long enough: %+v", d)
	}
	if e.Hash() != h {
		t.Fatal("a refused scheduled request changed the state")
	}
	// The bucket's time runs ahead of the clock: a snapshot keeps it.
	data, err := e.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	r := NewEngine()
	if err := r.UnmarshalBinary(data); err != nil || r.Hash() != e.Hash() {
		t.Fatalf("snapshot round trip with a bucket ahead of the clock: %v", err)
	}
	// Exactly at the next slot a plain request is admitted, one nanosecond before it is not.
	if d := r.Acquire(now.Add(5*time.Millisecond-1), Request{Domain: "d"}); d.Admitted {
		t.Fatalf("admitted 1ns before the bucket could pay: %+v", d)
	}
	if d := r.Acquire(now.Add(5*time.Millisecond), Request{Domain: "d"}); !d.Admitted || d.RetryAfter != 0 {
		t.Fatalf("plain request at the next slot: %+v", d)
	}

	// A hierarchy is scheduled at the moment every level can pay: the tenant's 500/s binds.
	path := []Entry{{"t", "x"}}
	var got []time.Duration
	for range 3 {
		d := e.Acquire(now, Request{Domain: "h", Descriptors: path, ScheduleWithin: time.Second})
		if !d.Admitted {
			t.Fatalf("hierarchical grant: %+v", d)
		}
		got = append(got, d.RetryAfter)
	}
	if got[0] != 0 || got[1] != 2*time.Millisecond || got[2] != 4*time.Millisecond {
		t.Fatalf("hierarchical slots %v, want [0 2ms 4ms]", got)
	}
	// Another tenant is held only by the domain's bucket, which the grants used up to 4 ms.
	if d := e.Acquire(now, Request{Domain: "h", Descriptors: []Entry{{"t", "y"}}, ScheduleWithin: time.Second}); !d.Admitted || d.RetryAfter != 5*time.Millisecond {
		t.Fatalf("other tenant: %+v, want the domain's next slot at 5ms", d)
	}
}
