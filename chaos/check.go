package chaos

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"time"
)

// Result is one checker's verdict.
type Result struct {
	Name string `json:"name"`
	OK   bool   `json:"ok"`
	// Anomalies counts the violations found (0 when OK, unless the checker was inconclusive).
	Anomalies int `json:"anomalies"`
	// Checked counts what was examined (ops, windows, samples), so a vacuous pass shows.
	Checked  int      `json:"checked"`
	Duration string   `json:"duration"`
	Details  []string `json:"details,omitempty"`
	// Files lists artifacts written (visualizations).
	Files []string `json:"files,omitempty"`
}

const maxDetails = 20

func (r *Result) anomaly(format string, args ...any) {
	r.Anomalies++
	r.OK = false
	if len(r.Details) < maxDetails {
		r.Details = append(r.Details, fmt.Sprintf(format, args...))
	}
}

func (r *Result) note(format string, args ...any) {
	if len(r.Details) < maxDetails {
		r.Details = append(r.Details, fmt.Sprintf(format, args...))
	}
}

func timed(name string, f func(r *Result)) Result {
	start := time.Now()
	r := Result{Name: name, OK: true}
	f(&r)
	r.Duration = time.Since(start).Round(time.Millisecond).String()
	return r
}

func ms(ns int64) string { return fmt.Sprintf("%.3fs", float64(ns)/1e9) }

// ---------------------------------------------------------------------------------------------
// Bounded admission.

// RateLimit describes a refilling bucket's configuration.
type RateLimit struct {
	Burst           float64
	RefillPerSecond float64
}

// timeScale is F(t) = ∫₀ᵗ maxRate(s) ds in nanoseconds: real time stretched by the fastest
// node clock at each moment (ρ of the design's inequality, taken conservatively over every node
// because any of them may lead).
type timeScale struct {
	pts []int64   // breakpoints, sorted
	cum []float64 // F at each breakpoint
	rt  []float64 // rate on [pts[i], pts[i+1])
}

func newTimeScale(spans []rateSpan) timeScale {
	pts := []int64{0}
	for _, s := range spans {
		pts = append(pts, s.from, s.to)
	}
	slices.Sort(pts)
	pts = slices.Compact(pts)
	ts := timeScale{pts: pts, cum: make([]float64, len(pts)), rt: make([]float64, len(pts))}
	for i, p := range pts {
		r := 1.0
		for _, s := range spans {
			if s.from <= p && p < s.to && s.rate > r {
				r = s.rate
			}
		}
		ts.rt[i] = r
		if i > 0 {
			ts.cum[i] = ts.cum[i-1] + float64(p-pts[i-1])*ts.rt[i-1]
		}
	}
	return ts
}

func (ts timeScale) at(t int64) float64 {
	i := sort.Search(len(ts.pts), func(i int) bool { return ts.pts[i] > t }) - 1
	if i < 0 {
		return float64(t)
	}
	return ts.cum[i] + float64(t-ts.pts[i])*ts.rt[i]
}

// maxTree is a segment tree over positions with range add and global max; inactive leaves
// hold -Inf.
type maxTree struct {
	n        int
	mx, lazy []float64
}

func newMaxTree(n int) *maxTree {
	t := &maxTree{n: n, mx: make([]float64, 4*n), lazy: make([]float64, 4*n)}
	for i := range t.mx {
		t.mx[i] = math.Inf(-1)
	}
	return t
}

func (t *maxTree) add(node, lo, hi, l, r int, v float64) {
	if r < lo || hi < l {
		return
	}
	if l <= lo && hi <= r {
		t.mx[node] += v
		t.lazy[node] += v
		return
	}
	mid := (lo + hi) / 2
	t.add(2*node, lo, mid, l, r, v)
	t.add(2*node+1, mid+1, hi, l, r, v)
	t.mx[node] = max(t.mx[2*node], t.mx[2*node+1]) + t.lazy[node]
}

// set activates leaf p with value v (v is in the same frame as the adds applied so far to p).
func (t *maxTree) set(node, lo, hi, p int, v float64) {
	if lo == hi {
		t.mx[node] = v
		return
	}
	v -= t.lazy[node]
	mid := (lo + hi) / 2
	if p <= mid {
		t.set(2*node, lo, mid, p, v)
	} else {
		t.set(2*node+1, mid+1, hi, p, v)
	}
	t.mx[node] = max(t.mx[2*node], t.mx[2*node+1]) + t.lazy[node]
}

