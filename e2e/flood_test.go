package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/internal/proccluster"
)

// The flood: what one hostile caller can make a cluster hold is capped, and honest callers are
// served through it. Three agent processes; for QUOTAD_FLOOD_DURATION (default 10s; the issue's
// scenario is a minute:
//
//	QUOTAD_FLOOD_DURATION=60s go test ./e2e -run TestCapsFlood -v -timeout 10m
//
// ) at once:
//   - fresh tenant values as fast as 4 callers with 500 admissions per call can send them, round
//     robin over the nodes, into a domain with max_keys 5000 (its tenant buckets stay stored
//     for a minute each: without the cap every value would be held);
//   - huge fields: a 900 KB work_class, a 900 KB feedback reason, a 2 MB descriptor value
//     (above --max-request-bytes), 20 times a second;
//   - 5000 waiting admissions from one client_id on a bucket that refills once a minute;
//   - honest callers: 50/s on another domain, 20/s on an established tenant of the flooded
//     domain, each admission a new request.
//
// It asserts: the flood hits too_many_keys and the domain never holds more than max_keys
// buckets; every huge field is refused and the data dirs grow by a small fraction of the bytes
// sent; at most --max-waiters-per-client admissions wait, the rest are denied at once; no
// leadership change on any node; every honest admission is admitted, every second; each
// node's RSS stays under floodRSSBound.

// floodRSSBound is the documented bound on each agent's resident memory during the flood
// (see the test's log for the measured peak).
const floodRSSBound = 512 << 20

const (
	floodMaxKeys     = 5000
	floodWaiterCap   = 1000 // the agents' default --max-waiters-per-client
	floodWaiters     = 5000
	floodKeyCallers  = 4
	floodKeysPerCall = 500
)

const floodLimits = `
domain: flood
max_keys: 5000
descriptors:
  - key: tenant
    value: steady                # an established tenant: half spent before the flood, never full again, so always held
    rate_limit: {unit: second, requests_per_unit: 10, burst: 100000}
  - key: tenant                  # one bucket per value, held for a minute after one admission
    rate_limit: {unit: hour, requests_per_unit: 60, burst: 60}
---
domain: slow
rate_limit: {unit: minute, requests_per_unit: 1, burst: 1}
---
domain: other
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100, burst: 100}
`

func floodDuration(t *testing.T) time.Duration {
	v := os.Getenv("QUOTAD_FLOOD_DURATION")
	if v == "" {
		return 10 * time.Second
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		t.Fatalf("QUOTAD_FLOOD_DURATION=%q: want a positive Go duration such as 60s", v)
	}
	return d
}

// counts is a concurrency-safe tally by name.
type counts struct {
	mu sync.Mutex
	m  map[string]int64
}

func (c *counts) add(k string, n int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = make(map[string]int64)
	}
	c.m[k] += n
}

// hugeAllRefused: every huge request was refused with its cap's answer, or was cut by the end
// of its phase (the context ends while the last ones are in flight: DeadlineExceeded or
// Canceled) — never admitted, never another error.
func hugeAllRefused(c *counts) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	refused := map[string]bool{"work_class_invalid": true, "feedback_err_InvalidArgument": true,
		"2MB_err_ResourceExhausted": true}
	for k, n := range c.m {
		cut := strings.HasSuffix(k, "_err_DeadlineExceeded") || strings.HasSuffix(k, "_err_Canceled")
		if n > 0 && !refused[k] && !cut {
			return false
		}
	}
	return c.m["work_class_invalid"] > 0 && c.m["feedback_err_InvalidArgument"] > 0 && c.m["2MB_err_ResourceExhausted"] > 0
}

func (c *counts) get(k string) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m[k]
}

func (c *counts) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	keys := make([]string, 0, len(c.m))
	for k := range c.m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%s=%d ", k, c.m[k])
	}
	return strings.TrimSpace(b.String())
}

func errKey(err error) string {
	if s, ok := status.FromError(err); ok {
		return "err_" + s.Code().String()
	}
	return "err_other"
}

