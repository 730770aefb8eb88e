package chaos

import (
	"strings"
	"testing"
	"time"
)

// sharesHistory is the shares bucket over 20 s: a holder holding 45/s of the 100/s reports
// its local admissions in 10 ms ticks, the central caller is admitted at the central part's
// 55/s; the holder is stopped (SIGSTOP) from 6 s to 11 s, past its 3 s lease, and its share
// returns to the central part at its end + margin. A correct holder admits nothing after its
// lease ended; a broken one (ignoring its expiry) goes on admitting at 45/s from 11 s on,
// while the central caller is admitted at the whole 100/s from 9.5 s.
func sharesHistory(ignoreExpiry bool) *History {
	h := &History{}
	add := func(op Op) {
		op.Index, op.Kind, op.Bucket, op.Outcome = len(h.Ops), KindRate, SharesBucket, Admitted
		h.Ops = append(h.Ops, op)
	}
	tick := int64(10 * time.Millisecond)
	leaseEnd := int64(6*time.Second) + int64(SharesLease) - int64(500*time.Millisecond) // last grant at 3.5 s
	var owed float64
	for at := int64(0); at < 20*sec; at += tick {
		stopped := at >= 6*sec && at < 11*sec
		if stopped || (at >= leaseEnd && !ignoreExpiry) {
			continue
		}
		owed += 45 * float64(tick) / 1e9
		if n := uint64(owed); n > 0 {
			owed -= float64(n)
			add(Op{Worker: 1000, Cost: n, Call: at, Return: at + tick/2, Reason: "local"})
		}
	}
	// Central: 55/s while the holder is charged (until its end + m_F), then 100/s.
	var c float64
	for at := int64(0); at < 20*sec; at += tick {
		r := 55.0
		if at >= leaseEnd+int64(250*time.Millisecond) {
			r = 100
		}
		c += r * float64(tick) / 1e9
		for ; c >= 1; c-- {
			add(Op{Worker: 999, Cost: 1, Call: at, Return: at + tick/2})
		}
	}
	return h
}

// TestSharesBoundCatchesHolderIgnoringExpiry: bounded-admission over holders' local
// decisions plus central ones passes a holder that stops at its expiry and reports the one
// that ignores it (the planted chaos_bug_holderexpiry in a history).
func TestSharesBoundCatchesHolderIgnoringExpiry(t *testing.T) {
	lim := map[string]RateLimit{SharesBucket: {SharesBurst, SharesRate}}
	if res := CheckBoundedAdmission(sharesHistory(false), lim); !res.OK {
		t.Fatalf("a holder that stops at its expiry was reported: %+v", res)
	}
	res := CheckBoundedAdmission(sharesHistory(true), lim)
	if res.OK || !strings.Contains(strings.Join(res.Details, "\n"), "over-admission") {
		t.Fatalf("a holder that ignores its expiry was not reported: %+v", res)
	}
	t.Logf("%s", strings.Join(res.Details, "\n"))
	if r := CheckShares(sharesHistory(false), true); r.OK {
		t.Fatalf("shares-workload passed without holder faults: %+v", r)
	}
}
