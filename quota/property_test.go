package quota

import (
	"bytes"
	"cmp"
	"fmt"
	"math/big"
	"slices"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// History generation shared by the properties: a small random tree of limits and a random
// sequence of commands at random (sometimes repeated, sometimes backwards) times.

type opKind int

const (
	opAcquire opKind = iota
	opRefund
	opRelease
	opRenew
	opTick
	opPause
	opSetLimits
)

type histOp struct {
	kind      opKind
	dt        time.Duration // may be negative: the engine must clamp
	tenant    string
	consumer  string // "" = no consumer entry
	cost      uint64
	ttl       time.Duration
	ref       int // which earlier decision / lease, modulo their count
	tickFirst bool
	alt       bool          // opSetLimits: install the alternative limits
	within    time.Duration // opAcquire: Request.ScheduleWithin (scheduled grants)
}

func drawRate(t *rapid.T, label string) *Rate {
	if !rapid.Bool().Draw(t, label+" limited") {
		return nil
	}
	return &Rate{
		Unit:            rapid.SampledFrom([]time.Duration{7*time.Millisecond + 3, 100 * time.Millisecond, time.Second, 3 * time.Second}).Draw(t, label+" unit"),
		RequestsPerUnit: rapid.Uint64Range(1, 5).Draw(t, label+" rpu"),
		Burst:           rapid.Uint64Range(0, 8).Draw(t, label+" burst"),
	}
}

func drawConc(t *rapid.T, label string) *Concurrency {
	if !rapid.Bool().Draw(t, label+" capped") {
		return nil
	}
	return &Concurrency{
		MaxInFlight: rapid.Uint64Range(1, 3).Draw(t, label+" max"),
		LeaseTTL:    rapid.SampledFrom([]time.Duration{500 * time.Millisecond, 2 * time.Second}).Draw(t, label+" ttl"),
	}
}

func drawLimits(t *rapid.T, label string) *Limits {
	return &Limits{Domains: []Domain{{
		Name:        "d",
		Rate:        drawRate(t, label+" domain"),
		Concurrency: drawConc(t, label+" domain"),
		Descriptors: []Node{
			{
				Key:         "tenant",
				Rate:        drawRate(t, label+" tenant"),
				Concurrency: drawConc(t, label+" tenant"),
				ShadowMode:  rapid.Bool().Draw(t, label+" tenant shadow"),
				Children: []Node{{
					Key:         "consumer",
					Rate:        drawRate(t, label+" consumer"),
					Concurrency: drawConc(t, label+" consumer"),
				}},
			},
			{Key: "tenant", Value: "vip", Rate: drawRate(t, label+" vip")},
		},
	}}}
}

func drawOps(t *rapid.T, withSetLimits bool) []histOp {
	maxKind := int(opPause)
	if withSetLimits {
		maxKind = int(opSetLimits)
	}
	return rapid.SliceOfN(rapid.Custom(func(t *rapid.T) histOp {
		return histOp{
			kind: opKind(rapid.IntRange(0, maxKind).Draw(t, "kind")),
			dt: rapid.SampledFrom([]time.Duration{0, 0, 1, 3 * time.Millisecond, 50 * time.Millisecond,
				333 * time.Millisecond, time.Second, 5 * time.Second, -time.Second}).Draw(t, "dt"),
			tenant:    rapid.SampledFrom([]string{"a", "b", "vip"}).Draw(t, "tenant"),
			consumer:  rapid.SampledFrom([]string{"", "x", "y"}).Draw(t, "consumer"),
			cost:      rapid.Uint64Range(0, 4).Draw(t, "cost"),
			ttl:       rapid.SampledFrom([]time.Duration{0, 0, 300 * time.Millisecond, 3 * time.Second}).Draw(t, "ttl"),
			ref:       rapid.IntRange(0, 1000).Draw(t, "ref"),
			tickFirst: rapid.Bool().Draw(t, "tickFirst"),
			alt:       rapid.Bool().Draw(t, "alt"),
			within: rapid.SampledFrom([]time.Duration{0, 0, 0, time.Millisecond, 100 * time.Millisecond,
				2 * time.Second}).Draw(t, "within"),
		}
	}), 1, 150).Draw(t, "ops")
}

// runner applies a history to one engine and records what the properties need.
type runner struct {
	e         *Engine
	limits    [2]*Limits
	now       Time
	admitted  []Decision
	refunded  []bool
	effective []Time // when each admitted decision takes effect
	leases    []uint64
	admits    map[string][]event // bucket key → admissions
	refunds   map[string][]event // bucket key → refunds
	maxTTL    time.Duration
}

type event struct {
	at   Time
	cost uint64
}

func newRunner(l, alt *Limits) *runner {
	return &runner{e: NewEngine(), limits: [2]*Limits{l, alt}, admits: map[string][]event{}, refunds: map[string][]event{}}
}

func (r *runner) request(op histOp) Request {
	req := Request{Domain: "d", Descriptors: []Entry{{"tenant", op.tenant}}, Cost: op.cost, LeaseTTL: op.ttl,
		ScheduleWithin: op.within}
	if op.consumer != "" {
		req.Descriptors = append(req.Descriptors, Entry{"consumer", op.consumer})
	}
	return req
}

// apply runs op and returns a description of its outcome (compared across engines).
func (r *runner) apply(t *rapid.T, op histOp) string {
	r.now += Time(op.dt)
	e := r.e
	switch op.kind {
	case opAcquire:
		if op.tickFirst {
			e.Tick(r.now)
		}
		req := r.request(op)
		hash := e.Hash()
		before, _ := e.Status(r.now, req.Domain, req.Descriptors)
		d := e.Acquire(r.now, req)
		if !d.Admitted {
			after, _ := e.Status(r.now, req.Domain, req.Descriptors)
			for i := range before {
				if before[i].Remaining != after[i].Remaining || before[i].ResetAfter != after[i].ResetAfter {
					t.Fatalf("denied %s request changed level %s: %+v -> %+v", d.Reason, before[i].Key, before[i], after[i])
				}
			}
			if op.tickFirst && e.Hash() != hash {
				t.Fatalf("denied %s request changed the state hash", d.Reason)
			}
		} else {
			if d.RetryAfter < 0 || d.RetryAfter > op.within {
				t.Fatalf("admitted with RetryAfter %v, ScheduleWithin %v", d.RetryAfter, op.within)
			}
			r.admitted = append(r.admitted, d)
			r.refunded = append(r.refunded, false)
			r.effective = append(r.effective, e.Clock().Add(d.RetryAfter))
			for _, k := range d.Charges {
				// A scheduled grant takes effect RetryAfter after now: that is when it counts.
				r.admits[k] = append(r.admits[k], event{e.Clock().Add(d.RetryAfter), d.Cost})
			}
			if d.LeaseID != 0 {
				r.leases = append(r.leases, d.LeaseID)
				r.maxTTL = max(r.maxTTL, d.LeaseTTL)
			}
		}
		return formatDecision(d)
	case opRefund:
		if len(r.admitted) == 0 {
			return "-"
		}
		i := op.ref % len(r.admitted)
		if r.refunded[i] { // a caller refunds a decision at most once
			return "-"
		}
		r.refunded[i] = true
		d := r.admitted[i]
		c := min(op.cost, d.Cost)
		for _, k := range d.Charges {
			// A refund before a scheduled grant's moment gives back what it had not yet spent.
			r.refunds[k] = append(r.refunds[k], event{max(r.now, e.Clock(), r.effective[i]), c})
		}
		return fmt.Sprintf("%+v", e.Refund(r.now, d.Charges, c, d.DebitSeq))
	case opRelease:
		if len(r.leases) == 0 {
			return "-"
		}
		return fmt.Sprint(e.Release(r.now, r.leases[op.ref%len(r.leases)]))
	case opRenew:
		if len(r.leases) == 0 {
			return "-"
		}
		ttl, err := e.Renew(r.now, r.leases[op.ref%len(r.leases)], op.ttl)
		r.maxTTL = max(r.maxTTL, ttl)
		return fmt.Sprint(ttl, err)
	case opTick:
		// Tick must drop exactly the buckets that are full at now (checked by brute force).
		now := max(r.now, e.Clock())
		keep := map[string]bool{}
		for k, b := range storedBuckets(e) {
			if tokens, _ := b.lvl.rate.refill(b.tokens, b.last, now); tokens < b.lvl.rate.capMicro {
				keep[k] = true
			}
		}
		e.Tick(r.now)
		if e.buckets.live != len(keep) {
			t.Fatalf("tick at %v kept %d buckets, want the %d not yet full", time.Duration(now), e.buckets.live, len(keep))
		}
		for k := range storedBuckets(e) {
			if !keep[k] {
				t.Fatalf("tick at %v kept full bucket %q", time.Duration(now), k)
			}
		}
		return formatStats(e.Stats())
	case opPause:
		var prefix []Entry
		if op.consumer != "" {
			prefix = []Entry{{"tenant", op.tenant}}
		}
		scope, err := e.Pause(r.now, "d", prefix, r.now+Time(op.ttl))
		return fmt.Sprint(scope, err)
	case opSetLimits:
		l := r.limits[0]
		if op.alt {
			l = r.limits[1]
		}
		return fmt.Sprint(e.SetLimits(r.now, l))
	}
	panic("unreachable")
}

// checkInFlight: with fixed limits, no level ever holds more permits than its max_in_flight.
func (r *runner) checkInFlight(t *rapid.T) {
	for k, n := range r.e.inflight {
		lv := r.e.lim.matchKey(k)
		if lv == nil || lv.conc == nil {
			t.Fatalf("permits held at %q, which has no concurrency limit", k)
		}
		if n > lv.conc.MaxInFlight {
			t.Fatalf("%q holds %d permits, max_in_flight %d", k, n, lv.conc.MaxInFlight)
		}
	}
}

// Property: bounded admission (no double spend). For every bucket and every window [t0, t1]
// between two of its admissions, admitted cost ≤ capacity + rate·(t1−t0) + refunds in [t0, t1].
// Also: concurrency never exceeds max_in_flight, and no permit outlives its lease (no leak).
func TestPropertyBoundedAdmissionAndNoLeak(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		l := drawLimits(t, "limits")
		r := newRunner(l, nil)
		if err := r.e.SetLimits(0, l); err != nil {
			t.Fatal(err)
		}
		for _, op := range drawOps(t, false) {
			r.apply(t, op)
			r.checkInFlight(t)
		}
		for key, admits := range r.admits {
			lv := r.e.lim.matchKey(key)
			if lv == nil || lv.rate == nil {
				t.Fatalf("charged %q, which has no rate", key)
			}
			checkBound(t, key, lv.rate, admits, r.refunds[key])
		}
		// No leak: once every TTL has passed, every permit is back.
		r.e.Tick(r.e.Clock().Add(r.maxTTL))
		if n := r.e.Stats().Leases; n != 0 || len(r.e.inflight) != 0 {
			t.Fatalf("after all TTLs: %d leases, %d keys with permits", n, len(r.e.inflight))
		}
		// And with no activity, every bucket refills and is dropped.
		r.e.Tick(r.e.Clock().Add(time.Hour))
		if n := r.e.Stats().Buckets; n != 0 {
			t.Fatalf("%d buckets left after an idle hour", n)
		}
	})
}