// nodeMetrics reads the named series (no labels) from node i's /metrics.
func nodeMetrics(ctx context.Context, c *proccluster.Cluster, i int, names ...string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.URL(i, "/metrics"), nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.HTTPClient().Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out := make(map[string]float64)
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		name, val, ok := strings.Cut(sc.Text(), " ")
		if !ok || !slices.Contains(names, name) {
			continue
		}
		if f, err := strconv.ParseFloat(strings.TrimSpace(val), 64); err == nil {
			out[name] = f
		}
	}
	return out, sc.Err()
}

func dirSize(t *testing.T, dir string) int64 {
	var n int64
	err := filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			if info, err := d.Info(); err == nil {
				n += info.Size()
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestCapsFlood(t *testing.T) {
	if testing.Short() {
		t.Skip("a flood of several seconds")
	}
	dur := floodDuration(t)
	c := startClusterWith(t, 3, floodLimits)
	leader, err := c.WaitLeader(15 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	dialOpts, err := c.DialOptions()
	if err != nil {
		t.Fatal(err)
	}
	conns := make([]quotadv1.QuotaClient, len(c.Nodes))
	for i, n := range c.Nodes {
		cc, err := grpc.NewClient(n.GRPCAddr, dialOpts...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		conns[i] = quotadv1.NewQuotaClient(cc)
	}
	ctx := context.Background()
	leaderID := c.Nodes[leader].ID
	// Every node knows the leader (and has counted that change) before the baseline is read.
	waitFor(t, 10*time.Second, "every node to know the leader", func() bool {
		for i := range c.Nodes {
			if s, err := c.State(ctx, i); err != nil || s.Leader != leaderID {
				return false
			}
		}
		time.Sleep(300 * time.Millisecond) // the agents' watch loops poll every 100ms
		return true
	})
	changesBefore := make([]float64, len(c.Nodes))
	sizeBefore := int64(0)
	for i, n := range c.Nodes {
		m, err := nodeMetrics(ctx, c, i, "quotad_leader_changes_total")
		if err != nil {
			t.Fatal(err)
		}
		changesBefore[i] = m["quotad_leader_changes_total"]
		sizeBefore += dirSize(t, n.DataDir)
	}

	// Phase 1: huge fields alone, so that what they add to the log can be told apart.
	var hugeAlone counts
	var hugeAloneBytes atomic.Int64
	phase1 := max(2*time.Second, dur/5)
	p1ctx, p1stop := context.WithTimeout(ctx, phase1)
	sendHuge(p1ctx, conns, &hugeAlone, &hugeAloneBytes)
	p1stop()
	sizeMid := int64(0)
	for _, n := range c.Nodes {
		sizeMid += dirSize(t, n.DataDir)
	}
	t.Logf("huge fields alone for %v: %s; %d MB sent, data dirs grew %d KB (3 nodes)",
		phase1, &hugeAlone, hugeAloneBytes.Load()>>20, (sizeMid-sizeBefore)>>10)
	if !hugeAllRefused(&hugeAlone) {
		t.Errorf("huge fields not all refused: %s", &hugeAlone)
	}
	if grew := sizeMid - sizeBefore; grew > 4<<20 {
		t.Errorf("huge fields alone grew the data dirs %d KB; they must not reach the log", grew>>10)
	}
	sizeBefore = sizeMid

	// Phase 2: everything at once.
	// The established tenant holds its bucket before the flood starts. A tenant that first
	// shows up after a flood filled max_keys waits until idle buckets are swept: the cap's
	// documented cost (docs/security.md), not what this test measures. It spends half its
	// burst, so the bucket stays below full (and stored) for the whole run: one unit refilled
	// in 0.1 s, and a sweep in a loaded moment before the honest caller's first call dropped
	// the full bucket, so the flood took its place (CI-like load, session 8).
	if r, err := conns[leader].Acquire(ctx, &quotadv1.AcquireRequest{ClientId: "establish", Admissions: []*quotadv1.Admission{
		{RequestId: 1, Domain: "flood", Cost: 50000, Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "steady"}}}}}); err != nil || !r.Decisions[0].Admitted {
		t.Fatalf("establishing tenant steady before the flood: %v %v", r, err)
	}
	runCtx, stop := context.WithTimeout(ctx, dur)
	defer stop()
	var (
		wg                             sync.WaitGroup
		keys, huge, waiters, honest    counts
		hugeBytes                      atomic.Int64
		peakRSS, peakHeap, peakBuckets [3]atomic.Int64
		peakGoroutines                 atomic.Int64
		leadersSeen                    sync.Map
		perSecond                      [2][]atomic.Int64 // honest admissions per second of the run
		honestLatency                  latencies
	)
	seconds := int(dur/time.Second) + 2
	for i := range perSecond {
		perSecond[i] = make([]atomic.Int64, seconds)
	}
	start := time.Now()

	// Fresh tenant values.
	for w := range floodKeyCallers {
		wg.Go(func() {
			id := uint64(0)
			for call := 0; runCtx.Err() == nil; call++ {
				req := &quotadv1.AcquireRequest{ClientId: fmt.Sprintf("flood-keys-%d", w)}
				for range floodKeysPerCall {
					id++
					req.Admissions = append(req.Admissions, &quotadv1.Admission{RequestId: id, Domain: "flood",
						Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: fmt.Sprintf("fresh-%d-%d", w, id)}}})
				}
				cctx, cancel := context.WithTimeout(runCtx, 5*time.Second)
				resp, err := conns[(w+call)%len(conns)].Acquire(cctx, req)
				cancel()
				if err != nil {
					if runCtx.Err() == nil {
						keys.add(errKey(err), 1)
					}
					continue
				}
				for _, d := range resp.Decisions {
					keys.add(d.Reason, 1)
				}
			}
		})
	}

	// Huge fields.
	wg.Go(func() { sendHuge(runCtx, conns, &huge, &hugeBytes) })

	// Waiters: one client, far more than its cap, each waiting up to ten minutes.
	var decidedAt sync.Map // reason -> time the first denial came back
	for i := range floodWaiters {
		wg.Go(func() {
			sent := time.Now()
			resp, err := conns[leader].Acquire(runCtx, &quotadv1.AcquireRequest{ClientId: "flood-wait", Admissions: []*quotadv1.Admission{
				{RequestId: uint64(i + 1), Domain: "slow", MaxWaitMs: 600_000}}})
			switch {
			case err != nil && runCtx.Err() != nil:
				waiters.add("held_until_the_end", 1)
			case err != nil:
				waiters.add(errKey(err), 1)
			default:
				r := resp.Decisions[0].Reason
				waiters.add(r, 1)
				if r == "too_many_waiters" {
					// "At once": far below the 600 s wait it asked for. 1 s held alone (all
					// 3,999 within it) but not beside make test's other packages on 2 cores
					// (3,482 of 3,999 at s9-int).
					waiters.add("denied_within_5s", int64(map[bool]int{true: 1}[time.Since(sent) < 5*time.Second]))
				}
				decidedAt.LoadOrStore(r, time.Since(start))
			}
		})
	}

	// Honest callers: a new request every tick, each admitted.
	// Open loop, as independent requests arrive: one goroutine per request, so a slow answer
	// does not hold the next one back.
	honestCaller := func(which int, domain, tenant string, every time.Duration, node int) {
		wg.Go(func() {
			tick := time.NewTicker(every)
			defer tick.Stop()
			var calls sync.WaitGroup
			defer calls.Wait()
			for id := uint64(1); ; id++ {
				select {
				case <-runCtx.Done():
					return
				case <-tick.C:
				}
				calls.Go(func() {
					honestCall(ctx, conns[node], domain, tenant, id, start, &honest, perSecond[which], &honestLatency)
				})
			}
		})
	}
	honestCaller(0, "other", "good", 20*time.Millisecond, (leader+1)%3) // 50/s through a follower
	honestCaller(1, "flood", "steady", 50*time.Millisecond, leader)     // 20/s in the flooded domain

	// Monitor: memory, goroutines, buckets and leadership on every node.
	wg.Go(func() {
		for runCtx.Err() == nil {
			for i := range c.Nodes {
				mctx, cancel := context.WithTimeout(ctx, time.Second)
				m, err := nodeMetrics(mctx, c, i, "process_resident_memory_bytes", "go_memstats_heap_inuse_bytes", "go_goroutines", "quotad_active_buckets")
				if err == nil {
					maxInto(&peakRSS[i], int64(m["process_resident_memory_bytes"]))
					maxInto(&peakHeap[i], int64(m["go_memstats_heap_inuse_bytes"]))
					maxInto(&peakBuckets[i], int64(m["quotad_active_buckets"]))
					if i == leader {
						maxInto(&peakGoroutines, int64(m["go_goroutines"]))
					}
				}
				if s, err := c.State(mctx, i); err == nil {
					leadersSeen.Store(s.Leader, true)
				}
				cancel()
			}
			select {
			case <-runCtx.Done():
			case <-time.After(250 * time.Millisecond):
			}
		}
	})
	wg.Wait()
	took := time.Since(start)

	// Results.
	var leaders []string
	leadersSeen.Range(func(k, _ any) bool { leaders = append(leaders, k.(string)); return true })
	sizeAfter := int64(0)
	for _, n := range c.Nodes {
		sizeAfter += dirSize(t, n.DataDir)
	}
	growth := sizeAfter - sizeBefore
	t.Logf("flood of %v:", took.Round(time.Millisecond))
	t.Logf("  fresh keys: %s (%.0f decisions/s)", &keys, float64(keys.get("ok")+keys.get("too_many_keys"))/took.Seconds())
	t.Logf("  huge fields: %s; %d MB sent, data dirs grew %.1f MB (3 nodes)", &huge, hugeBytes.Load()>>20, float64(growth)/(1<<20))
	t.Logf("  waiters: %s", &waiters)
	t.Logf("  honest: %s; latency %s", &honest, &honestLatency)
	for i, n := range c.Nodes {
		t.Logf("  %s: peak RSS %.0f MB, peak heap in use %.0f MB, peak buckets %d", n.ID,
			float64(peakRSS[i].Load())/(1<<20), float64(peakHeap[i].Load())/(1<<20), peakBuckets[i].Load())
	}
	t.Logf("  leader %s: peak goroutines %d; leaders seen %v", leaderID, peakGoroutines.Load(), leaders)

	// Caps held.
	if keys.get("too_many_keys") == 0 {
		t.Errorf("the flood of fresh keys never hit too_many_keys: %s", &keys)
	}
	for i, n := range c.Nodes {
		// The flooded domain's max_keys plus the honest callers' buckets.
		if b := peakBuckets[i].Load(); b > floodMaxKeys+10 {
			t.Errorf("%s held %d buckets, above max_keys %d", n.ID, b, floodMaxKeys)
		}
		if peakRSS[i].Load() == 0 {
			t.Errorf("%s: no /metrics sample was read during the flood: the memory bound was not checked", n.ID)
		}
		if rss := peakRSS[i].Load(); rss > floodRSSBound {
			t.Errorf("%s peak RSS %d MB, above the bound %d MB", n.ID, rss>>20, floodRSSBound>>20)
		}
	}
	if !hugeAllRefused(&huge) {
		t.Errorf("huge fields not all refused: %s", &huge)
	}
	// The log holds the small admissions (each op is well under 200 bytes), nothing more.
	decided := keys.get("ok") + keys.get("too_many_keys") + keys.get("invalid") + honest.get("other_admitted") + honest.get("flood_admitted")
	if budget := 3*200*decided + 16<<20; growth > budget {
		t.Errorf("data dirs grew %d MB for %d small admissions (budget %d MB)", growth>>20, decided, budget>>20)
	}
	held, denied := waiters.get("held_until_the_end"), waiters.get("too_many_waiters")
	if held > floodWaiterCap || denied < floodWaiters-floodWaiterCap-2 || waiters.get("denied_within_5s") < denied*9/10 {
		t.Errorf("waiters: %s; want at most %d held and the rest denied at once", &waiters, floodWaiterCap)
	}
	// No election.
	if len(leaders) != 1 || leaders[0] != leaderID {
		t.Errorf("leadership changed during the flood: leaders seen %v, was %s", leaders, leaderID)
	}
	for i, n := range c.Nodes {
		m, err := nodeMetrics(ctx, c, i, "quotad_leader_changes_total")
		if err != nil {
			t.Fatal(err)
		}
		if m["quotad_leader_changes_total"] != changesBefore[i] {
			t.Errorf("%s observed %v leadership changes during the flood", n.ID, m["quotad_leader_changes_total"]-changesBefore[i])
		}
	}
	// Honest callers served throughout.
	for _, d := range []string{"other", "flood"} {
		if got := honest.get(d + "_admitted"); got == 0 {
			t.Errorf("honest caller on %s admitted nothing: %s", d, &honest)
		}
	}
	if bad := honest.String(); strings.Contains(bad, "err_") || strings.Contains(bad, "limited") || strings.Contains(bad, "too_many") {
		t.Errorf("honest callers were refused or failed: %s", bad)
	}
	for which, name := range []string{"other (50/s)", "flood/steady (20/s)"} {
		want := []int64{50, 20}[which]
		for s := 1; s < int(dur/time.Second)-1; s++ { // whole seconds inside the run
			if n := perSecond[which][s].Load(); n < want/2 {
				t.Errorf("honest caller %s: %d admissions in second %d of the flood, want about %d", name, n, s, want)
			}
		}
	}
	if hits, _ := c.ScanLogs("panic"); len(hits) > 0 {
		t.Errorf("panics in the agents' logs:\n%s", strings.Join(hits, "\n"))
	}
}