// CheckBoundedAdmission checks invariant 2 on every refilling bucket: for every window
// [t1, t2] of the test's clock, the cost of the admissions certainly decided inside it (Call
// ≥ t1 and Return ≤ t2) is at most burst + rate·∫maxRate over the window. Only known
// admissions count (an unknown outcome can only add admissions, so ignoring it is
// conservative). Every window whose ends are an op's Call and an op's Return is checked, in
// O(n log n) per bucket.
func CheckBoundedAdmission(h *History, limits map[string]RateLimit) Result {
	return timed("bounded-admission", func(r *Result) {
		ts := newTimeScale(maxRateSpans(h))
		buckets, by := opsOf(h, KindRate)
		for _, b := range buckets {
			lim, ok := limits[b]
			if !ok {
				r.anomaly("bucket %q has no configured limit", b)
				continue
			}
			var adm []Op
			for _, op := range by[b] {
				if op.Outcome == Admitted {
					adm = append(adm, op)
				}
			}
			r.Checked += len(adm)
			if len(adm) == 0 {
				continue
			}
			checkBucketAdmission(r, b, lim, adm, ts)
		}
		if r.Checked == 0 {
			r.anomaly("no admitted op on a refilling bucket: nothing was checked")
		}
	})
}

func checkBucketAdmission(r *Result, bucket string, lim RateLimit, adm []Op, ts timeScale) {
	// Positions by Return; windows start at each Call, processed latest first, so the active
	// set is exactly the ops with Call >= t1.
	byEnd := slices.Clone(adm)
	slices.SortFunc(byEnd, func(a, b Op) int { return cmpInt(a.Return, b.Return) })
	pos := make(map[int]int, len(byEnd))
	for i, op := range byEnd {
		pos[op.Index] = i
	}
	byCall := slices.Clone(adm)
	slices.SortFunc(byCall, func(a, b Op) int { return cmpInt(b.Call, a.Call) })
	c := lim.RefillPerSecond / 1e9 // units per (scaled) ns
	n := len(byEnd)
	t := newMaxTree(n)
	worst, worstMsg := math.Inf(-1), ""
	reported := 0
	for _, op := range byCall {
		p := pos[op.Index]
		// leaf p: cost of active ops with position <= p (prefix) minus c·F(end_p). The prefix
		// sum at p is built by range adds; activate first with the adds already applied to p
		// excluded, i.e. set the leaf to -c·F(end_p) plus the current prefix at p.
		prefix := t.prefixAt(p)
		t.set(1, 0, n-1, p, prefix-c*ts.at(byEnd[p].Return))
		t.add(1, 0, n-1, p, n-1, float64(op.Cost))
		excess := t.mx[1] + c*ts.at(op.Call) - lim.Burst
		if excess > worst {
			worst = excess
			worstMsg = fmt.Sprintf("window from %s", ms(op.Call))
		}
		if excess > 1e-6 && reported < 3 {
			reported++
			r.anomaly("bucket %q: over-admission of %.2f units in a window starting at %s (burst %.0f, %.2f/s)",
				bucket, excess, ms(op.Call), lim.Burst, lim.RefillPerSecond)
		}
	}
	r.note("bucket %q: %d admitted, tightest window %s has slack %.2f units", bucket, n, worstMsg, -worst)
}

// prefixAt returns the sum of range adds covering leaf p (the prefix cost at p, for leaves
// that are still inactive).
func (t *maxTree) prefixAt(p int) float64 {
	node, lo, hi, s := 1, 0, t.n-1, 0.0
	for lo != hi {
		s += t.lazy[node]
		mid := (lo + hi) / 2
		if p <= mid {
			node, hi = 2*node, mid
		} else {
			node, lo = 2*node+1, mid+1
		}
	}
	return s + t.lazy[node]
}

