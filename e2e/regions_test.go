package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/proccluster"
)

// Regions as processes (issue 13, make test-regions): a secure global cluster of 3 and two
// secure regional clusters (each its own CA), every node its own process. "api" is global
// with a fallback_rate, "strict" global without one (fail closed).
const regionsLimits = `
domain: api
rate_limit: {unit: second, requests_per_unit: 100, burst: 100, scope: global}
shares: {lease: 6s, reserve_percent: 1, fallback_rate: 20}
---
domain: strict
rate_limit: {unit: second, requests_per_unit: 100, burst: 100, scope: global}
shares: {lease: 6s}
`

const (
	regR     = 100.0
	regB     = 100.0
	regLease = 6 * time.Second
)

// regionLoad offers rate requests per second on domain to one region (each its own goroutine)
// and records admission times and denial messages.
type regionLoad struct {
	mu       sync.Mutex
	admitted []time.Time
	denied   map[string]int
}

func (l *regionLoad) run(ctx context.Context, c *client.Client, domain string, rate int) {
	l.denied = map[string]int{}
	for ctx.Err() == nil {
		time.Sleep(time.Second / time.Duration(rate))
		go func() {
			_, err := c.Allow(ctx, client.Request{Domain: domain, Cost: 1})
			l.mu.Lock()
			defer l.mu.Unlock()
			var de *client.DeniedError
			switch {
			case err == nil:
				l.admitted = append(l.admitted, time.Now())
			case errors.As(err, &de):
				l.denied[de.Decision.Message]++
			}
		}()
	}
}

func (l *regionLoad) between(from, to time.Time) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, t := range l.admitted {
		if !t.Before(from) && t.Before(to) {
			n++
		}
	}
	return n
}

func (l *regionLoad) times(from, to time.Time) []time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []time.Time
	for _, t := range l.admitted {
		if !t.Before(from) && t.Before(to) {
			out = append(out, t)
		}
	}
	return out
}

// worstExcess is the largest excess of admissions over B + R·w(1+ρ) in any window of length
// w ≤ maxW among ts (≤ 0: inside the bound everywhere).
func worstExcess(ts []time.Time, ws ...time.Duration) float64 {
	slices.SortFunc(ts, func(a, b time.Time) int { return a.Compare(b) })
	worst := -regB
	for _, w := range ws {
		j := 0
		for i := range ts {
			for ts[i].Sub(ts[j]) > w {
				j++
			}
			worst = max(worst, float64(i-j+1)-(regB+regR*w.Seconds()*(1+1e-3)))
		}
	}
	return worst
}

