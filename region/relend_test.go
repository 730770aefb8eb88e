package region_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/region"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// "rl" is global (100/s, burst 100: the fault test's R and B, so boundExcess applies); its
// route=a is a regional level that lends too, so a downstream Limiter's path has both.
const relendLimits = `
domain: rl
rate_limit: {unit: second, requests_per_unit: 100, burst: 100, scope: global}
shares: {lease: 3s}
descriptors:
  - key: route
    value: a
    rate_limit: {unit: second, requests_per_unit: 1000}
    shares: {lease: 3s}
`

type relendSample struct {
	at              time.Time
	local           bool
	expiry, upEnd   time.Time // the Limiter's grant end, the leader's upstream end (read after)
	status, message string
}

// TestRegionsRelend: a client.Limiter on each of two regional clusters (region A of 3 nodes,
// B of 1) spends the global level locally from a slice of its regional leader's upstream
// share, with 50–150 ms on the links to the global cluster, beside Acquire callers on the
// same path in both regions; then A's leader is killed. Checked:
//   - the Limiters decide locally (status lent) and fast (no global hop: p99 < 45 ms);
//   - every 1, 2, 5 s window and the whole run admit across both regions' Limiters and
//     Acquire callers at most B + R·w(1+ρ) (make test-regions-bugs: region_bug_doubleslice
//     must fail here);
//   - A's Limiter's grant never ends after its leader's upstream grant in hand (sampled
//     every 10 ms), so none outlives the old upstream end after the kill;
//   - after the kill A's Limiter is lent a slice again by the new leader.
func TestRegionsRelend(t *testing.T) {
	global := rpctest.Start(t, 1, relendLimits)
	wan := &atomic.Bool{}
	wan.Store(true)
	g := client.Config{Addrs: global.Addrs(), Insecure: true, DialOptions: []grpc.DialOption{wanDialer(wan)}}
	ra := rpctest.Start(t, 3, relendLimits, func(_ int, c *rpc.AgentConfig) { c.Region = region.Agent("ra", g) })
	rb := rpctest.Start(t, 1, relendLimits, func(_ int, c *rpc.AgentConfig) { c.Region = region.Agent("rb", g) })
	regions := []*rpctest.Cluster{ra, rb}
	newClient := func(rc *rpctest.Cluster) *client.Client {
		c, err := client.New(client.Config{Addrs: rc.Addrs(), Insecure: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	req := client.Request{Domain: "rl", Descriptors: []client.Entry{{Key: "route", Value: "a"}}, Cost: 1}
	var lims []*client.Limiter
	var acq []*client.Client
	for _, rc := range regions {
		lim := newClient(rc).Limiter(req, client.LimiterOptions{})
		t.Cleanup(func() { lim.Close() })
		lims, acq = append(lims, lim), append(acq, newClient(rc))
	}
	// rpctest.Cluster's agents are not guarded: the samplers read them under this, Kill
	// writes under it.
	var agentsMu sync.RWMutex
	holder := func(rc *rpctest.Cluster) *region.Holder {
		agentsMu.RLock()
		defer agentsMu.RUnlock()
		l := rc.Leader()
		if l < 0 || rc.Agent(l) == nil {
			return nil
		}
		h, _ := rc.Agent(l).Region().(*region.Holder)
		return h
	}
	upEnd := func(rc *rpctest.Cluster) time.Time {
		if h := holder(rc); h != nil {
			for _, s := range h.Shares() {
				if s.Path == "rl" {
					return s.Expiry
				}
			}
		}
		return time.Time{}
	}

	var (
		mu       sync.Mutex
		admitted []time.Time
		limLocal [2]int
		acqN     [2]int
		limLat   []time.Duration
		samples  [2][]relendSample
	)
	record := func(at time.Time) {
		mu.Lock()
		admitted = append(admitted, at)
		mu.Unlock()
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	start := time.Now()
	for i := range regions {
		for range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for ctx.Err() == nil {
					if _, err := acq[i].Allow(ctx, req); err == nil {
						record(time.Now())
						mu.Lock()
						acqN[i]++
						mu.Unlock()
					}
				}
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				t0 := time.Now()
				ok := lims[i].Allow()
				el := time.Since(t0)
				if ok {
					record(time.Now())
				}
				info := lims[i].Share()
				mu.Lock()
				if info.Local {
					limLat = append(limLat, el)
					if ok {
						limLocal[i]++
					}
				}
				mu.Unlock()
				time.Sleep(500 * time.Microsecond)
			}
		}()
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				info := lims[i].Share()
				s := relendSample{at: time.Now(), local: info.Local, expiry: info.Expiry, status: info.Status, message: info.Message}
				s.upEnd = upEnd(regions[i])
				mu.Lock()
				samples[i] = append(samples[i], s)
				mu.Unlock()
				time.Sleep(10 * time.Millisecond)
			}
		}()
	}
	// Both Limiters are lent a slice.
	clustertest.Eventually(t, 15*time.Second, func() error {
		for i, l := range lims {
			if info := l.Share(); !info.Local {
				return fmt.Errorf("region %d's Limiter: %+v", i, info)
			}
		}
		return nil
	})
	time.Sleep(5 * time.Second)
	lent := holder(ra).Lent()["rl"]
	oldLeader := ra.Leader()
	oldEnd := upEnd(ra)
	killed := time.Now()
	agentsMu.Lock()
	ra.Kill(oldLeader)
	agentsMu.Unlock()
	t.Logf("killed region A's leader %d at %v (its upstream grant ends %v later; lent downstream %.1f/s, burst %.1f)",
		oldLeader, killed.Sub(start).Round(time.Millisecond), oldEnd.Sub(killed).Round(time.Millisecond), lent[0], lent[1])
	ra.WaitLeader(10 * time.Second)
	var relentAt time.Time
	clustertest.Eventually(t, 4*lease, func() error {
		if info := lims[0].Share(); !info.Local || !info.Expiry.After(oldEnd) {
			return fmt.Errorf("region A's Limiter has no slice from the new leader: %+v", info)
		}
		relentAt = time.Now()
		return nil
	})
	time.Sleep(2 * time.Second)
	cancel()
	wg.Wait()
	el := time.Since(start)

	mu.Lock()
	defer mu.Unlock()
	worst, where := boundExcess(admitted, []time.Duration{time.Second, 2 * time.Second, 5 * time.Second, el + time.Second})
	slices.Sort(limLat)
	p99 := time.Duration(0)
	if len(limLat) > 0 {
		p99 = limLat[len(limLat)*99/100]
	}
	t.Logf("admitted %d in %v (Limiters locally: A %d, B %d; Acquire: A %d, B %d; local decisions p99 %v); worst window %.1f units over the bound (%s); A re-lent %v after the kill",
		len(admitted), el.Round(time.Millisecond), limLocal[0], limLocal[1], acqN[0], acqN[1], p99, worst, where, relentAt.Sub(killed).Round(time.Millisecond))
	if worst > 0 {
		t.Errorf("the global bound is broken across the regions' Limiters and Acquire callers: %s, %.1f units over B + R·w(1+ρ)", where, worst)
	}
	if limLocal[0] < 50 || limLocal[1] < 50 {
		t.Errorf("the Limiters admitted %d and %d units locally: want ≥ 50 each (a slice of the regional leader's share)", limLocal[0], limLocal[1])
	}
	if p99 >= 45*time.Millisecond {
		t.Errorf("p99 of the Limiters' local decisions %v with 50–150 ms on the global links: a global hop is on the request path", p99)
	}
	if float64(len(admitted)) < 0.6*100*el.Seconds() {
		t.Errorf("admitted %d, under 60%% of R·T", len(admitted))
	}
	// No slice ends after the upstream grant in hand of the leader that lent it: before the
	// kill, the old leader's; after it, a slice ending by the old upstream end is the old
	// leader's last, any other must end by the new leader's upstream end.
	const tol = 10 * time.Millisecond
	checked := 0
	for i := range samples {
		for _, s := range samples[i] {
			if !s.local {
				continue
			}
			if i == 0 && s.at.After(killed) && !s.expiry.After(oldEnd.Add(tol)) {
				checked++
				continue
			}
			if s.upEnd.IsZero() || s.expiry.After(s.upEnd.Add(tol)) {
				t.Errorf("region %d: the Limiter's slice ends %v after its leader's upstream grant in hand (sampled %v after the start; upstream end zero: %v)",
					i, s.expiry.Sub(s.upEnd).Round(time.Millisecond), s.at.Sub(start).Round(time.Millisecond), s.upEnd.IsZero())
				break
			}
			checked++
		}
	}
	if checked < 100 {
		t.Errorf("only %d samples of a lent slice", checked)
	}
}

