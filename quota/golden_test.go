package quota

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The golden workload pins the engine's observable behaviour across changes to its internals:
// a long, deterministic mix of every command over a few hundred keys (escaped names, adaptive
// levels, retry budgets, leases, pauses, refunds, limits that re-point and drop buckets, ticks
// that drop and keep). testdata/golden/workload.txt records, at checkpoints, the Hash, a digest of the
// snapshot bytes and a digest of every result so far; testdata/golden/workload_snapshot.bin is the final
// snapshot. Both were recorded by the map-based store this package had before its slab store,
// so they also prove that the snapshot format and Hash did not move. Rewrite only for an
// intended change of behaviour or format: go test ./quota/ -run Golden -rewrite.

// goldenRand is a fixed LCG, so the workload does not depend on math/rand's algorithms.
type goldenRand uint64

func (r *goldenRand) intn(n int) int {
	*r = *r*6364136223846793005 + 1442695040888963407
	return int(uint64(*r>>33) % uint64(n))
}

func goldenLimits(alt bool) *Limits {
	tenantRate := &Rate{Unit: time.Second, RequestsPerUnit: 5, Burst: 12}
	if alt {
		tenantRate = &Rate{Unit: time.Second, RequestsPerUnit: 7, Burst: 9}
	}
	tenant := Node{Key: "tenant", Rate: tenantRate, Children: []Node{
		{Key: "consumer", Rate: &Rate{Unit: 500 * time.Millisecond, RequestsPerUnit: 3}},
		{Key: "op", Value: "write", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 2}, Concurrency: &Concurrency{MaxInFlight: 2, LeaseTTL: 3 * time.Second}},
		{Key: "op", Rate: &Rate{Unit: time.Minute, RequestsPerUnit: 30}, ShadowMode: true},
	}}
	api := Domain{
		Name:        "api",
		Rate:        &Rate{Unit: time.Second, RequestsPerUnit: 400, Burst: 500},
		Concurrency: &Concurrency{MaxInFlight: 40, LeaseTTL: 2 * time.Second},
		Descriptors: []Node{
			tenant,
			{Key: "tenant", Value: "vip", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 50}, Concurrency: &Concurrency{MaxInFlight: 3, LeaseTTL: time.Second}},
			{Key: "path%/=x", Rate: &Rate{Unit: time.Hour, RequestsPerUnit: 1000, Burst: 20}},
			{Key: "free", Unlimited: true},
		},
	}
	if alt {
		// A new exact child takes over keys of the per-value level; the odd-named level goes.
		api.Descriptors = append(api.Descriptors, Node{Key: "tenant", Value: "t3", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1, Burst: 4}})
		api.Descriptors = slicesDeleteFunc(api.Descriptors, func(n Node) bool { return n.Key == "path%/=x" })
	}
	p := Domain{
		Name:         "p",
		Rate:         &Rate{Unit: time.Second, RequestsPerUnit: 100, Burst: 20},
		Adaptive:     &Adaptive{Floor: 10, DecreasePercent: 50, Increase: 10, StableWindow: 400 * time.Millisecond},
		RetryBudget:  &RetryBudget{RatioPercent: 20, MinPerSecond: 1},
		ResumeJitter: 300 * time.Millisecond,
		Descriptors: []Node{{Key: "endpoint", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 40, Burst: 8},
			Adaptive: &Adaptive{Floor: 4, DecreasePercent: 70, Increase: 4, StableWindow: 300 * time.Millisecond}}},
	}
	c := Domain{Name: "c/%=", Concurrency: &Concurrency{MaxInFlight: 5, LeaseTTL: 4 * time.Second},
		Descriptors: []Node{{Key: "k", Rate: &Rate{Unit: 24 * time.Hour, RequestsPerUnit: 3, Burst: 3}}}}
	return &Limits{Domains: []Domain{api, p, c}}
}

func slicesDeleteFunc(ns []Node, del func(Node) bool) []Node {
	var out []Node
	for _, n := range ns {
		if !del(n) {
			out = append(out, n)
		}
	}
	return out
}

type goldenCheckpoint struct {
	op       int
	hash     uint64
	snapshot string // sha256 of MarshalBinary, hex
	results  string // sha256 of the results so far, hex
	stats    string
}

func (c goldenCheckpoint) String() string {
	return fmt.Sprintf("op=%d hash=%016x snapshot=%s results=%s %s", c.op, c.hash, c.snapshot, c.results, c.stats)
}

