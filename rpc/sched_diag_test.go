package rpc_test

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// scrape returns the sums of the named series (all label sets) on the agent's /metrics.
func scrape(t testing.TB, addr string, names ...string) map[string]float64 {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		for _, n := range names {
			if strings.HasPrefix(line, n+" ") || strings.HasPrefix(line, n+"{") {
				f := strings.Fields(line)
				v, _ := strconv.ParseFloat(f[len(f)-1], 64)
				out[n] += v
			}
		}
	}
	return out
}

// TestFairRateDiagnosis measures the scheduled path at several rates (QUOTAD_FAIR_DIAG=1):
// utilization, log entries per second and ops per entry while two tenants keep waiters queued.
func TestFairRateDiagnosis(t *testing.T) {
	if os.Getenv("QUOTAD_FAIR_DIAG") == "" {
		t.Skip("set QUOTAD_FAIR_DIAG=1 to measure")
	}
	cases := []struct{ rate, burst int }{{100, 1}, {1000, 1}, {1000, 8}, {1000, 32}}
	if r, err := strconv.Atoi(os.Getenv("QUOTAD_FAIR_DIAG")); err == nil && r > 1 {
		cases = []struct{ rate, burst int }{{r, 1}}
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("rate%d_burst%d", tc.rate, tc.burst), func(t *testing.T) {
			// Where each small tenant's admission spent its time on the leader.
			var tmu sync.Mutex
			var tracing bool
			traces := map[uint64]rpc.FairTrace{}
			rpc.SetFairTrace(func(tr rpc.FairTrace) {
				if len(tr.Adm.Descriptors) == 0 || !strings.HasPrefix(tr.Adm.Descriptors[0].Value, "s") {
					return
				}
				tmu.Lock()
				if tracing {
					traces[tr.Adm.RequestId] = tr
				}
				tmu.Unlock()
			})
			t.Cleanup(func() { rpc.SetFairTrace(nil) }) // after the cluster's cleanup (LIFO)
			c := rpctest.Start(t, 3, fmt.Sprintf(`
domain: fair
rate_limit: {unit: second, requests_per_unit: %d, burst: %d}
descriptors:
  - key: tenant
`, tc.rate, tc.burst))
			leader := c.Leader()
			q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			var id atomic.Uint64
			var admitted, refused atomic.Int64
			for k, tenant := range []string{"A", "B"} {
				for range max(100, tc.rate/5) / (1 + k*2) {
					wg.Go(func() {
						for ctx.Err() == nil {
							d, err := acquireOne(ctx, q, tenant, waitingAdmission(id.Add(1), tenant, 20*time.Second))
							if err == nil && d.Admitted {
								admitted.Add(1)
							} else if ctx.Err() == nil {
								refused.Add(1)
							}
						}
					})
				}
			}
			clustertest.Eventually(t, 10*time.Second, func() error {
				if n := c.Agent(leader).FairView().Waiting; n < 100 {
					return fmt.Errorf("%d waiting", n)
				}
				return nil
			})
			names := []string{"quotad_raft_commit_seconds_sum", "quotad_raft_commit_seconds_count", "quotad_entry_ops_sum", "quotad_entry_ops_count"}
			m0 := scrape(t, c.Agent(leader).HTTPAddr(), names...)
			var smallMu sync.Mutex
			var smallWaits []time.Duration
			smallBy := map[uint64]time.Duration{}
			for i := range 6 {
				wg.Go(func() {
					for ctx.Err() == nil {
						time.Sleep(time.Duration(50+rand.IntN(100)) * time.Second / time.Duration(tc.rate))
						start := time.Now()
						rid := id.Add(1)
						d, err := acquireOne(ctx, q, "small", waitingAdmission(rid, fmt.Sprint("s", i), 20*time.Second))
						if err == nil && d.Admitted {
							smallMu.Lock()
							smallWaits = append(smallWaits, time.Since(start))
							smallBy[rid] = time.Since(start)
							smallMu.Unlock()
						}
					}
				})
			}
			tmu.Lock()
			tracing = true
			tmu.Unlock()
			a0, t0 := admitted.Load(), time.Now()
			var minWaiting, samples int
			var horizon float64
			measure := 3 * time.Second
			if secs, err := strconv.Atoi(os.Getenv("QUOTAD_FAIR_DIAG_SECS")); err == nil && secs > 0 {
				measure = time.Duration(secs) * time.Second
			}
			for time.Since(t0) < measure {
				time.Sleep(50 * time.Millisecond)
				v := c.Agent(leader).FairView()
				if samples == 0 || v.Waiting < minWaiting {
					minWaiting = v.Waiting
				}
				horizon += v.ReleaseHorizonMs
				samples++
			}
			t.Logf("waiting at least %d; release horizon mean %.1f ms; %d refused or failed", minWaiting, horizon/float64(samples), refused.Load())
			a1, el := admitted.Load(), time.Since(t0)
			m1 := scrape(t, c.Agent(leader).HTTPAddr(), names...)
			tmu.Lock()
			tracing = false
			tmu.Unlock()
			cancel()
			wg.Wait()
			logPhases(t, traces, smallBy)
			slices.Sort(smallWaits)
			if n := len(smallWaits); n > 0 {
				t.Logf("small waits: n %d p50 %v p90 %v p99 %v max %v", n, smallWaits[n/2], smallWaits[n*9/10], smallWaits[n*99/100], smallWaits[n-1])
			}
			entries := m1[names[1]] - m0[names[1]]
			t.Logf("rate %d burst %d: admitted %.0f/s utilization %.3f; entries %.0f/s, ops/entry %.2f, commit mean %.2f ms",
				tc.rate, tc.burst, float64(a1-a0)/el.Seconds(), float64(a1-a0)/el.Seconds()/float64(tc.rate),
				entries/el.Seconds(), (m1[names[2]]-m0[names[2]])/entries, 1000*(m1[names[0]]-m0[names[0]])/entries)
		})
	}
}