func checkBound(t *rapid.T, key string, r *rateParams, admits, refunds []event) {
	// Scheduled grants take effect later than they are decided: check in order of effect.
	admits = slices.Clone(admits)
	slices.SortStableFunc(admits, func(a, b event) int { return cmp.Compare(a.at, b.at) })
	for i := range admits {
		var admitted uint64
		for j := i; j < len(admits); j++ {
			t0, t1 := admits[i].at, admits[j].at
			admitted += admits[j].cost
			var refunded uint64
			for _, rf := range refunds {
				if rf.at >= t0 && rf.at <= t1 {
					refunded += rf.cost
				}
			}
			// admitted ≤ cap + refunded + rpu·(t1−t0)/unit, in exact integers.
			lhs := new(big.Int).Mul(new(big.Int).SetUint64(admitted), new(big.Int).SetUint64(r.unit))
			rhs := new(big.Int).Mul(new(big.Int).SetUint64(r.capUnits+refunded), new(big.Int).SetUint64(r.unit))
			rhs.Add(rhs, new(big.Int).Mul(new(big.Int).SetUint64(r.rpu), big.NewInt(int64(t1-t0))))
			if lhs.Cmp(rhs) > 0 {
				t.Fatalf("bucket %q admitted %d in [%v, %v] (capacity %d, %d per %v, refunded %d)",
					key, admitted, time.Duration(t0), time.Duration(t1), r.capUnits, r.rpu, r.window, refunded)
			}
		}
	}
}