// runGolden applies the workload and returns its checkpoints and final engine.
func runGolden(t testing.TB) ([]goldenCheckpoint, *Engine) {
	e := NewEngine()
	rnd := goldenRand(42)
	tenantName := func() string {
		switch i := rnd.intn(400); {
		case i < 3:
			return []string{"vip", "t3", "a/b=c%d"}[i]
		default:
			return fmt.Sprintf("t%d", i%300)
		}
	}
	var now Time
	var admitted []Decision
	var leases []uint64
	results := sha256.New()
	var out []goldenCheckpoint
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	must(e.SetLimits(0, goldenLimits(false)))
	const ops = 30000
	for i := 0; i < ops; i++ {
		// Mostly small steps, sometimes a long idle gap so buckets refill and drop.
		switch rnd.intn(100) {
		case 0:
			now += Time(time.Duration(rnd.intn(90)) * time.Second)
		case 1:
			now -= Time(rnd.intn(5)) * Time(time.Millisecond) // late timestamp
		default:
			now += Time(rnd.intn(3000)) * Time(time.Microsecond)
		}
		var res string
		switch k := rnd.intn(100); {
		case k < 55:
			var req Request
			switch rnd.intn(10) {
			case 0, 1:
				req = Request{Domain: "p", Descriptors: []Entry{{"endpoint", fmt.Sprintf("e%d", rnd.intn(6))}},
					Attempt: uint32(rnd.intn(3) + 1), Spread: uint64(i) * 0x9e3779b97f4a7c15}
			case 2:
				req = Request{Domain: "c/%=", Descriptors: []Entry{{"k", fmt.Sprintf("v%d", rnd.intn(20))}}}
			case 3:
				req = Request{Domain: "api", Descriptors: []Entry{{"path%/=x", fmt.Sprintf("x%d=/%%", rnd.intn(30))}}}
			default:
				req = Request{Domain: "api", Descriptors: []Entry{{"tenant", tenantName()}}, Cost: uint64(rnd.intn(3))}
				switch rnd.intn(4) {
				case 0:
					req.Descriptors = append(req.Descriptors, Entry{"consumer", fmt.Sprintf("c%d", rnd.intn(4))})
				case 1:
					req.Descriptors = append(req.Descriptors, Entry{"op", []string{"write", "read", "list"}[rnd.intn(3)]})
				}
			}
			if rnd.intn(20) == 0 {
				req.LeaseTTL = time.Duration(rnd.intn(5)) * time.Second
			}
			d := e.Acquire(now, req)
			if d.Admitted {
				admitted = append(admitted, d)
				if d.LeaseID != 0 {
					leases = append(leases, d.LeaseID)
				}
			}
			res = fmt.Sprintf("%+v", d)
		case k < 63:
			if len(admitted) > 0 {
				d := admitted[rnd.intn(len(admitted))]
				res = fmt.Sprintf("%+v", e.Refund(now, d.Charges, uint64(rnd.intn(3)), d.DebitSeq))
			}
		case k < 68:
			if len(leases) > 0 {
				res = fmt.Sprint(e.Release(now, leases[rnd.intn(len(leases))]))
			}
		case k < 71:
			if len(leases) > 0 {
				ttl, err := e.Renew(now, leases[rnd.intn(len(leases))], time.Duration(rnd.intn(3))*time.Second)
				res = fmt.Sprint(ttl, err)
			}
		case k < 74:
			prefix := []Entry{{"tenant", tenantName()}}
			if rnd.intn(3) == 0 {
				prefix = nil
			}
			scope, err := e.Pause(now, "api", prefix, now+Time(rnd.intn(2000))*Time(time.Millisecond))
			res = fmt.Sprint(scope, err)
		case k < 76:
			ok, err := e.Resume(now, "api", []Entry{{"tenant", tenantName()}})
			res = fmt.Sprint(ok, err)
		case k < 82:
			var prefix []Entry
			if rnd.intn(2) == 0 {
				prefix = []Entry{{"endpoint", fmt.Sprintf("e%d", rnd.intn(6))}}
			}
			r, err := e.Feedback(now, Feedback{Domain: "p", Prefix: prefix, StatusCode: []uint32{429, 503}[rnd.intn(2)],
				RetryAfter: time.Duration(rnd.intn(4)) * 100 * time.Millisecond, Reason: []string{"", "r"}[rnd.intn(2)]})
			res = fmt.Sprint(r, err)
		case k < 95:
			e.Tick(now)
			res = fmt.Sprintf("%+v", e.Stats())
		case k < 96:
			must(e.SetLimits(now, goldenLimits(rnd.intn(2) == 0)))
			res = fmt.Sprintf("%+v", e.Stats())
		case k < 98:
			st, err := e.Status(now, "api", []Entry{{"tenant", tenantName()}, {"consumer", "c1"}})
			res = fmt.Sprintf("%+v %v", goldenStatus(st), err)
		default:
			res = fmt.Sprintf("%+v", e.Adaptive())
		}
		fmt.Fprintf(results, "%d %s\n", i, res)
		if i%2500 == 2499 || i == ops-1 {
			checkStore(t, e)
			snap, err := e.MarshalBinary()
			must(err)
			s := sha256.Sum256(snap)
			out = append(out, goldenCheckpoint{op: i, hash: e.Hash(), snapshot: hex.EncodeToString(s[:]),
				results: hex.EncodeToString(results.Sum(nil)), stats: fmt.Sprintf("%+v", e.Stats())})
		}
	}
	return out, e
}

