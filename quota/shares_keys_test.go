package quota

import (
	"math"
	"strings"
	"testing"
	"time"
)

// shareKeysLimits: tenants and their consumers both lend; at most perParent consumer buckets
// per tenant, maxKeys buckets in the domain.
func shareKeysLimits(maxKeys, perParent uint64) *Limits {
	return &Limits{Domains: []Domain{{
		Name:    "sk",
		MaxKeys: maxKeys,
		Descriptors: []Node{{Key: "tenant", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 100}, Shares: &Shares{},
			Children: []Node{{Key: "consumer", MaxKeysPerParent: perParent, Rate: &Rate{Unit: time.Second, RequestsPerUnit: 50}, Shares: &Shares{}}}}},
	}}}
}

func shareKeysPath(tenant, consumer string) SharePath {
	return SharePath{Domain: "sk", Descriptors: []Entry{{"tenant", tenant}, {"consumer", consumer}}, Demand: math.MaxUint64, MaxCost: 1}
}

func shareKeysReq(seq uint64, keyCaps bool, paths ...SharePath) ShareRequest {
	return ShareRequest{Holder: HolderKey{Owner: "w", ID: "gw", Incarnation: 1}, Seq: seq, AckSeq: seq - 1,
		Paths: paths, NeedsFirst: true, KeyCaps: keyCaps}
}

// TestShareLendsObeyKeyCaps: a lend stores the buckets of its path's lendable levels, so it
// obeys the same caps as an admission: a path whose lend would store a consumer bucket beyond
// its tenant's max_keys_per_parent, or any bucket beyond the domain's max_keys, is not lent
// (central, with a message naming the cap and what to do), stores nothing, and its requests
// are refused centrally by the same cap; a renewal of the lends that fit is not refused; an
// entry older than command version 7 (no KeyCaps) lends as before, beyond the caps.
func TestShareLendsObeyKeyCaps(t *testing.T) {
	t.Run("max_keys_per_parent", func(t *testing.T) {
		e := mustEngine(t, shareKeysLimits(100, 2))
		paths := []SharePath{shareKeysPath("acme", "c0"), shareKeysPath("acme", "c1"), shareKeysPath("acme", "c2")}
		g, err := e.Share(0, shareKeysReq(1, true, paths...))
		if err != nil {
			t.Fatal(err)
		}
		for i, want := range []ShareStatus{ShareLent, ShareLent, ShareCentral} {
			if g.Paths[i].Status != want {
				t.Fatalf("path %d: %s (%s), want %s", i, g.Paths[i].Status, g.Paths[i].Message, want)
			}
		}
		if m := g.Paths[2].Message; !strings.Contains(m, `"sk/tenant=acme/consumer=c2"`) || !strings.Contains(m, `holds 2 active "consumer" buckets`) ||
			!strings.Contains(m, "max_keys_per_parent is 2") || !strings.Contains(m, "decide centrally") {
			t.Fatalf("refusal message: %s", m)
		}
		if got := e.Stats().Buckets; got != 3 {
			t.Fatalf("%d buckets stored, want 3 (the tenant and two consumers)", got)
		}
		// Centrally, the third consumer is refused by the same cap.
		d := e.Acquire(Time(time.Millisecond), Request{Domain: "sk", Descriptors: paths[2].Descriptors})
		if d.Reason != ReasonTooManyKeys || d.Limit != 2 {
			t.Fatalf("the third consumer centrally: %+v", d)
		}
		// A renewal keeps the lends that fit (their buckets are stored) and still refuses the third.
		g, err = e.Share(Time(time.Second), shareKeysReq(2, true, paths...))
		if err != nil {
			t.Fatal(err)
		}
		if g.Paths[0].Status != ShareLent || g.Paths[1].Status != ShareLent || g.Paths[2].Status != ShareCentral {
			t.Fatalf("renewal: %+v", g.Paths)
		}
		if got := e.Stats().Buckets; got != 3 {
			t.Fatalf("%d buckets stored after the renewal, want 3", got)
		}
		// Another tenant has its own part.
		g, err = e.Share(Time(time.Second), ShareRequest{Holder: HolderKey{Owner: "w", ID: "gw2", Incarnation: 1}, Seq: 1,
			Paths: []SharePath{shareKeysPath("globex", "c0")}, NeedsFirst: true, KeyCaps: true})
		if err != nil || g.Paths[0].Status != ShareLent {
			t.Fatalf("another tenant's consumer: %+v %v", g, err)
		}
	})
	t.Run("max_keys", func(t *testing.T) {
		e := mustEngine(t, shareKeysLimits(3, 0))
		g, err := e.Share(0, shareKeysReq(1, true, shareKeysPath("a", "x"), shareKeysPath("b", "x")))
		if err != nil {
			t.Fatal(err)
		}
		if g.Paths[0].Status != ShareLent || g.Paths[1].Status != ShareCentral {
			t.Fatalf("paths %+v, want the first lent, the second central", g.Paths)
		}
		if m := g.Paths[1].Message; !strings.Contains(m, `domain "sk" holds 2 active buckets and max_keys is 3`) ||
			!strings.Contains(m, `"sk/tenant=b"`) || !strings.Contains(m, "raise the domain's max_keys") {
			t.Fatalf("refusal message: %s", m)
		}
		if got := e.Stats().Buckets; got != 2 {
			t.Fatalf("%d buckets stored, want 2", got)
		}
		// A path adding one bucket still fits.
		g, err = e.Share(Time(time.Second), shareKeysReq(2, true, shareKeysPath("a", "x"), shareKeysPath("a", "y")))
		if err != nil || g.Paths[0].Status != ShareLent || g.Paths[1].Status != ShareLent {
			t.Fatalf("a path adding one bucket to a domain with room for one: %+v %v", g, err)
		}
		if got := e.Stats().Buckets; got != 3 {
			t.Fatalf("%d buckets stored, want 3", got)
		}
	})
	t.Run("older entries", func(t *testing.T) {
		for _, tc := range []struct {
			l    *Limits
			want int
		}{{shareKeysLimits(100, 2), 4}, {shareKeysLimits(3, 0), 4}} {
			e := mustEngine(t, tc.l)
			paths := []SharePath{shareKeysPath("acme", "c0"), shareKeysPath("acme", "c1"), shareKeysPath("acme", "c2")}
			if tc.l.Domains[0].MaxKeys == 3 {
				paths = []SharePath{shareKeysPath("a", "x"), shareKeysPath("b", "x")}
			}
			g, err := e.Share(0, shareKeysReq(1, false, paths...))
			if err != nil {
				t.Fatal(err)
			}
			for i, p := range g.Paths {
				if p.Status != ShareLent {
					t.Fatalf("path %d without KeyCaps: %s (%s), want lent as older builds did", i, p.Status, p.Message)
				}
			}
			if got := e.Stats().Buckets; got != tc.want {
				t.Fatalf("%d buckets stored without KeyCaps, want %d (beyond the cap, as older builds)", got, tc.want)
			}
		}
	})
}
