package quota

import (
	"fmt"
	"testing"
	"time"
)

// BenchmarkAllocation1M: the cost of one /metrics scrape's allocation collector with 1M held
// buckets (it holds the FSM read lock for this long).
func BenchmarkAllocation1M(b *testing.B) {
	e := NewEngine()
	lim := &Limits{Domains: []Domain{{Name: "d", MaxKeys: 2_000_000, Descriptors: []Node{{Key: "tenant", Rate: &Rate{Unit: time.Hour, RequestsPerUnit: 10}}}}}}
	if err := e.SetLimits(0, lim); err != nil {
		b.Fatal(err)
	}
	for i := range 1_000_000 {
		if d := e.Acquire(Time(time.Second), Request{Domain: "d", Cost: 1, Descriptors: []Entry{{Key: "tenant", Value: fmt.Sprint(i)}}}); !d.Admitted {
			b.Fatal(d)
		}
	}
	b.ResetTimer()
	for range b.N {
		if a := e.Allocation(); a[0].ActiveKeys != 1_000_000 {
			b.Fatal(a)
		}
	}
}