// Property: determinism and snapshots. Two engines fed the same history agree on every outcome
// and on Hash; an engine restored from a snapshot taken mid-history behaves exactly like the
// original from then on; MarshalBinary output is a function of the state.
func TestPropertyDeterminismAndSnapshot(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		l, alt := drawLimits(t, "limits"), drawLimits(t, "alt")
		ops := drawOps(t, true)
		cut := rapid.IntRange(0, len(ops)).Draw(t, "snapshot at")
		a, b := newRunner(l, alt), newRunner(l, alt)
		a.e.SetLimits(0, l)
		b.e.SetLimits(0, l)
		var restored *runner
		var captured pendingCapture
		for i, op := range ops {
			if i == cut {
				restored = snapshotRunner(t, a)
				captured = capture(t, a.e)
			}
			oa, ob := a.apply(t, op), b.apply(t, op)
			if oa != ob {
				t.Fatalf("op %d %+v: engines disagree: %q vs %q", i, op, oa, ob)
			}
			if restored != nil {
				if or := restored.apply(t, op); or != oa {
					t.Fatalf("op %d %+v: restored engine disagrees: %q vs %q", i, op, or, oa)
				}
				if restored.e.Hash() != a.e.Hash() {
					t.Fatalf("op %d: restored engine's hash diverged", i)
				}
			}
			if a.e.Hash() != b.e.Hash() {
				t.Fatalf("op %d %+v: hashes diverged", i, op)
			}
		}
		snapshotRunner(t, a)
		if captured.c != nil {
			captured.check(t) // the rest of the history changed nothing it holds
		}
	})
}