// logPhases logs the quantiles of each phase of the traced admissions (small tenants) and of
// the rest of the client's wait (its RPC: client → leader → client).
func logPhases(t *testing.T, traces map[uint64]rpc.FairTrace, client map[uint64]time.Duration) {
	phases := []struct {
		name string
		of   func(rpc.FairTrace) time.Duration
	}{
		{"arrival → release", func(tr rpc.FairTrace) time.Duration { return tr.Released.Sub(tr.Arrived) }},
		{"release → entry stamped", func(tr rpc.FairTrace) time.Duration { return tr.Stamp.Sub(tr.Released) }},
		{"stamped → applied (seen by the waiter)", func(tr rpc.FairTrace) time.Duration { return tr.Applied.Sub(tr.Stamp) }},
		{"grant's moment after the stamp", func(tr rpc.FairTrace) time.Duration { return tr.Moment.Sub(tr.Stamp) }},
		{"predicted moment after release", func(tr rpc.FairTrace) time.Duration { return tr.Predicted.Sub(tr.Released) }},
		{"moment − predicted", func(tr rpc.FairTrace) time.Duration { return tr.Moment.Sub(tr.Predicted) }},
		{"hold (applied → answered)", func(tr rpc.FairTrace) time.Duration { return tr.Answered.Sub(tr.Applied) }},
		{"on the leader (arrival → answered)", func(tr rpc.FairTrace) time.Duration { return tr.Answered.Sub(tr.Arrived) }},
	}
	var n, self, direct, newcomer int
	var rest []time.Duration
	for rid, tr := range traces {
		cw, ok := client[rid]
		if !ok {
			continue
		}
		n++
		if tr.SelfPass {
			self++
		}
		if tr.Direct {
			direct++
		}
		if tr.Newcomer {
			newcomer++
		}
		rest = append(rest, cw-tr.Answered.Sub(tr.Arrived))
	}
	t.Logf("traced small admissions %d: newcomers %d, released by their own pass %d, straight to the FSM %d", n, newcomer, self, direct)
	q := func(ds []time.Duration) string {
		slices.Sort(ds)
		if len(ds) == 0 {
			return "-"
		}
		at := func(p float64) float64 { return float64(ds[min(len(ds)-1, int(p*float64(len(ds))))]) / 1e6 }
		return fmt.Sprintf("p50 %.1f p90 %.1f p99 %.1f max %.1f ms", at(0.5), at(0.9), at(0.99), at(1))
	}
	for _, p := range phases {
		var ds []time.Duration
		for rid, tr := range traces {
			if _, ok := client[rid]; ok && !tr.Direct {
				ds = append(ds, p.of(tr))
			}
		}
		t.Logf("  %-40s %s", p.name, q(ds))
	}
	t.Logf("  %-40s %s", "client's wait − leader's (RPCs)", q(rest))
}
