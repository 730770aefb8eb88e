package quota

import "math"

// allocFlow is one flow of a progressive filling: a holder's path, with its demand and weight,
// crossing the constraints (lendable buckets) levels.
type allocFlow struct {
	demand uint64 // micro-units per second; math.MaxUint64: as much as is fair
	weight uint64 // ≥ 1
	levels []int32
}

// progressiveFill is weighted max-min fairness by progressive filling, in integers: every
// active flow f grows at w_f × t as the fill level t rises; a flow stops at its demand, and
// every flow through a constraint stops when the constraint's capacity is used up. The result
// x satisfies, for every constraint c, Σ_{f∋c} x_f ≤ caps[c], and x_f ≤ demand_f.
//
// Each round raises t to the lowest level at which something stops (a demand met, or a
// constraint full: floor(room/Σw)), freezes what stopped, and continues: at most one round
// per flow. It is deterministic: the result depends only on the order-free inputs (flows are
// handled by index, ties freeze together).
func progressiveFill(flows []allocFlow, caps []uint64) []uint64 {
	x := make([]uint64, len(flows))
	active := make([]bool, len(flows))
	room := append([]uint64(nil), caps...)
	wsum := make([]uint64, len(caps))
	nActive := 0
	for i, f := range flows {
		if f.demand == 0 || len(f.levels) == 0 {
			continue
		}
		active[i] = true
		nActive++
		for _, c := range f.levels {
			wsum[c] = satAdd(wsum[c], max(f.weight, 1))
		}
	}
	full := make([]bool, len(caps))
	for nActive > 0 {
		t := uint64(math.MaxUint64)
		for c := range caps {
			if wsum[c] > 0 {
				t = min(t, room[c]/wsum[c])
			}
		}
		for i, f := range flows {
			if active[i] {
				t = min(t, ceilDiv(f.demand, max(f.weight, 1)))
			}
		}
		// Flows whose demand is met at t freeze first, alone: one that takes less than its
		// w·t (demand rounded up) leaves room that the others may still use, so a
		// constraint counts as full only in a round where no demand is met.
		demandMet := false
		for i, f := range flows {
			if active[i] && ceilDiv(f.demand, max(f.weight, 1)) <= t {
				demandMet = true
				break
			}
		}
		for c := range caps {
			full[c] = !demandMet && wsum[c] > 0 && room[c]/wsum[c] == t
		}
		for i, f := range flows {
			if !active[i] {
				continue
			}
			w := max(f.weight, 1)
			stop := ceilDiv(f.demand, w) <= t
			val := f.demand
			if !stop {
				for _, c := range f.levels {
					if full[c] {
						stop = true
						break
					}
				}
				val = w * t // < demand, so no overflow
			}
			if !stop {
				continue
			}
			x[i] = val
			active[i] = false
			nActive--
			for _, c := range f.levels {
				room[c] -= min(room[c], val)
				wsum[c] -= w
			}
		}
	}
	return x
}

func ceilDiv(a, b uint64) uint64 {
	q := a / b
	if a%b != 0 {
		q++
	}
	return q
}

// needsFirstFill is the work-conserving allocation of command version 4
// (ShareRequest.NeedsFirst): a holder reports its demand with a headroom (attempted cost ×
// 1.25, SharePath.Demand), which lets a growing holder grow before its next renewal. Filled in
// one pass, that headroom is given even while another holder's real need goes unmet, and the
// holder does not spend it: with two regions at 80/20 of 1.5 × the rate, 7.5 % of the rate
// sits in the quiet region's bucket while the busy one is refused.
//
// So the filling runs twice: first every flow's need (its demand without the headroom,
// demand × 4/5, weighted max-min as before), then what is left of each constraint goes, by the
// same weighted max-min, to what every flow asked beyond it (its headroom). While the needs
// exceed a constraint it is lent entirely to needs, in max-min shares of them; below that,
// every need is met and the rest goes to headroom as before. Each pass keeps Σ x ≤ cap, so
// the sum does: the caps, hence the bound, are those of the one-pass filling.
func needsFirstFill(flows []allocFlow, caps []uint64) []uint64 {
	need := make([]allocFlow, len(flows))
	for i, f := range flows {
		need[i] = f
		if f.demand != math.MaxUint64 {
			need[i].demand = f.demand - f.demand/5 // demand × 4/5, rounded up
		}
	}
	x := progressiveFill(need, caps)
	room := append([]uint64(nil), caps...)
	rest := make([]allocFlow, len(flows))
	for i, f := range flows {
		for _, c := range f.levels {
			room[c] -= min(room[c], x[i])
		}
		rest[i] = f
		rest[i].demand = f.demand - x[i]
	}
	y := progressiveFill(rest, room)
	for i := range x {
		x[i] += y[i]
	}
	return x
}
