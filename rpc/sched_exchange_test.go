package rpc_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// Two domains at 1000 tokens/s, burst 1: on "open" tenants have no limit of their own, on
// "own" each tenant also has one (a rate limit below the contended ceiling).
const exchangeLimits = `
domain: open
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1}
descriptors:
  - key: tenant
---
domain: own
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1}
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 5000, burst: 5}
`

// Small tenants arriving beside two backlogged heavy ones take the bucket's next held moment
// from a heavy grant (moment exchange), and the answers still keep the bucket's bound exactly:
// the moments answers are held to are one token interval apart, as the FSM's are. A heavy
// grant is moved later by at most FairExchangeMax. Where tenants have limits of their own
// (a rate limit below the ceiling), nothing is exchanged.
func TestNewcomerTakesHeldMoment(t *testing.T) {
	type grant struct {
		domain, tenant   string
		fsm, held, stamp int64
	}
	var tmu sync.Mutex
	var grants []grant
	tracing := false
	rpc.SetFairTrace(func(tr rpc.FairTrace) {
		tmu.Lock()
		if tracing && !tr.Direct {
			grants = append(grants, grant{tr.Adm.Domain, tr.Adm.Descriptors[0].Value, tr.MomentFSM, tr.HeldFSM, tr.StampFSM})
		}
		tmu.Unlock()
	})
	t.Cleanup(func() { rpc.SetFairTrace(nil) }) // after the cluster's cleanup
	c := rpctest.Start(t, 3, exchangeLimits)
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	var id atomic.Uint64
	adm := func(domain, tenant string) *quotadv1.Admission {
		return &quotadv1.Admission{RequestId: id.Add(1), Domain: domain, Cost: 1, MaxWaitMs: 20000,
			Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tenant}}}
	}

	run := func(domain string) []grant {
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		for k, tenant := range []string{"A", "B"} {
			for range 100 {
				wg.Go(func() {
					for ctx.Err() == nil {
						_, _ = acquireOne(ctx, q, fmt.Sprint(domain, "heavy", k), adm(domain, tenant))
					}
				})
			}
		}
		clustertest.Eventually(t, 10*time.Second, func() error {
			if w := c.Agent(leader).FairView().Waiting; w < 100 {
				return fmt.Errorf("%d waiting", w)
			}
			return nil
		})
		tmu.Lock()
		tracing, grants = true, nil
		tmu.Unlock()
		// Six small tenants, each one admission at a time at random moments, for 2 s.
		var small sync.WaitGroup
		stop := time.Now().Add(2 * time.Second)
		for s := range 6 {
			small.Go(func() {
				for time.Now().Before(stop) {
					time.Sleep(time.Duration(rand.Int64N(int64(40 * time.Millisecond))))
					d, err := acquireOne(ctx, q, fmt.Sprint(domain, "small", s), adm(domain, fmt.Sprint("s", s)))
					if err != nil || !d.Admitted {
						t.Errorf("small tenant s%d: %v %+v", s, err, d)
						return
					}
				}
			})
		}
		small.Wait()
		tmu.Lock()
		tracing = false
		all := grants
		tmu.Unlock()
		cancel()
		wg.Wait()
		// This domain's only: a grant of the previous run held when its caller was cancelled
		// may still be answered (and traced) once this run traces — one that had been
		// exchanged on "open" failed the "own" checks below.
		var got []grant
		for _, g := range all {
			if g.domain == domain {
				got = append(got, g)
			}
		}
		return got
	}

	before := c.Agent(leader).FairView().MomentExchanges
	open := run("open")
	exchanged := c.Agent(leader).FairView().MomentExchanges - before
	if exchanged == 0 {
		t.Fatalf("no moment exchange in 2 s of small tenants arriving beside 200 heavy waiters on a 1000/s bucket")
	}
	var held []int64
	smallEarlier, smallN := 0, 0
	for _, g := range open {
		held = append(held, g.held)
		if late := time.Duration(g.held - g.fsm); late > rpc.FairExchangeMax {
			t.Errorf("tenant %s's grant held %v past its FSM moment, beyond FairExchangeMax %v", g.tenant, late, rpc.FairExchangeMax)
		}
		if g.tenant[0] == 's' {
			smallN++
			if g.held < g.fsm {
				smallEarlier++
			}
			if g.held > g.fsm {
				t.Errorf("small tenant %s's grant moved later (%v): only newcomers take earlier moments", g.tenant, time.Duration(g.held-g.fsm))
			}
		}
	}
	slices.Sort(held)
	for i := 1; i < len(held); i++ {
		if d := time.Duration(held[i] - held[i-1]); d < time.Millisecond-time.Microsecond {
			t.Fatalf("two answers held to moments %v apart on a 1000/s burst-1 bucket (grant %d of %d): an exchange broke the bound", d, i, len(held))
		}
	}
	t.Logf("open: %d grants, %d exchanges; %d of %d small grants answered before their FSM moment", len(open), exchanged, smallEarlier, smallN)
	if smallEarlier == 0 {
		t.Fatalf("no small tenant's grant was answered before its FSM moment (%d small grants, %d exchanges)", smallN, exchanged)
	}

	before = c.Agent(leader).FairView().MomentExchanges
	own := run("own")
	if n := c.Agent(leader).FairView().MomentExchanges - before; n != 0 {
		t.Fatalf("%d exchanges on a domain whose tenants have limits of their own (want 0)", n)
	}
	for _, g := range own {
		if g.held != g.fsm {
			t.Fatalf("tenant %s (domain %s)'s grant held to %d, FSM moment %d (stamp %d): moved where tenants have limits of their own", g.tenant, g.domain, g.held, g.fsm, g.stamp)
		}
	}
}