func TestRegionsProcesses(t *testing.T) {
	if os.Getenv("QUOTAD_REGIONS_E2E") == "" {
		t.Skip("QUOTAD_REGIONS_E2E=1 (make test-regions): a global cluster and two regional ones as processes, about 2 minutes")
	}
	dir := t.TempDir()
	lf := filepath.Join(dir, "limits.yaml")
	if err := os.WriteFile(lf, []byte(regionsLimits), 0o644); err != nil {
		t.Fatal(err)
	}
	start := func(name string, n int, extra ...string) *proccluster.Cluster {
		c, err := proccluster.Start(proccluster.Config{Binary: binary, Dir: filepath.Join(dir, name), Nodes: n, LimitsFile: lf, ExtraArgs: extra})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			c.KillAll()
			if t.Failed() {
				for _, nd := range c.Nodes {
					if b, err := os.ReadFile(nd.LogPath); err == nil {
						t.Logf("%s/%s log:\n%s", name, nd.ID, tail(string(b), 30))
					}
				}
			}
		})
		if _, err := c.WaitLeader(30 * time.Second); err != nil {
			t.Fatal(err)
		}
		return c
	}
	global := start("global", 3)

	// The regions' credential at the global cluster: a worker token for every domain (the
	// region follows the global limits of the domains it may use).
	opts, err := global.DialOptions()
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(global.GRPCAddrs()[0], opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	// (the dial options carry the bootstrap admin token)
	tok, err := quotadv1.NewAdminClient(conn).CreateToken(ctx, &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"*"}, Description: "regions"})
	if err != nil {
		t.Fatal(err)
	}
	tokFile := filepath.Join(dir, "region.token")
	if err := os.WriteFile(tokFile, []byte(tok.Token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var (
		regions []*proccluster.Cluster
		clients []*client.Client
	)
	for k := range 2 {
		rc := start(fmt.Sprintf("r%d", k), 1, "--region", fmt.Sprintf("r%d", k), "--global-addrs", strings.Join(global.GRPCAddrs(), ","),
			"--global-cacert", global.Credentials().CAFile, "--global-token-file", tokFile)
		c, err := client.New(rc.ClientConfig())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		regions, clients = append(regions, rc), append(clients, c)
	}
	// shares returns, per region, whether its leader decides every global level on a share.
	shared := func() error {
		for k, rc := range regions {
			opts, _ := rc.DialOptions()
			cc, err := grpc.NewClient(rc.GRPCAddrs()[0], opts...)
			if err != nil {
				return err
			}
			m, err := quotadv1.NewAdminClient(cc).Members(ctx, &quotadv1.MembersRequest{})
			cc.Close()
			if err != nil {
				return err
			}
			if len(m.RegionShares) != 2 {
				return fmt.Errorf("region %d: %d shares", k, len(m.RegionShares))
			}
			for _, s := range m.RegionShares {
				if s.Status != "lent" || !s.Local {
					return fmt.Errorf("region %d: %s %s local=%v %s", k, s.Path, s.Status, s.Local, s.Message)
				}
			}
		}
		return nil
	}
	eventually := func(d time.Duration, f func() error) (time.Duration, error) {
		t0 := time.Now()
		var err error
		for time.Since(t0) < d {
			if err = f(); err == nil {
				return time.Since(t0), nil
			}
			time.Sleep(100 * time.Millisecond)
		}
		return time.Since(t0), err
	}
	if _, err := eventually(30*time.Second, shared); err != nil {
		t.Fatalf("the regions hold no shares: %v", err)
	}

	// limits apply on the global cluster reaches both regions (each regional leader reads
	// them with its worker token and applies them through its own Raft log).
	added := regionsLimits + "---\ndomain: added-later\nrate_limit: {unit: second, requests_per_unit: 5}\n"
	if _, err := quotadv1.NewAdminClient(conn).ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: added}); err != nil {
		t.Fatal(err)
	}
	took, err := eventually(15*time.Second, func() error {
		for k, rc := range regions {
			opts, _ := rc.DialOptions()
			cc, err := grpc.NewClient(rc.GRPCAddrs()[0], opts...)
			if err != nil {
				return err
			}
			g, err := quotadv1.NewAdminClient(cc).GetLimits(ctx, &quotadv1.GetLimitsRequest{})
			cc.Close()
			if err != nil {
				return err
			}
			if !strings.Contains(g.Yaml, "domain: added-later") {
				return fmt.Errorf("region %d does not have the domain applied on the global cluster", k)
			}
		}
		return nil
	})
	t.Logf("limits applied on the global cluster: in both regions after %v", took.Round(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}

	// Both regions offer 75/s at "api" (1.5 R together) for the whole run.
	lctx, lcancel := context.WithCancel(ctx)
	defer lcancel()
	var loads [2]regionLoad
	for k := range loads {
		go loads[k].run(lctx, clients[k], "api", 75)
	}
	all := func(from, to time.Time) []time.Time {
		return append(loads[0].times(from, to), loads[1].times(from, to)...)
	}
	t0 := time.Now()
	time.Sleep(2 * regLease)

	// (a) The global leader killed: the regions go on deciding on their shares (no refusal
	// for want of a share), and the bound holds across it.
	gl := global.Leader(ctx)
	if gl < 0 {
		t.Fatal("no global leader")
	}
	global.Kill(gl)
	killed := time.Now()
	if _, err := global.WaitLeader(20 * time.Second); err != nil {
		t.Fatal(err)
	}
	time.Sleep(regLease)
	global.Start(gl)
	time.Sleep(regLease)
	failover := time.Now()
	noShare := 0
	for k := range loads {
		loads[k].mu.Lock()
		for m, n := range loads[k].denied {
			if strings.Contains(m, "no share") || strings.Contains(m, "ended without a renewal") {
				noShare += n
			}
		}
		clear(loads[k].denied)
		loads[k].mu.Unlock()
	}
	afterKill := loads[0].between(killed, killed.Add(regLease/2)) + loads[1].between(killed, killed.Add(regLease/2))
	ex := worstExcess(all(t0, failover), time.Second, 5*time.Second, 10*time.Second, failover.Sub(t0))
	util := float64(len(all(t0.Add(regLease), failover))) / (regR * failover.Sub(t0.Add(regLease)).Seconds())
	t.Logf("(a) global leader killed: %d admitted in the half term after the kill; %d refusals for want of a share; worst window excess %.1f; utilization %.3f", afterKill, noShare, ex, util)
	if afterKill == 0 || noShare > 0 {
		t.Errorf("(a) regional callers saw the global leader failover: %d admitted in the half term after, %d refusals for want of a share", afterKill, noShare)
	}
	if ex > 0 {
		t.Errorf("(a) admitted across the regions exceeds B + R·w(1+ρ) by %.1f in some window", ex)
	}

	// (b) The regions cut from the global cluster (every global node stopped) for 4 terms:
	// shares until they end, then the fallback slices (20/s in total) at "api", and "strict"
	// (no fallback_rate) refused with a reason naming the global scope.
	for i := range global.Nodes {
		global.Kill(i)
	}
	cut := time.Now()
	time.Sleep(regLease + 2*time.Second)
	var strictMsg string
	for range 5 {
		_, err := clients[0].Allow(ctx, client.Request{Domain: "strict", Cost: 1})
		var de *client.DeniedError
		if errors.As(err, &de) {
			strictMsg = de.Decision.Message
		} else {
			strictMsg = fmt.Sprintf("not denied: %v", err)
			break
		}
	}
	fbFrom := time.Now()
	time.Sleep(3 * regLease)
	fbTo := time.Now()
	fb := float64(len(all(fbFrom, fbTo))) / fbTo.Sub(fbFrom).Seconds()
	onShare := len(all(cut, cut.Add(regLease/2)))
	t.Logf("(b) global cut: %d admitted in the first half term (shares), then %.1f/s (fallback_rate 20 in total); strict: %q", onShare, fb, strictMsg)
	if onShare == 0 || fb <= 0 || fb > 20*1.2+2/fbTo.Sub(fbFrom).Seconds() {
		t.Errorf("(b) with the global cluster down: %d admitted on the shares, then %.1f/s; want > 0, then > 0 and ≤ the fallback_rate 20/s", onShare, fb)
	}
	if !strings.Contains(strictMsg, "global scope") || !strings.Contains(strictMsg, "fail closed") {
		t.Errorf("(b) strict with the global cluster down: %q, want a denial naming the global scope and fail closed", strictMsg)
	}

	// Recovery: exact again (every region decides on a share) within 2 terms of the restart.
	for i := range global.Nodes {
		if err := global.Start(i); err != nil {
			t.Fatal(err)
		}
	}
	restarted := time.Now()
	took, err = eventually(4*regLease, shared)
	t.Logf("recovery: shares back %v after the global restart (2 terms = %v)", took.Round(10*time.Millisecond), 2*regLease)
	if err != nil || took > 2*regLease {
		t.Errorf("recovery: %v after the restart: %v; want every region on a share within 2 terms", took, err)
	}
	from := restarted.Add(took)
	time.Sleep(2 * regLease)
	to := time.Now()
	lcancel()
	ex = worstExcess(all(from, to), time.Second, 5*time.Second, to.Sub(from))
	t.Logf("after recovery: worst window excess %.1f over %v", ex, to.Sub(from).Round(time.Second))
	if ex > 0 {
		t.Errorf("after recovery: admitted across the regions exceeds B + R·w(1+ρ) by %.1f in some window", ex)
	}
}
