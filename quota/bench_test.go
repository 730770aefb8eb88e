package quota

import (
	"fmt"
	"runtime"
	"strconv"
	"testing"
	"time"
)

// benchLimits: a domain ceiling, per-tenant and per-consumer buckets, all roomy enough that the
// benchmarks measure admission, not refusal.
func benchLimits() *Limits {
	return &Limits{Domains: []Domain{{
		Name:    "api",
		MaxKeys: 1 << 24, // benchmarks hold millions of buckets; the default caps at 100000
		Rate:    &Rate{Unit: time.Second, RequestsPerUnit: 10_000_000},
		Descriptors: []Node{{
			Key:  "tenant",
			Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1_000_000},
			Children: []Node{{
				Key:  "consumer",
				Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1_000_000},
			}},
		}},
	}}}
}

// BenchmarkAcquire is the hot path: one request through three buckets, admitted.
func BenchmarkAcquire(b *testing.B) {
	e := mustEngine(b, benchLimits())
	req := Request{Domain: "api", Descriptors: []Entry{{"tenant", "acme"}, {"consumer", "mobile-app"}}}
	now := Time(0)
	b.ReportAllocs()
	for b.Loop() {
		now += Time(time.Microsecond)
		if d := e.Acquire(now, req); !d.Admitted {
			b.Fatalf("refused: %+v", d)
		}
	}
}

// BenchmarkAcquireDenied: under overload most requests are refused; that path must stay cheap.
func BenchmarkAcquireDenied(b *testing.B) {
	e := mustEngine(b, oneBucket(1, time.Hour, 0))
	req := Request{Domain: "d"}
	e.Acquire(0, req)
	b.ReportAllocs()
	for b.Loop() {
		if d := e.Acquire(1, req); d.Admitted {
			b.Fatal("admitted")
		}
	}
}

// BenchmarkAcquireManyKeys cycles through 1M tenants, so nearly every call misses the CPU cache
// and half the buckets are new.
func BenchmarkAcquireManyKeys(b *testing.B) {
	const keys = 1 << 20
	tenants := make([]string, keys)
	for i := range tenants {
		tenants[i] = "t" + strconv.Itoa(i)
	}
	e := mustEngine(b, benchLimits())
	req := Request{Domain: "api", Descriptors: []Entry{{"tenant", ""}}}
	now := Time(0)
	i := 0
	b.ReportAllocs()
	for b.Loop() {
		now += Time(time.Microsecond)
		req.Descriptors[0].Value = tenants[i&(keys-1)]
		i++
		if d := e.Acquire(now, req); !d.Admitted {
			b.Fatalf("refused: %+v", d)
		}
	}
	b.ReportMetric(float64(e.Stats().Buckets), "buckets")
}

// BenchmarkAcquireManyKeysPerParent: as BenchmarkAcquireManyKeys one level down: 1M consumers
// under 1024 tenants, with and without max_keys_per_parent on the consumer level (the cost of
// counting each new bucket under its tenant and checking the count).
func BenchmarkAcquireManyKeysPerParent(b *testing.B) {
	const keys, tenants = 1 << 20, 1 << 10
	values := make([][2]string, keys)
	for i := range values {
		values[i] = [2]string{"t" + strconv.Itoa(i%tenants), "c" + strconv.Itoa(i)}
	}
	for _, perParent := range []uint64{0, keys} {
		b.Run(fmt.Sprintf("max_keys_per_parent=%d", perParent), func(b *testing.B) {
			l := benchLimits()
			l.Domains[0].Descriptors[0].Children[0].MaxKeysPerParent = perParent
			e := mustEngine(b, l)
			req := Request{Domain: "api", Descriptors: []Entry{{"tenant", ""}, {"consumer", ""}}}
			now := Time(0)
			i := 0
			b.ReportAllocs()
			for b.Loop() {
				now += Time(time.Microsecond)
				v := &values[i&(keys-1)]
				req.Descriptors[0].Value, req.Descriptors[1].Value = v[0], v[1]
				i++
				if d := e.Acquire(now, req); !d.Admitted {
					b.Fatalf("refused: %+v", d)
				}
			}
			b.ReportMetric(float64(e.Stats().Buckets), "buckets")
		})
	}
}

// engineWithBuckets returns an engine holding n stored per-tenant buckets (plus the ceiling)
// that stay stored: the tenant rate is slow, so none is full again for hours.
func engineWithBuckets(tb testing.TB, n int) *Engine {
	l := benchLimits()
	l.Domains[0].Descriptors[0].Rate = &Rate{Unit: time.Hour, RequestsPerUnit: 10}
	e := mustEngine(tb, l)
	req := Request{Domain: "api", Descriptors: []Entry{{"tenant", ""}}}
	for i := 0; i < n; i++ {
		req.Descriptors[0].Value = "tenant-" + strconv.Itoa(i)
		if d := e.Acquire(Time(i), req); !d.Admitted {
			tb.Fatalf("refused: %+v", d)
		}
	}
	return e
}

// BenchmarkSnapshot1M: MarshalBinary and UnmarshalBinary of an engine with 1M buckets.
func BenchmarkSnapshot1M(b *testing.B) {
	e := engineWithBuckets(b, 1_000_000)
	data, err := e.MarshalBinary()
	if err != nil {
		b.Fatal(err)
	}
	b.Run("Marshal", func(b *testing.B) {
		for b.Loop() {
			if _, err := e.MarshalBinary(); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(len(data)), "bytes")
	})
	b.Run("Unmarshal", func(b *testing.B) {
		for b.Loop() {
			if err := NewEngine().UnmarshalBinary(data); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("RoundTrip", func(b *testing.B) {
		for b.Loop() {
			data, err := e.MarshalBinary()
			if err != nil {
				b.Fatal(err)
			}
			if err := NewEngine().UnmarshalBinary(data); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("Hash", func(b *testing.B) {
		for b.Loop() {
			e.Hash()
		}
	})
	b.Run("TickNothingDue", func(b *testing.B) {
		for b.Loop() {
			e.Tick(e.Clock())
		}
		if e.Stats().Buckets < 1_000_000 {
			b.Fatal("buckets were dropped")
		}
	})
	b.Run("SetLimits", func(b *testing.B) {
		// Alternate two tenant rates so every call re-points and clamps every bucket.
		l := e.Limits()
		rates := []uint64{10, 20}
		i := 0
		for b.Loop() {
			l.Domains[0].Descriptors[0].Rate.RequestsPerUnit = rates[i%2]
			i++
			if err := e.SetLimits(e.Clock(), l); err != nil {
				b.Fatal(err)
			}
		}
		if e.Stats().Buckets < 1_000_000 {
			b.Fatal("buckets were dropped")
		}
	})
	b.Run("TickDropAll", func(b *testing.B) {
		for b.Loop() {
			b.StopTimer()
			n := NewEngine()
			if err := n.UnmarshalBinary(data); err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
			n.Tick(n.Clock().Add(24 * time.Hour))
			if n.Stats().Buckets != 0 {
				b.Fatal("buckets left")
			}
		}
	})
}

// BenchmarkMemory1M reports the live heap per stored bucket with 1M buckets.
func BenchmarkMemory1M(b *testing.B) {
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		e := engineWithBuckets(b, 1_000_000)
		runtime.GC()
		runtime.ReadMemStats(&after)
		n := e.Stats().Buckets
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(n), "heapB/bucket")
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/(1<<20), "heapMiB")
		runtime.KeepAlive(e)
	}
}
