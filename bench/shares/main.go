// Command shares is `make bench-shares` (issue 12): it builds quotad, starts a real 3-node
// cluster of separate agent processes, and measures the client's Limiter, which decides
// locally from shares of the buckets:
//
//   - local: one process, 64 goroutines, 1000 keys, all allowed: local decisions per second,
//     the p99 of one decision, and the Raft entries per second meanwhile;
//   - bound: 4 holder processes (this binary, -role holder) and 1 central caller on one
//     bucket (rate R, burst B), demand 3R, 60 s, one holder killed (SIGKILL) and the leader
//     killed once: admitted ≤ B + R·T(1+ρ) over every window, and the utilization;
//   - rebalance: demand moves from holder A to holder B; how long until B holds 90 % of its
//     max-min share;
//   - reclaim: a holder process is killed; how long until another holder is lent its rate.
//
// It writes bench/results/shares.json. Run it from the module root: go run ./bench/shares.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/proccluster"
)

const (
	boundRate  = 1000 // R, units per second
	boundBurst = 1000 // B
	rho        = 1e-3
	localKeys  = 1000
)

var limits = fmt.Sprintf(`domain: local
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1000000, burst: 1000000}
    shares: {}
---
domain: bound
rate_limit: {unit: second, requests_per_unit: %d, burst: %d}
shares: {}
---
domain: rebalance
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
shares: {}
---
domain: reclaim
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
shares: {}
`, boundRate, boundBurst)

// Report is bench/results/shares.json.
type Report struct {
	LocalDecisionsPerSec float64 `json:"local_decisions_per_sec"`
	LocalAllowedFraction float64 `json:"local_allowed_fraction"`
	RaftEntriesPerSec    float64 `json:"raft_entries_per_sec"`
	RaftEntriesLimit     float64 `json:"raft_entries_per_sec_limit"`
	LocalP99Us           float64 `json:"local_p99_us"`
	LocalP50Us           float64 `json:"local_p50_us"`
	LocalGoroutines      int     `json:"local_goroutines"`
	LocalKeys            int     `json:"local_keys"`

	BoundOK          bool     `json:"bound_ok"`
	BoundWorstExcess float64  `json:"bound_worst_excess_units"`
	BoundAdmitted    uint64   `json:"bound_admitted"`
	BoundLimit       float64  `json:"bound_limit_whole_run"`
	Utilization      float64  `json:"utilization"`
	BoundSeconds     float64  `json:"bound_seconds"`
	BoundHolders     []uint64 `json:"bound_admitted_per_holder"`
	BoundCentral     uint64   `json:"bound_admitted_central"`

	RebalanceS float64 `json:"rebalance_s"`
	ReclaimS   float64 `json:"reclaim_s"`
	LeaseS     float64 `json:"lease_s"`

	Load string `json:"load"`
	Note string `json:"note,omitempty"`
}

var (
	role     = flag.String("role", "", "internal: holder")
	hDomain  = flag.String("domain", "", "holder: domain")
	hRate    = flag.Float64("rate", 0, "holder: attempts per second")
	hSeconds = flag.Float64("seconds", 0, "holder: how long")
)

func main() {
	out := flag.String("out", "bench/results/shares.json", "JSON report path")
	only := flag.String("only", "", "one scenario: local, bound, rebalance, reclaim")
	boundSecs := flag.Float64("bound-seconds", 60, "length of the bound scenario")
	flag.Parse()
	if *role == "holder" {
		runHolder()
		return
	}
	dir, err := os.MkdirTemp("", "quotad-bench-shares-")
	check(err)
	defer os.RemoveAll(dir)
	logf("building quotad in %s", dir)
	bin, err := proccluster.Build(".", dir)
	check(err)
	lf := filepath.Join(dir, "limits.yaml")
	check(os.WriteFile(lf, []byte(limits), 0o644))
	c, err := proccluster.Start(proccluster.Config{Binary: bin, Dir: dir, Nodes: 3, LimitsFile: lf})
	check(err)
	defer c.KillAll()
	_, err = c.WaitLeader(30 * time.Second)
	check(err)

	rep := Report{LeaseS: 15, LocalGoroutines: 64, LocalKeys: localKeys}
	want := func(s string) bool { return *only == "" || *only == s }
	if want("local") {
		local(c, &rep)
	}
	if want("rebalance") {
		rebalance(c, &rep)
	}
	if want("reclaim") {
		reclaim(c, &rep)
	}
	if want("bound") {
		bound(c, &rep, time.Duration(*boundSecs*float64(time.Second)))
	}
	rep.Load = loadavg()
	js, _ := json.MarshalIndent(rep, "", "  ")
	fmt.Println(string(js))
	check(os.MkdirAll(filepath.Dir(*out), 0o755))
	check(os.WriteFile(*out, append(js, '\n'), 0o644))
}