func cmpInt(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// ---------------------------------------------------------------------------------------------
// Concurrency leases.

// CheckLeases checks that permits in flight never exceed max_in_flight: from the client's
// view a lease is certainly held from its admission's Return until the earlier of its release
// call and Call + TTL/maxRate (the earliest it can have expired, even on a fast leader clock);
// at no instant may more such leases exist than the bucket allows. It also checks every Status
// sample.
func CheckLeases(h *History, maxInFlight map[string]uint64) Result {
	return timed("lease-in-flight", func(r *Result) {
		maxRate := 1.0
		for _, s := range maxRateSpans(h) {
			maxRate = max(maxRate, s.rate)
		}
		buckets, by := opsOf(h, KindLease)
		for _, b := range buckets {
			type ev struct {
				t     int64
				delta int
			}
			var evs []ev
			for _, op := range by[b] {
				if op.Outcome != Admitted || op.LeaseID == 0 {
					continue
				}
				until := op.Call + int64(float64(op.LeaseTTL)/maxRate)
				if op.ReleaseCall >= 0 && op.ReleaseCall < until {
					until = op.ReleaseCall
				}
				if until <= op.Return {
					continue
				}
				r.Checked++
				evs = append(evs, ev{op.Return, +1}, ev{until, -1})
			}
			// At equal times release before acquire: intervals are open at their ends.
			slices.SortFunc(evs, func(a, b ev) int {
				if c := cmpInt(a.t, b.t); c != 0 {
					return c
				}
				return a.delta - b.delta
			})
			cur, peak := 0, 0
			limit := int(maxInFlight[b])
			for _, e := range evs {
				cur += e.delta
				peak = max(peak, cur)
				if cur > limit {
					r.anomaly("bucket %q: %d leases certainly held at %s, max_in_flight %d", b, cur, ms(e.t), limit)
				}
			}
			r.note("bucket %q: peak %d certainly-held leases (max_in_flight %d)", b, peak, limit)
		}
		for _, s := range h.Status {
			r.Checked++
			if s.InFlight > s.MaxInFlight {
				r.anomaly("status of %q at %s: in_flight %d > max_in_flight %d", s.Bucket, ms(s.At), s.InFlight, s.MaxInFlight)
			}
		}
		if r.Checked == 0 {
			r.anomaly("no lease was admitted: nothing was checked")
		}
	})
}

// CheckReclaim checks invariant 4 after the final heal: every permit (including those of
// holders that crashed) was back within bound of the heal, and max_in_flight fresh permits
// could then be taken at once.
func CheckReclaim(h *History, bound time.Duration) Result {
	return timed("lease-reclaim", func(r *Result) {
		for _, rc := range h.Reclaim {
			r.Checked++
			switch {
			case rc.ReclaimedAt < 0:
				r.anomaly("bucket %q: permits still in flight long after the heal at %s (%d leases of crashed holders)", rc.Bucket, ms(rc.HealAt), rc.CrashedHeld)
			case time.Duration(rc.ReclaimedAt-rc.HealAt) > bound:
				r.anomaly("bucket %q: permits came back %v after the heal, bound %v", rc.Bucket, time.Duration(rc.ReclaimedAt-rc.HealAt).Round(time.Millisecond), bound)
			default:
				r.note("bucket %q: all permits back %v after the heal (bound %v), %d crashed holders", rc.Bucket, time.Duration(rc.ReclaimedAt-rc.HealAt).Round(time.Millisecond), bound, rc.CrashedHeld)
			}
			if rc.Reacquired < rc.Capacity {
				r.anomaly("bucket %q: only %d of %d permits could be taken after reclaim", rc.Bucket, rc.Reacquired, rc.Capacity)
			}
		}
		if r.Checked == 0 {
			r.anomaly("no reclaim measurement was recorded")
		}
	})
}

// ---------------------------------------------------------------------------------------------
// Durable, idempotent decisions.

// CheckReplays checks invariants 1 and 5 through re-sent request IDs: a re-send (during the
// run, or after every node was killed and restarted) must get the original decision back —
// for a budget spend down to its remaining balance, so an old request ID charged a second
// time (its dedup record lost, e.g. with a wiped majority) shows even when it is admitted
// again.
func CheckReplays(h *History) Result {
	return timed("replay-same-decision", func(r *Result) {
		byIndex := make(map[int]*Op, len(h.Ops))
		for i := range h.Ops {
			byIndex[h.Ops[i].Index] = &h.Ops[i]
		}
		phases := map[string]int{}
		for _, rp := range h.Replays {
			op := byIndex[rp.Op]
			if op == nil {
				r.anomaly("replay of unknown op %d", rp.Op)
				continue
			}
			if op.Outcome != Admitted && op.Outcome != Denied {
				continue
			}
			if rp.Outcome == Unknown {
				continue // the re-send got no answer; nothing learned
			}
			r.Checked++
			phases[rp.Phase]++
			if rp.Outcome != op.Outcome || rp.LeaseID != op.LeaseID {
				r.anomaly("%s re-send of %s/%s request %s:%d at %s got %s (lease %d), the original at %s was %s (lease %d)",
					rp.Phase, op.Domain, op.Bucket, op.ClientID, op.RequestID, ms(rp.At), rp.Outcome, rp.LeaseID, ms(op.Return), op.Outcome, op.LeaseID)
			} else if op.Kind == KindSpend && rp.Remaining != op.Remaining {
				// The same outcome with another balance: decided again (charged twice), not
				// answered from the dedup record, which stores the original decision whole.
				r.anomaly("%s re-send of %s/%s request %s:%d at %s got %s with %d remaining, the original at %s had %d: the request ID was decided again",
					rp.Phase, op.Domain, op.Bucket, op.ClientID, op.RequestID, ms(rp.At), rp.Outcome, rp.Remaining, ms(op.Return), op.Remaining)
			}
		}
		r.note("re-sends checked: %v", phases)
		if phases["restart"] == 0 {
			r.anomaly("no acknowledged decision was re-sent after a total restart")
		}
	})
}

// ---------------------------------------------------------------------------------------------
// Replica agreement.

// CheckReplicaHashes checks invariant 6: samples of /debug/state at the same applied index
// carry the same hash. It needs at least one index sampled on two replicas.
func CheckReplicaHashes(h *History) Result {
	return timed("replica-hashes", func(r *Result) {
		type seen struct {
			hash uint64
			node string
		}
		byIndex := map[uint64]seen{}
		nodesAt := map[uint64]map[string]bool{}
		for _, s := range h.States {
			if s.AppliedIndex == 0 {
				continue
			}
			if nodesAt[s.AppliedIndex] == nil {
				nodesAt[s.AppliedIndex] = map[string]bool{}
			}
			nodesAt[s.AppliedIndex][s.Node] = true
			if prev, ok := byIndex[s.AppliedIndex]; ok {
				if prev.hash != s.Hash {
					r.anomaly("applied index %d: %s has hash %x, %s has %x", s.AppliedIndex, prev.node, prev.hash, s.Node, s.Hash)
				}
				continue
			}
			byIndex[s.AppliedIndex] = seen{s.Hash, s.Node}
		}
		all := 0
		for _, ns := range nodesAt {
			if len(ns) >= 2 {
				r.Checked++
			}
			all = max(all, len(ns))
		}
		r.note("%d applied indexes seen on >= 2 replicas (at most %d replicas at one index)", r.Checked, all)
		if r.Checked == 0 {
			r.anomaly("no applied index was sampled on two replicas: nothing compared")
		}
	})
}

// ---------------------------------------------------------------------------------------------
// Node logs.

var badLogLine = regexp.MustCompile(`(?i)(^panic:|\bpanic\(|goroutine \d+ \[running\]|fatal error:|level=fatal|"level":"fatal"|\[fatal\]|data race)`)

// CheckLogs checks that no node log contains a panic, a fatal error or a data race report.
func CheckLogs(dir string) Result {
	return timed("node-logs", func(r *Result) {
		files, _ := filepath.Glob(filepath.Join(dir, "*.log"))
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				r.anomaly("%s: %v", f, err)
				continue
			}
			r.Checked++
			for i, line := range strings.Split(string(b), "\n") {
				if badLogLine.MatchString(line) {
					r.anomaly("%s:%d: %s", filepath.Base(f), i+1, truncate(line, 200))
				}
			}
		}
		if r.Checked == 0 {
			r.anomaly("no node log found in %s", dir)
		}
	})
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// ---------------------------------------------------------------------------------------------
// Throughput floor.

// CheckThroughput checks that the workload got decisions at least at floor per second before
// the first fault: a run whose cluster barely worked proves nothing.
func CheckThroughput(h *History, floor float64) (Result, float64) {
	var rate float64
	res := timed("throughput-floor", func(r *Result) {
		end := h.FirstFault
		if end == 0 {
			for _, op := range h.Ops {
				end = max(end, op.Return)
			}
		}
		span := end - h.LoadStart
		if span <= 0 {
			r.anomaly("no load period before the first fault")
			return
		}
		n := 0
		for _, op := range h.Ops {
			if (op.Outcome == Admitted || op.Outcome == Denied) && !op.Resolved && op.Call >= h.LoadStart && op.Return <= end {
				n++
			}
		}
		r.Checked = n
		rate = float64(n) / (float64(span) / 1e9)
		if rate < floor {
			r.anomaly("%.0f decisions/s before the first fault, floor %.0f/s", rate, floor)
		} else {
			r.note("%.0f decisions/s before the first fault (floor %.0f/s)", rate, floor)
		}
	})
	return res, rate
}