// snapshotRunner round-trips r's engine through MarshalBinary and returns a runner on the copy.
func snapshotRunner(t *rapid.T, r *runner) *runner {
	data, err := r.e.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	again, _ := r.e.MarshalBinary()
	if !bytes.Equal(data, again) {
		t.Fatal("MarshalBinary is not deterministic")
	}
	n := NewEngine()
	if err := n.UnmarshalBinary(data); err != nil {
		t.Fatal(err)
	}
	if n.Hash() != r.e.Hash() || n.Clock() != r.e.Clock() || n.Stats() != r.e.Stats() {
		t.Fatalf("round trip changed the state: hash %x -> %x, stats %+v -> %+v", r.e.Hash(), n.Hash(), r.e.Stats(), n.Stats())
	}
	if data2, _ := n.MarshalBinary(); !bytes.Equal(data, data2) {
		t.Fatal("re-marshalled snapshot differs")
	}
	cp := *r
	cp.e = n
	cp.admitted = append([]Decision(nil), r.admitted...)
	cp.refunded = append([]bool(nil), r.refunded...)
	cp.effective = append([]Time(nil), r.effective...)
	cp.leases = append([]uint64(nil), r.leases...)
	return &cp
}

// Property: RetryAfter is exact for a lone bucket — the same request is refused one nanosecond
// earlier and admitted at now+RetryAfter.
func TestPropertyRetryAfterIsExact(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		rate := &Rate{
			Unit:            time.Duration(rapid.Int64Range(1, int64(time.Hour)).Draw(t, "unit")),
			RequestsPerUnit: rapid.Uint64Range(1, 1000).Draw(t, "rpu"),
			Burst:           rapid.Uint64Range(0, 50).Draw(t, "burst"),
		}
		e := NewEngine()
		if err := e.SetLimits(0, &Limits{Domains: []Domain{{Name: "d", Rate: rate}}}); err != nil {
			t.Fatal(err)
		}
		capUnits := rate.Capacity()
		now := Time(0)
		for i := 0; i < 20; i++ {
			now += Time(rapid.Int64Range(0, int64(rate.Unit)).Draw(t, "dt"))
			cost := rapid.Uint64Range(1, capUnits).Draw(t, "cost")
			d := e.Acquire(now, Request{Domain: "d", Cost: cost})
			if d.Admitted {
				continue
			}
			if d.Reason != ReasonRateLimited || d.RetryAfter <= 0 {
				t.Fatalf("denial: %+v", d)
			}
			probe := *e // a shallow copy is enough: a denial and Status mutate nothing we share
			if st, _ := probe.Status(now.Add(d.RetryAfter-1), "d", nil); st[0].Remaining >= cost {
				t.Fatalf("cost %d would already fit 1ns before RetryAfter %v (remaining %d)", cost, d.RetryAfter, st[0].Remaining)
			}
			now = now.Add(d.RetryAfter)
			if d2 := e.Acquire(now, Request{Domain: "d", Cost: cost}); !d2.Admitted {
				t.Fatalf("refused again at RetryAfter %v: %+v", d.RetryAfter, d2)
			}
		}
	})
}