func newClient(c *proccluster.Cluster) *client.Client {
	cl, err := client.New(c.ClientConfig())
	check(err)
	return cl
}

// appliedIndex reads the leader's applied index (linearizable Status).
func appliedIndex(cl *client.Client, domain string) uint64 {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := cl.Status(ctx, domain)
	check(err)
	return st.AppliedIndex
}

// local: 64 goroutines, 1000 keys, one process, all allowed.
func local(c *proccluster.Cluster, rep *Report) {
	cl := newClient(c)
	defer cl.Close()
	lims := make([]*client.Limiter, localKeys)
	for i := range lims {
		lims[i] = cl.Limiter(client.Request{Domain: "local", Descriptors: client.Descriptors("k", strconv.Itoa(i))}, client.LimiterOptions{})
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		n := 0
		for _, l := range lims {
			if l.Share().Local {
				n++
			}
		}
		if n == len(lims) {
			break
		}
		if time.Now().After(deadline) {
			logf("local: only %d of %d keys lent after 30s", n, len(lims))
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	const dur = 10 * time.Second
	logf("local: %d keys lent; 64 goroutines for %v", len(lims), dur)
	before := appliedIndex(cl, "local")
	var stop atomic.Bool
	var total, allowed atomic.Uint64
	hists := make([][]uint32, 64) // sampled latencies, ns
	var wg sync.WaitGroup
	start := time.Now()
	for g := range 64 {
		wg.Go(func() {
			var n, ok uint64
			k := uint64(g) * 7919
			hist := make([]uint32, 0, 1<<16)
			for !stop.Load() {
				for range 256 {
					k++
					if lims[k%localKeys].Allow() {
						ok++
					}
				}
				n += 256
				// One timed call in 257.
				t0 := time.Now()
				if lims[(k*31)%localKeys].Allow() {
					ok++
				}
				hist = append(hist, uint32(min(time.Since(t0), time.Second)))
				n++
			}
			total.Add(n)
			allowed.Add(ok)
			hists[g] = hist
		})
	}
	time.Sleep(dur)
	stop.Store(true)
	wg.Wait()
	el := time.Since(start).Seconds()
	after := appliedIndex(cl, "local")
	var all []uint32
	for _, h := range hists {
		all = append(all, h...)
	}
	slices.Sort(all)
	q := func(p float64) float64 {
		if len(all) == 0 {
			return 0
		}
		return float64(all[int(p*float64(len(all)-1))]) / 1e3
	}
	rep.LocalDecisionsPerSec = float64(total.Load()) / el
	rep.LocalAllowedFraction = float64(allowed.Load()) / float64(total.Load())
	rep.LocalP99Us, rep.LocalP50Us = q(0.99), q(0.5)
	rep.RaftEntriesPerSec = float64(after-before) / el
	rep.RaftEntriesLimit = 2 * 1 * localKeys / 5.0
	logf("local: %.2fM decisions/s (%.4f allowed), p50 %.3fµs p99 %.3fµs, %.1f raft entries/s (limit %.0f)",
		rep.LocalDecisionsPerSec/1e6, rep.LocalAllowedFraction, rep.LocalP50Us, rep.LocalP99Us, rep.RaftEntriesPerSec, rep.RaftEntriesLimit)
	for _, l := range lims {
		l.Close()
	}
}

// admission is one reported batch: count units admitted at wall time at (ns).
type admission struct {
	at    int64
	count uint64
	who   int
}

// holderProc is a holder process reporting its admissions on stdout.
type holderProc struct {
	cmd  *exec.Cmd
	done chan struct{}
	mu   sync.Mutex
	adm  []admission
}

func startHolder(c *proccluster.Cluster, who int, domain string, rate, seconds float64) *holderProc {
	cmd := exec.Command(os.Args[0], "-role", "holder", "-domain", domain, "-rate", fmt.Sprint(rate), "-seconds", fmt.Sprint(seconds))
	cmd.Env = append(os.Environ(), client.EnvAddr+"="+strings.Join(c.GRPCAddrs(), ","))
	cmd.Env = append(cmd.Env, c.ClientEnv()...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	check(err)
	check(cmd.Start())
	h := &holderProc{cmd: cmd, done: make(chan struct{})}
	go func() {
		defer close(h.done)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			if len(f) != 2 {
				continue
			}
			at, _ := strconv.ParseInt(f[0], 10, 64)
			n, _ := strconv.ParseUint(f[1], 10, 64)
			h.mu.Lock()
			h.adm = append(h.adm, admission{at, n, who})
			h.mu.Unlock()
		}
		cmd.Wait()
	}()
	return h
}

func (h *holderProc) kill() {
	h.cmd.Process.Signal(syscall.SIGKILL)
	<-h.done
}

// runHolder is a holder process: it attempts -rate units per second on -domain for -seconds
// through a Limiter and writes "unix_ns count" for every 10 ms with admissions — written
// before the units count as used, so a kill loses no admission that was used.
func runHolder() {
	cfg := client.DefaultConfig()
	cfg.LoadEnv()
	cl, err := client.New(cfg)
	check(err)
	lim := cl.Limiter(client.Request{Domain: *hDomain}, client.LimiterOptions{Demand: *hRate})
	w := bufio.NewWriterSize(os.Stdout, 4096)
	end := time.Now().Add(time.Duration(*hSeconds * float64(time.Second)))
	const tick = 10 * time.Millisecond
	per := *hRate * tick.Seconds()
	var owed float64
	for now := time.Now(); now.Before(end); now = time.Now() {
		owed += per
		var n uint64
		for ; owed >= 1; owed-- {
			if lim.Allow() {
				n++
			}
		}
		if n > 0 {
			fmt.Fprintf(w, "%d %d\n", time.Now().UnixNano(), n)
			w.Flush()
		}
		time.Sleep(time.Until(now.Add(tick)))
	}
	lim.Close()
	cl.Close()
}

// bound: 4 holder processes + 1 central caller on one bucket, demand 3R, one holder killed at
// T/3, the leader killed at 2T/3 (restarted 5 s later).
func bound(c *proccluster.Cluster, rep *Report, T time.Duration) {
	logf("bound: 4 holder processes + 1 central caller, demand 3×%d/s, %v", boundRate, T)
	per := 3.0 * boundRate / 5
	start := time.Now()
	var hs []*holderProc
	for i := range 4 {
		hs = append(hs, startHolder(c, i, "bound", per, T.Seconds()))
	}
	cl := newClient(c)
	defer cl.Close()
	var cmu sync.Mutex
	var central []admission
	var stop atomic.Bool
	var wg sync.WaitGroup
	// The central caller: per units a second in 10 ms steps, each an Allow of its own.
	wg.Go(func() {
		var owed float64
		const tick = 10 * time.Millisecond
		var inner sync.WaitGroup
		for now := time.Now(); !stop.Load(); now = time.Now() {
			owed += per * tick.Seconds()
			for ; owed >= 1; owed-- {
				inner.Go(func() {
					ctx, cancel := context.WithTimeout(context.Background(), time.Second)
					defer cancel()
					if _, err := cl.Allow(ctx, client.Request{Domain: "bound"}); err == nil {
						at := time.Now().UnixNano()
						cmu.Lock()
						central = append(central, admission{at, 1, -1})
						cmu.Unlock()
					}
				})
			}
			time.Sleep(time.Until(now.Add(tick)))
		}
		inner.Wait()
	})
	time.Sleep(T / 3)
	logf("bound: killing holder 0 (SIGKILL)")
	hs[0].kill()
	time.Sleep(T / 3)
	leader, err := c.WaitLeader(10 * time.Second)
	check(err)
	logf("bound: killing the leader (node%d)", leader)
	c.Kill(leader)
	time.Sleep(5 * time.Second)
	check(c.Start(leader))
	time.Sleep(time.Until(start.Add(T)))
	stop.Store(true)
	wg.Wait()
	for _, h := range hs[1:] {
		<-h.done
	}
	el := time.Since(start)
	var all []admission
	rep.BoundHolders = make([]uint64, len(hs))
	for i, h := range hs {
		h.mu.Lock()
		for _, a := range h.adm {
			rep.BoundHolders[i] += a.count
		}
		all = append(all, h.adm...)
		h.mu.Unlock()
	}
	for _, a := range central {
		rep.BoundCentral += a.count
	}
	all = append(all, central...)
	sort.Slice(all, func(i, j int) bool { return all[i].at < all[j].at })
	var total uint64
	for _, a := range all {
		total += a.count
	}
	worst := worstExcess(all, boundRate, boundBurst, rho)
	span := el.Seconds()
	if len(all) > 1 {
		span = float64(all[len(all)-1].at-all[0].at) / 1e9
	}
	rep.BoundAdmitted = total
	rep.BoundLimit = boundBurst + boundRate*span*(1+rho)
	rep.BoundWorstExcess = worst
	rep.BoundOK = worst <= 0
	rep.BoundSeconds = span
	rep.Utilization = (float64(total) - boundBurst) / (boundRate * span)
	logf("bound: admitted %d (holders %v, central %d) over %.1fs, limit %.0f, worst window excess %.1f, utilization %.3f",
		total, rep.BoundHolders, rep.BoundCentral, span, rep.BoundLimit, worst, rep.Utilization)
}

// worstExcess returns max over windows [a_i, a_j] of Σcount − burst − rate·(1+ρ)·(t_j − t_i).
func worstExcess(adm []admission, rate, burst, rho float64) float64 {
	r := rate * (1 + rho) / 1e9
	worst, minStart := math.Inf(-1), math.Inf(1)
	var prefix float64
	for _, a := range adm {
		minStart = min(minStart, prefix-r*float64(a.at))
		prefix += float64(a.count)
		worst = max(worst, prefix-r*float64(a.at)-minStart-burst)
	}
	return worst
}

// attempt drives a Limiter at rate attempts per second until stop.
func attempt(l *client.Limiter, rate *atomic.Int64, stop *atomic.Bool) {
	const tick = 10 * time.Millisecond
	var owed float64
	for now := time.Now(); !stop.Load(); now = time.Now() {
		owed += float64(rate.Load()) * tick.Seconds()
		for ; owed >= 1; owed-- {
			l.Allow()
		}
		time.Sleep(time.Until(now.Add(tick)))
	}
}

// rebalance: A demands 1500/s and B 50/s; then they swap. B's max-min share afterwards is
// the lendable 900/s less A's demand (62.5/s): rebalance_s is how long B takes to hold 90 %
// of it.
func rebalance(c *proccluster.Cluster, rep *Report) {
	ca, cb := newClient(c), newClient(c)
	defer ca.Close()
	defer cb.Close()
	la := ca.Limiter(client.Request{Domain: "rebalance"}, client.LimiterOptions{})
	lb := cb.Limiter(client.Request{Domain: "rebalance"}, client.LimiterOptions{})
	var ra, rb atomic.Int64
	ra.Store(1500)
	rb.Store(50)
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Go(func() { attempt(la, &ra, &stop) })
	wg.Go(func() { attempt(lb, &rb, &stop) })
	logf("rebalance: A at 1500/s, B at 50/s for 25s")
	time.Sleep(25 * time.Second)
	logf("rebalance: before the swap A %.0f/s B %.0f/s", la.Share().Rate, lb.Share().Rate)
	ra.Store(50)
	rb.Store(1500)
	swap := time.Now()
	target := 0.9 * (900 - 50*1.25)
	rep.RebalanceS = -1
	for time.Since(swap) < 60*time.Second {
		if s := lb.Share(); s.Local && s.Rate >= target {
			rep.RebalanceS = time.Since(swap).Seconds()
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	logf("rebalance: B reached %.0f/s (target %.0f) after %.1fs; A %.0f/s", lb.Share().Rate, target, rep.RebalanceS, la.Share().Rate)
	stop.Store(true)
	wg.Wait()
	la.Close()
	lb.Close()
}

// reclaim: a holder process holding half the rate is killed; reclaim_s is how long until the
// other holder is lent 90 % of the whole lendable rate.
func reclaim(c *proccluster.Cluster, rep *Report) {
	a := startHolder(c, 0, "reclaim", 1500, 120)
	cb := newClient(c)
	defer cb.Close()
	lb := cb.Limiter(client.Request{Domain: "reclaim"}, client.LimiterOptions{})
	var rb atomic.Int64
	rb.Store(1500)
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Go(func() { attempt(lb, &rb, &stop) })
	logf("reclaim: two holders at 1500/s each for 20s")
	time.Sleep(20 * time.Second)
	logf("reclaim: B holds %.0f/s; killing holder A", lb.Share().Rate)
	a.kill()
	killed := time.Now()
	rep.ReclaimS = -1
	for time.Since(killed) < 60*time.Second {
		if s := lb.Share(); s.Local && s.Rate >= 0.9*900 {
			rep.ReclaimS = time.Since(killed).Seconds()
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	logf("reclaim: B holds %.0f/s %.1fs after the kill", lb.Share().Rate, rep.ReclaimS)
	stop.Store(true)
	wg.Wait()
	lb.Close()
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench-shares:", err)
		os.Exit(1)
	}
}