func maxInto(a *atomic.Int64, v int64) {
	for {
		old := a.Load()
		if v <= old || a.CompareAndSwap(old, v) {
			return
		}
	}
}

// sendHuge sends, 20 times a second until ctx ends, a 900 KB work_class, a 900 KB feedback
// reason and a 2 MB descriptor value (above --max-request-bytes), tallying the outcomes.
func sendHuge(ctx context.Context, conns []quotadv1.QuotaClient, out *counts, sent *atomic.Int64) {
	big := strings.Repeat("w", 900<<10)
	tooBig := strings.Repeat("v", 2<<20)
	for id := uint64(1); ctx.Err() == nil; id += 2 {
		q := conns[int(id/2)%len(conns)]
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		resp, err := q.Acquire(cctx, &quotadv1.AcquireRequest{ClientId: "flood-huge", Admissions: []*quotadv1.Admission{
			{RequestId: id, Domain: "flood", WorkClass: big, Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "steady"}}}}})
		if err != nil {
			if ctx.Err() != nil {
				cancel()
				return
			}
			out.add("work_class_"+errKey(err), 1)
		} else {
			out.add("work_class_"+resp.Decisions[0].Reason, 1)
		}
		_, err = q.Feedback(cctx, &quotadv1.FeedbackRequest{Domain: "flood", StatusCode: 429, RetryAfterMs: 60000, Reason: big})
		out.add("feedback_"+errKey(err), 1)
		_, err = q.Acquire(cctx, &quotadv1.AcquireRequest{ClientId: "flood-huge", Admissions: []*quotadv1.Admission{
			{RequestId: id + 1, Domain: "flood", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tooBig}}}}})
		out.add("2MB_"+errKey(err), 1)
		cancel()
		sent.Add(int64(2*len(big) + len(tooBig)))
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// latencies collects durations for percentiles.
type latencies struct {
	mu sync.Mutex
	d  []time.Duration
}

