package fsm

import (
	"testing"
	"time"

	"github.com/quotad/quotad/quota"
)

// TestConcurrencyRetryAfterByCommandVersion: a version 3 entry's concurrency_limited denial
// says when the earliest lease on the refusing level expires; a version 2 entry (an older
// leader's) is decided with retry_after 0 as that leader decided it, so replicas of both
// builds agree.
func TestConcurrencyRetryAfterByCommandVersion(t *testing.T) {
	for _, tc := range []struct {
		version uint32
		want    time.Duration
	}{{2, 0}, {3, 4 * time.Second}} {
		l := newLog(t)
		l.version = tc.version
		// tenant=acme allows 2 in flight with 5 s leases: taken at 1 s and 1.5 s.
		l.apply(1*time.Second, acquire("c", 1, "acme", 1))
		l.apply(1500*time.Millisecond, acquire("c", 2, "acme", 1))
		d := l.apply(2*time.Second, acquire("c", 3, "acme", 1)).Ops[0].Decision
		if d.Reason != quota.ReasonConcurrencyLimited || d.RetryAfter != tc.want {
			t.Fatalf("version %d: %+v; want concurrency_limited with retry_after %v", tc.version, d, tc.want)
		}
	}
}
