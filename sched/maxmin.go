package sched

import "sort"

// MaxMinShares divides capacity among demands weighted max-min fairly (water-filling): no
// demand gets more than it asks, and capacity left by small demands is shared among the
// larger ones in proportion to their weights (0 means 1). This is the allocation a Queue
// converges to when every flow keeps requests waiting at its demanded rate. The result has
// one share per demand, in order, and sums to min(capacity, Σdemands).
func MaxMinShares(capacity float64, demands []float64, weights []uint32) []float64 {
	n := len(demands)
	out := make([]float64, n)
	idx := make([]int, 0, n)
	for i, d := range demands {
		if d > 0 {
			idx = append(idx, i)
		}
	}
	w := func(i int) float64 {
		if i < len(weights) && weights[i] > 0 {
			return float64(weights[i])
		}
		return 1
	}
	// Satisfy demands in order of demand per weight; each takes min(its demand, its weighted
	// share of what is left).
	sort.SliceStable(idx, func(a, b int) bool { return demands[idx[a]]/w(idx[a]) < demands[idx[b]]/w(idx[b]) })
	left := capacity
	for k, i := range idx {
		totalW := 0.0
		for _, j := range idx[k:] {
			totalW += w(j)
		}
		share := left * w(i) / totalW
		out[i] = min(demands[i], share)
		left -= out[i]
	}
	return out
}

// ProportionalShares is proportional shedding, for comparison: every demand is cut by the
// same fraction, capacity/Σdemands. A demand of 90 % of the total keeps 90 % of the capacity,
// and small demands lose requests they could have had.
func ProportionalShares(capacity float64, demands []float64) []float64 {
	total := 0.0
	for _, d := range demands {
		total += max(d, 0)
	}
	out := make([]float64, len(demands))
	if total <= 0 {
		return out
	}
	f := min(1, capacity/total)
	for i, d := range demands {
		out[i] = max(d, 0) * f
	}
	return out
}