func (l *latencies) add(d time.Duration) {
	l.mu.Lock()
	l.d = append(l.d, d)
	l.mu.Unlock()
}

func (l *latencies) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.d) == 0 {
		return "none"
	}
	slices.Sort(l.d)
	q := func(p float64) time.Duration {
		return l.d[min(len(l.d)-1, int(p*float64(len(l.d))))].Round(time.Millisecond)
	}
	return fmt.Sprintf("p50 %v p99 %v max %v (%d calls)", q(0.5), q(0.99), l.d[len(l.d)-1].Round(time.Millisecond), len(l.d))
}

// honestCall is one honest admission: tallied by outcome, and by the second of the run it was
// sent in when admitted.
func honestCall(ctx context.Context, q quotadv1.QuotaClient, domain, tenant string, id uint64, start time.Time,
	out *counts, perSecond []atomic.Int64, lat *latencies) {
	sent := time.Now()
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	resp, err := q.Acquire(cctx, &quotadv1.AcquireRequest{ClientId: "honest-" + domain, Admissions: []*quotadv1.Admission{
		{RequestId: id, Domain: domain, Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tenant}}}}})
	lat.add(time.Since(sent))
	switch {
	case err != nil:
		out.add(domain+"_"+errKey(err), 1)
	case resp.Decisions[0].Admitted:
		out.add(domain+"_admitted", 1)
		if s := int(sent.Sub(start) / time.Second); s < len(perSecond) {
			perSecond[s].Add(1)
		}
	default:
		out.add(domain+"_"+resp.Decisions[0].Reason, 1)
	}
}