// checkGolden compares a workload's checkpoints and final snapshot with testdata/golden/<name>.txt
// and <name>_snapshot.bin (rewritten with -rewrite), then checks that the golden snapshot
// restores into an engine that behaves like e on domain.
func checkGolden(t *testing.T, name string, cps []goldenCheckpoint, e *Engine, domain string) {
	t.Helper()
	var got strings.Builder
	for _, c := range cps {
		fmt.Fprintln(&got, c)
	}
	snap, err := e.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	txt, bin := filepath.Join("testdata", "golden", name+".txt"), filepath.Join("testdata", "golden", name+"_snapshot.bin")
	if *rewrite {
		if err := os.WriteFile(txt, []byte(got.String()), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(bin, snap, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(txt)
	if err != nil {
		t.Fatal(err)
	}
	if got.String() != string(want) {
		t.Fatalf("golden %s workload diverged:\ngot:\n%s\nwant:\n%s", name, got.String(), want)
	}
	wantSnap, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(snap, wantSnap) {
		t.Fatalf("final snapshot differs from %s", bin)
	}
	checkGoldenRestore(t, wantSnap, cps[len(cps)-1].hash, e, domain)
}

func TestGoldenWorkload(t *testing.T) {
	cps, e := runGolden(t)
	checkGolden(t, "workload", cps, e, "api")
}

// A snapshot written by the old store restores into an engine that writes it back byte for byte,
// hashes the same, and then behaves like the engine that wrote it.
func checkGoldenRestore(t *testing.T, data []byte, wantHash uint64, orig *Engine, domain string) {
	r := NewEngine()
	if err := r.UnmarshalBinary(data); err != nil {
		t.Fatal(err)
	}
	checkStore(t, r)
	again, err := r.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(again, data) {
		t.Fatal("restored golden snapshot re-encodes differently")
	}
	if r.Hash() != wantHash {
		t.Fatalf("restored hash %016x, want %016x", r.Hash(), wantHash)
	}
	// Both go on identically: every tenant once more, then an idle tick drops what refilled.
	now := orig.Clock() + Time(time.Millisecond)
	for i := 0; i < 300; i++ {
		req := Request{Domain: domain, Descriptors: []Entry{{"tenant", fmt.Sprintf("t%d", i)}, {"consumer", "c1"}}}
		if a, b := fmt.Sprintf("%+v", orig.Acquire(now, req)), fmt.Sprintf("%+v", r.Acquire(now, req)); a != b {
			t.Fatalf("after restore, tenant %d: %s vs %s", i, a, b)
		}
	}
	for _, e := range []*Engine{orig, r} {
		e.Tick(now + Time(2*time.Second))
	}
	if orig.Hash() != r.Hash() || orig.Stats() != r.Stats() {
		t.Fatalf("after restore and tick: %+v vs %+v", orig.Stats(), r.Stats())
	}
}

// bulkLimits: day-rate buckets under k, second-rate ones under tenant/consumer; the alternative
// changes the tenant rate (re-pointing and clamping), gives one consumer an exact level, and
// drops the consumer level's per-value buckets.
func bulkLimits(alt bool) *Limits {
	consumer := []Node{{Key: "consumer", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 2, Burst: 3}}}
	tenantRate := &Rate{Unit: time.Second, RequestsPerUnit: 1, Burst: 5}
	if alt {
		consumer = []Node{{Key: "consumer", Value: "c1", Rate: &Rate{Unit: time.Minute, RequestsPerUnit: 2}}}
		tenantRate = &Rate{Unit: time.Second, RequestsPerUnit: 3, Burst: 4}
	}
	return &Limits{Domains: []Domain{{
		Name: "b%",
		Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1_000_000},
		Descriptors: []Node{
			{Key: "k", Rate: &Rate{Unit: 24 * time.Hour, RequestsPerUnit: 3, Burst: 3}},
			{Key: "tenant", Rate: tenantRate, Children: consumer},
		},
	}}}
}

// runGoldenBulk drives thousands of keys through the store: long-lived day-rate buckets mixed
// with second-rate ones that refill and drop, so slots and key bytes are freed and reused, the
// store crosses chunk boundaries and index growth, and limits re-point and drop buckets.
func runGoldenBulk(t testing.TB) ([]goldenCheckpoint, *Engine) {
	e := NewEngine()
	rnd := goldenRand(7)
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	must(e.SetLimits(0, bulkLimits(false)))
	var now Time
	results := sha256.New()
	var out []goldenCheckpoint
	var admitted []Decision
	checkpoint := func(op int) {
		checkStore(t, e)
		snap, err := e.MarshalBinary()
		must(err)
		s := sha256.Sum256(snap)
		out = append(out, goldenCheckpoint{op: op, hash: e.Hash(), snapshot: hex.EncodeToString(s[:]),
			results: hex.EncodeToString(results.Sum(nil)), stats: fmt.Sprintf("%+v", e.Stats())})
	}
	op := 0
	for round := 0; round < 12; round++ {
		// A wave of new keys of both kinds, with a varying share of long keys.
		for i := 0; i < 1500; i++ {
			now += Time(rnd.intn(200)) * Time(time.Microsecond)
			var req Request
			if rnd.intn(3) == 0 {
				req = Request{Domain: "b%", Descriptors: []Entry{{"k", fmt.Sprintf("day-%d-%s", rnd.intn(9000), strings.Repeat("z", rnd.intn(40)))}}}
			} else {
				req = Request{Domain: "b%", Descriptors: []Entry{{"tenant", fmt.Sprintf("w%d-%d", round, rnd.intn(5000))}, {"consumer", fmt.Sprintf("c%d", rnd.intn(3))}}}
			}
			d := e.Acquire(now, req)
			if d.Admitted && rnd.intn(4) == 0 {
				admitted = append(admitted, d)
			}
			fmt.Fprintf(results, "%d %+v\n", op, d)
			op++
		}
		for i := 0; i < 200 && len(admitted) > 0; i++ {
			d := admitted[rnd.intn(len(admitted))]
			fmt.Fprintf(results, "%d %+v\n", op, e.Refund(now, d.Charges, uint64(rnd.intn(2)+1), d.DebitSeq))
			op++
		}
		// Partly idle: some second-rate buckets refill and go.
		now += Time(rnd.intn(4000)) * Time(time.Millisecond)
		e.Tick(now)
		fmt.Fprintf(results, "%d %+v\n", op, e.Stats())
		op++
		if round%4 == 3 {
			must(e.SetLimits(now, bulkLimits(round%8 == 3)))
			fmt.Fprintf(results, "%d %+v\n", op, e.Stats())
			op++
		}
		checkpoint(op)
	}
	return out, e
}

func TestGoldenBulkWorkload(t *testing.T) {
	cps, e := runGoldenBulk(t)
	checkGolden(t, "bulk", cps, e, "b%")
}

// goldenStatusView is BucketStatus as the golden results were recorded: fields added since
// (LentLimit, LentBurst: always 0 here, the workload lends nothing) are left out so that the
// recorded hashes keep checking the decisions, not the struct's shape.
type goldenStatusView struct {
	Scope       string
	Key         string
	Limit       uint64
	Burst       uint64
	Remaining   uint64
	Window      time.Duration
	ResetAfter  time.Duration
	InFlight    uint64
	MaxInFlight uint64
	PausedFor   time.Duration
	Ceiling     uint64
	RetryTokens uint64
}

func goldenStatus(st []BucketStatus) []goldenStatusView {
	if st == nil {
		return nil
	}
	out := make([]goldenStatusView, len(st))
	for i, b := range st {
		if b.LentLimit != 0 || b.LentBurst != 0 {
			panic("golden workload: a bucket is lent")
		}
		out[i] = goldenStatusView{b.Scope, b.Key, b.Limit, b.Burst, b.Remaining, b.Window, b.ResetAfter, b.InFlight, b.MaxInFlight, b.PausedFor, b.Ceiling, b.RetryTokens}
	}
	return out
}
