package sched

import (
	"math"
	"time"
)

// Bucket is a token bucket as the replicated state reports it at one moment (its clock):
// Limit units per Window, Burst units when full, full again ResetAfter after that moment.
// It predicts scheduled grants (see Queue.Batch): each admission released to the bucket takes
// its units at the moment they have accrued, so grants follow one another at the bucket's
// pace however many are released at once.
type Bucket struct {
	Limit      uint64
	Window     time.Duration
	Burst      uint64
	ResetAfter time.Duration
}

// ReadyAfter returns how long after the reading the bucket has paid need units in all (the
// next request's cost plus the cost of those released before it and not yet in the
// reading): 0 if it holds them now. With Burst units at ResetAfter it holds need units
// (Burst−need)·Window/Limit earlier, and later than that by the same rule when need exceeds
// Burst, as scheduled grants take units as they accrue. A bucket without a rate pays at once.
func (b Bucket) ReadyAfter(need uint64) time.Duration {
	if b.Limit == 0 || b.Window <= 0 {
		return 0
	}
	perUnit := float64(b.Window) / float64(b.Limit)
	d := float64(b.ResetAfter) + (float64(need)-float64(b.Burst))*perUnit
	switch {
	case d <= 0:
		return 0
	case d >= math.MaxInt64:
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(math.Ceil(d))
}