// A retry of a waiting admission the FSM granted as a scheduled grant (answered from its dedup
// table) is held FairExchangeMax beyond the moment the table gives: the original answer may
// have been moved that much later by an exchange, and the retry must not be told earlier.
func TestDuplicateScheduledGrantHeldPastExchanges(t *testing.T) {
	c := rpctest.Start(t, 3, exchangeLimits)
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// A backlog, so that grants are scheduled ahead of their moments.
	var id atomic.Uint64
	id.Store(1000)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for range 100 {
		wg.Go(func() {
			for ctx.Err() == nil {
				_, _ = acquireOne(ctx, q, "heavy", &quotadv1.Admission{RequestId: id.Add(1), Domain: "open", Cost: 1, MaxWaitMs: 20000,
					Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "A"}}})
			}
		})
	}
	clustertest.Eventually(t, 10*time.Second, func() error {
		if w := c.Agent(leader).FairView().Waiting; w < 50 {
			return fmt.Errorf("%d waiting", w)
		}
		return nil
	})
	held := 0
	for i := range 20 {
		a := &quotadv1.Admission{RequestId: uint64(i + 1), Domain: "open", Cost: 1, MaxWaitMs: 20000,
			Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "B"}}}
		d, err := acquireOne(ctx, q, "retrier", a)
		if err != nil || !d.Admitted {
			t.Fatalf("admission %d: %v %+v", i+1, err, d)
		}
		start := time.Now()
		again, err := acquireOne(ctx, q, "retrier", a)
		took := time.Since(start)
		if err != nil || !again.Admitted {
			t.Fatalf("retry of admission %d: %v %+v", i+1, err, again)
		}
		// A scheduled grant's retry is held at least FairExchangeMax (plus its grant's
		// delay). One that took effect at its entry's time (not held, so never exchanged) is
		// answered at once: rare with 100 waiters ahead, whose grants are released ahead.
		if took >= rpc.FairExchangeMax {
			held++
		}
	}
	t.Logf("%d of 20 retries held ≥ %v", held, rpc.FairExchangeMax)
	if held < 15 {
		t.Fatalf("only %d of 20 retries of scheduled grants were held ≥ FairExchangeMax %v: a retry may be told of a moment an exchange gave away", held, rpc.FairExchangeMax)
	}
}
