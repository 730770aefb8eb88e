package quota

import (
	"math"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// Properties of shares over generated histories: holders (renewing with changing demand,
// losing replies, crashing, releasing, restarting as new incarnations) and central callers on
// a tree of two lendable levels (a domain ceiling and per-tenant buckets). Checked:
//   - conservation: at every step, per lendable bucket, Σ charged r ≤ rate and Σ b ≤ burst;
//   - bounded admission: holders' local admissions plus central ones, per bucket, within
//     burst + rate·T over every window (clocks exact here: ρ = 0);
//   - snapshots: a restored engine has the same hash and decides the next command the same.
func TestSharePropertyConservationAndBound(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		domRate := rapid.SampledFrom([]uint64{50, 100, 400}).Draw(t, "domain rate")
		domBurst := rapid.SampledFrom([]uint64{10, 50, 100, 400}).Draw(t, "domain burst")
		tRate := rapid.SampledFrom([]uint64{30, 60, 200}).Draw(t, "tenant rate")
		tBurst := rapid.SampledFrom([]uint64{10, 30, 200}).Draw(t, "tenant burst")
		lease := rapid.SampledFrom([]time.Duration{time.Second, 3 * time.Second, 15 * time.Second}).Draw(t, "lease")
		reserve := rapid.SampledFrom([]uint32{0, 1, 25, 50}).Draw(t, "reserve")
		l := &Limits{Domains: []Domain{{Name: "d",
			Rate:   &Rate{Unit: time.Second, RequestsPerUnit: domRate, Burst: domBurst},
			Shares: &Shares{Lease: lease, ReservePercent: reserve},
			Descriptors: []Node{{Key: "t",
				Rate:   &Rate{Unit: time.Second, RequestsPerUnit: tRate, Burst: tBurst},
				Shares: &Shares{Lease: lease, ReservePercent: reserve},
				Weight: rapid.Uint32Range(0, 3).Draw(t, "weight")}},
		}}}
		w := newSimWorld(t, l)
		tenants := []string{"a", "b"}
		path := func(tn string, demand uint64) SharePath {
			return SharePath{Domain: "d", Descriptors: []Entry{{"t", tn}}, Demand: demand, MaxCost: 1}
		}
		nh := rapid.IntRange(1, 3).Draw(t, "holders")
		var hs []*simHolder
		for i := range nh {
			h := w.holder(string(rune('A'+i)), path("a", math.MaxUint64), path("b", math.MaxUint64))
			hs = append(hs, h)
		}
		dead := make([]bool, nh)
		steps := rapid.IntRange(1, 120).Draw(t, "steps")
		for range steps {
			w.advance(rapid.SampledFrom([]time.Duration{0, 10 * time.Millisecond, 100 * time.Millisecond, 700 * time.Millisecond, 2 * time.Second}).Draw(t, "dt"))
			i := rapid.IntRange(0, nh-1).Draw(t, "who")
			h := hs[i]
			switch rapid.IntRange(0, 9).Draw(t, "action") {
			case 0, 1:
				if !dead[i] {
					for p := range h.paths {
						h.paths[p].Demand = rapid.SampledFrom([]uint64{0, 5 * microPerUnit, 40 * microPerUnit, math.MaxUint64}).Draw(t, "demand")
					}
					h.renew(rapid.IntRange(0, 4).Draw(t, "drop") == 0)
				}
			case 2, 3, 4:
				if !dead[i] {
					for p := range h.paths {
						h.greedy(p)
					}
				}
			case 5:
				if !dead[i] && rapid.Bool().Draw(t, "release") {
					h.release()
				} else {
					dead[i] = true // crashed: never renews or admits again
				}
			case 6:
				if dead[i] { // a restart: a new incarnation
					nh := w.holder(h.name, path("a", math.MaxUint64), path("b", math.MaxUint64))
					nh.key.Incarnation = h.key.Incarnation + 1
					hs[i], dead[i] = nh, false
				}
			case 7, 8:
				tn := tenants[rapid.IntRange(0, 1).Draw(t, "tenant")]
				w.centralGreedy("d", []Entry{{"t", tn}})
			case 9:
				w.e.Tick(w.fsmNow())
			}
			lends, _ := w.e.ShareStatus("d")
			for _, ls := range lends {
				rate, burst := domRate, domBurst
				if ls.Key != "d" {
					rate, burst = tRate, tBurst
				}
				if ls.LentRate > rate*microPerUnit || ls.LentBurst > burst*microPerUnit {
					t.Fatalf("conservation at %s: lent %d/s and %d of %d/s and %d", ls.Key, ls.LentRate, ls.LentBurst, rate*microPerUnit, burst*microPerUnit)
				}
			}
		}
		if ex, where := boundViolation(w.adm, domRate, domBurst, 0); ex > 1e-6 {
			t.Fatalf("domain bucket: %.2f units over the bound in %s", ex, where)
		}
		for _, tn := range tenants {
			var adm []simAdm
			for _, a := range w.adm {
				if a.path == tn {
					adm = append(adm, a)
				}
			}
			if ex, where := boundViolation(adm, tRate, tBurst, 0); ex > 1e-6 {
				t.Fatalf("tenant %s: %.2f units over the bound in %s", tn, ex, where)
			}
		}
		// Snapshot round trip: same hash, same next decisions.
		data, err := w.e.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		r := NewEngine()
		if err := r.UnmarshalBinary(data); err != nil {
			t.Fatal(err)
		}
		if r.Hash() != w.e.Hash() {
			t.Fatalf("restored hash %x != %x", r.Hash(), w.e.Hash())
		}
		now := w.fsmNow() + Time(time.Second)
		h := hs[0]
		req := ShareRequest{Holder: h.key, Seq: h.seq + 1, AckSeq: h.applied, Paths: h.paths}
		g1, e1 := w.e.Share(now, req)
		g2, e2 := r.Share(now, req)
		if (e1 == nil) != (e2 == nil) || len(g1.Paths) != len(g2.Paths) || r.Hash() != w.e.Hash() {
			t.Fatalf("after restore the next share differs: %+v %v vs %+v %v", g1, e1, g2, e2)
		}
		for _, when := range []time.Duration{time.Minute, 20 * time.Minute} {
			w.e.Tick(now + Time(when))
			r.Tick(now + Time(when))
			if r.Hash() != w.e.Hash() {
				t.Fatalf("after expiries the restored engine differs")
			}
		}
		if c := w.e.ShareCounts(); c.Holders != 0 || c.LentBuckets != 0 {
			t.Fatalf("20 minutes later: %+v, want nothing left", c)
		}
	})
}