// TestRegionsReleaseEndsOnlyOlderSlices: through a regional leader's Share and ReleaseShare, a
// downstream holder is lent a slice, releases it (seq r), and renews (a newer seq) with a new
// slice; the release's handler running late — after the renewal's slice was lent, as the
// leader's concurrent handlers may — ends only the slices at or before seq r. Before, it ended
// the holder's newer slice too, and the leader re-lent capacity the holder was still spending.
func TestRegionsReleaseEndsOnlyOlderSlices(t *testing.T) {
	global := rpctest.Start(t, 1, relendLimits)
	g := client.Config{Addrs: global.Addrs(), Insecure: true}
	ra := rpctest.Start(t, 1, relendLimits, func(_ int, c *rpc.AgentConfig) { c.Region = region.Agent("ra", g) })
	c, err := client.New(client.Config{Addrs: ra.Addrs(), Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	conn, err := grpc.NewClient(ra.Addrs()[0], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	qc := quotadv1.NewQuotaClient(conn)
	req := client.Request{Domain: "rl", Descriptors: []client.Entry{{Key: "route", Value: "a"}}, Cost: 1}
	// Acquire callers give the regional leader demand, so its upstream share is worth lending.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() {
		for ctx.Err() == nil {
			c.Allow(ctx, req)
			time.Sleep(20 * time.Millisecond)
		}
	})
	holder := func() *region.Holder {
		h, _ := ra.Agent(ra.Leader()).Region().(*region.Holder)
		return h
	}
	const id = "h"
	name := region.HolderName("insecure", id, 1)
	seq := uint64(0)
	// lend sends share requests (a new seq each) until the holder is lent a slice of rl.
	lend := func() uint64 {
		t.Helper()
		clustertest.Eventually(t, 15*time.Second, func() error {
			seq++
			resp, err := qc.Share(ctx, &quotadv1.ShareRequest{HolderId: id, Incarnation: 1, Seq: seq, AckSeq: seq - 1,
				Paths: []*quotadv1.SharePath{{Domain: "rl", Descriptors: []*quotadv1.Entry{{Key: "route", Value: "a"}}, Demand: 20e6, MaxCost: 1}}})
			if err != nil {
				return err
			}
			h := holder()
			if h == nil {
				return fmt.Errorf("no regional holder")
			}
			if lent := h.Lent()["rl"]; lent[0] == 0 {
				return fmt.Errorf("seq %d: nothing lent (%s: %s)", seq, resp.Paths[0].Status, resp.Paths[0].Message)
			}
			return nil
		})
		return seq
	}
	lend()
	seq++
	rel := seq
	if _, err := qc.ReleaseShare(ctx, &quotadv1.ReleaseShareRequest{HolderId: id, Incarnation: 1, Seq: rel}); err != nil {
		t.Fatal(err)
	}
	if lent := holder().Lent()["rl"]; lent[0] != 0 || lent[1] != 0 {
		t.Fatalf("after the release: %.1f/s burst %.1f still lent", lent[0], lent[1])
	}
	renewed := lend()
	before := holder().Lent()["rl"]
	// The release's handler, late: it must not end the renewal's slice.
	holder().EndRelends(name, rel)
	if after := holder().Lent()["rl"]; after != before {
		t.Fatalf("a late release of seq %d changed the slices lent for seq %d from %.1f/s burst %.1f to %.1f/s burst %.1f: the renewal's slice ended while the holder spends it",
			rel, renewed, before[0], before[1], after[0], after[1])
	}
	holder().EndRelends(name, renewed+1)
	if after := holder().Lent()["rl"]; after[0] != 0 {
		t.Fatalf("a release of seq %d left %.1f/s lent", renewed+1, after[0])
	}
}
