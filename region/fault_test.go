package region_test

// Fault tests of issue 13 (make test-regions): a region partitioned from the global cluster,
// the global leader killed and restarted, healed — checked on the admission history.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/region"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// partition is a fault on one region's links to the global cluster (its holder's client
// dials through it). Cut in stall mode it drops the packets of every connection, old and new:
// reads and writes of existing connections block until heal (TCP retransmitting into a
// blackhole; what was in flight arrives after heal), new dials hang until heal or their
// deadline. Cut in reset mode it closes every existing connection and refuses new dials
// (ECONNREFUSED) until heal.
type partition struct {
	mu     sync.Mutex
	mode   string        // "", "stall" or "reset"
	healed chan struct{} // closed while not cut
	conns  map[*faultConn]struct{}
}

func newPartition() *partition {
	h := make(chan struct{})
	close(h)
	return &partition{healed: h, conns: map[*faultConn]struct{}{}}
}

func (p *partition) state() (string, chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mode, p.healed
}

func (p *partition) dialOption() grpc.DialOption {
	return grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
		mode, healed := p.state()
		switch mode {
		case "reset":
			return nil, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
		case "stall":
			select {
			case <-healed:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		fc := &faultConn{Conn: c, p: p, closed: make(chan struct{})}
		p.mu.Lock()
		p.conns[fc] = struct{}{}
		p.mu.Unlock()
		return fc, nil
	})
}

func (p *partition) cut(mode string) {
	p.mu.Lock()
	p.mode, p.healed = mode, make(chan struct{})
	var conns []*faultConn
	for c := range p.conns {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	if mode == "reset" {
		for _, c := range conns {
			_ = c.Close()
		}
	}
}

func (p *partition) heal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mode != "" {
		p.mode = ""
		close(p.healed)
	}
}

type faultConn struct {
	net.Conn
	p      *partition
	once   sync.Once
	closed chan struct{}
}

// gate blocks while the partition is cut.
func (c *faultConn) gate() error {
	_, healed := c.p.state()
	select {
	case <-healed:
		return nil
	case <-c.closed:
		return net.ErrClosed
	}
}

func (c *faultConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if gerr := c.gate(); gerr != nil {
		return 0, gerr
	}
	return n, err
}

func (c *faultConn) Write(b []byte) (int, error) {
	if err := c.gate(); err != nil {
		return 0, err
	}
	return c.Conn.Write(b)
}

func (c *faultConn) Close() error {
	c.once.Do(func() {
		close(c.closed)
		c.p.mu.Lock()
		delete(c.p.conns, c)
		c.p.mu.Unlock()
	})
	return c.Conn.Close()
}

// The fault scenario's limits: "api" global with a fallback_rate, "strict" global without.
const faultLimits = `
domain: api
rate_limit: {unit: second, requests_per_unit: 100, burst: 100, scope: global}
shares: {lease: 6s, reserve_percent: 1, fallback_rate: 20}
---
domain: strict
rate_limit: {unit: second, requests_per_unit: 100, burst: 100, scope: global}
shares: {lease: 6s}
`

const (
	faultR     = 100.0
	faultB     = 100.0
	faultF     = 20.0 // api's fallback_rate (a total over the regions)
	faultLease = 6 * time.Second
	// faultRho is the clock-rate tolerance of the bound (the (1+ρ) of invariant 2; the
	// other bound checks of the regions and the shares use the same).
	faultRho = 1e-3
)

// event is one decision a region's caller received.
type event struct {
	at     time.Time // when the answer arrived (the decision was before)
	region int
	domain string
	ok     bool
	msg    string // a refusal's message
}

type history struct {
	mu sync.Mutex
	ev []event
}

func (h *history) add(e event) {
	h.mu.Lock()
	h.ev = append(h.ev, e)
	h.mu.Unlock()
}

func (h *history) events() []event {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.ev)
}

// offer sends rate requests per second for domain to region i's cluster (each its own
// goroutine, so a slow answer does not slow the offer) until ctx ends.
func (h *history) offer(ctx context.Context, wg *sync.WaitGroup, c *client.Client, i int, domain string, rate int) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(time.Second / time.Duration(rate))
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				defer cancel()
				_, err := c.Allow(rctx, client.Request{Domain: domain, Cost: 1})
				var de *client.DeniedError
				switch {
				case err == nil:
					h.add(event{at: time.Now(), region: i, domain: domain, ok: true})
				case errors.As(err, &de):
					h.add(event{at: time.Now(), region: i, domain: domain, msg: de.Decision.Message})
				case ctx.Err() == nil:
					h.add(event{at: time.Now(), region: i, domain: domain, msg: "error: " + err.Error()})
				}
			}()
		}
	}()
}

// shareSample is a region holder's share of a level at one moment.
type shareSample struct {
	at     time.Time
	expiry time.Time
	status string
	local  bool
	rate   float64
}

// watchShares samples every 20 ms the share of each global level held by the leader of rc.
func watchShares(ctx context.Context, rc *rpctest.Cluster) func() map[string][]shareSample {
	var mu sync.Mutex
	out := map[string][]shareSample{}
	go func() {
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			a := rc.Agent(0)
			if a == nil {
				continue
			}
			h, _ := a.Region().(*region.Holder)
			if h == nil {
				continue
			}
			now := time.Now()
			mu.Lock()
			for _, s := range h.Shares() {
				out[s.Domain] = append(out[s.Domain], shareSample{at: now, expiry: s.Expiry, status: s.Status, local: s.Local, rate: s.Rate})
			}
			mu.Unlock()
		}
	}()
	return func() map[string][]shareSample {
		mu.Lock()
		defer mu.Unlock()
		c := map[string][]shareSample{}
		for k, v := range out {
			c[k] = slices.Clone(v)
		}
		return c
	}
}

// outage is what a partition of region A did to its share of one level: the end of its last
// grant before heal, and when a grant newer than that was first seen after heal.
type outage struct {
	cut, heal time.Time
	shareEnd  time.Time // the share's end as the holder timed it (zero: no share when cut)
	rateAtCut float64
	regrant   time.Time // zero: no new grant seen
}

func findOutage(samples []shareSample, cut, heal time.Time) outage {
	o := outage{cut: cut, heal: heal}
	for _, s := range samples {
		if s.at.Before(cut) {
			o.rateAtCut = s.rate
			continue
		}
		if s.at.Before(heal) {
			if s.expiry.After(o.shareEnd) {
				o.shareEnd = s.expiry
			}
			continue
		}
		if o.regrant.IsZero() && s.status == "lent" && s.local && s.expiry.After(o.shareEnd) && s.expiry.After(s.at) {
			o.regrant = s.at
		}
	}
	return o
}

// boundExcess returns the largest excess of admissions over B + R·w(1+ρ) over every window
// of a length in ws (negative: inside the bound) and where it was.
func boundExcess(ts []time.Time, ws []time.Duration) (float64, string) {
	slices.SortFunc(ts, func(a, b time.Time) int { return a.Compare(b) })
	worst, where := -1e18, ""
	for _, w := range ws {
		j := 0
		for i := range ts {
			for ts[i].Sub(ts[j]) > w {
				j++
			}
			if ex := float64(i-j+1) - (faultB + faultR*w.Seconds()*(1+faultRho)); ex > worst {
				worst, where = ex, fmt.Sprintf("%d admitted in the %v window ending %v after the start", i-j+1, w, ts[i].Sub(ts[0]).Round(time.Millisecond))
			}
		}
	}
	return worst, where
}

// TestRegionsFaults: a global cluster of 3 nodes and two regional clusters (real Raft, BoltDB,
// gRPC over loopback), each region offered 75/s at the global level "api" (100/s, burst 100:
// the regions together want 1.5 R) and region A 10/s at "strict" (global, no fallback_rate).
// Faults, each a round:
//
//  1. region A partitioned from the global cluster in stall mode (every packet of its links
//     dropped: old connections hang, new dials hang); a term later the global leader is
//     killed (restarted half a term after); A healed a term after the kill;
//  2. A cut in reset mode (connections closed, dials refused) and the global leader killed
//     at the same moment; restarted half a term later, A healed 1.5 terms after the cut.
//
// Checked on the history of decisions: every 1, 2, 5, 10 s window and the whole run admit at
// "api" across both regions at most B + R·w(1+ρ), counting A's admissions between its
// share's end and its next grant apart (they are the documented fallback, the regional
// limit while global is unreachable): those stay within fallback_rate·duration; until its
// share ends A keeps deciding on it; strict (no fallback) is refused naming the global scope
// once it ended; after heal A holds a new grant within 2 lease terms, and region B never
// lacks a share (a global leader failover is invisible while shares last).
func TestRegionsFaults(t *testing.T) {
	if os.Getenv("QUOTAD_REGIONS_FAULTS") == "" {
		t.Skip("about 80 s: set QUOTAD_REGIONS_FAULTS=1 (make test-regions)")
	}
	global := rpctest.Start(t, 3, faultLimits)
	parts := []*partition{newPartition(), newPartition()}
	var (
		regions []*rpctest.Cluster
		clients []*client.Client
	)
	for i := range 2 {
		g := client.Config{Addrs: global.Addrs(), Insecure: true, DialOptions: []grpc.DialOption{parts[i].dialOption()}}
		name := fmt.Sprintf("r%d", i)
		rc := rpctest.Start(t, 1, faultLimits, func(_ int, c *rpc.AgentConfig) { c.Region = region.Agent(name, g) })
		c, err := client.New(client.Config{Addrs: rc.Addrs(), Insecure: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		regions, clients = append(regions, rc), append(clients, c)
	}
	t.Cleanup(func() {
		for _, p := range parts {
			p.heal()
		}
	})
	clustertest.Eventually(t, 20*time.Second, func() error {
		for i, rc := range regions {
			h, _ := rc.Agent(0).Region().(*region.Holder)
			if h == nil {
				return fmt.Errorf("region %d: no holder", i)
			}
			if len(h.Shares()) != 2 {
				return fmt.Errorf("region %d: %d shares, want 2", i, len(h.Shares()))
			}
			for _, s := range h.Shares() {
				if s.Status != "lent" || !s.Local {
					return fmt.Errorf("region %d: %s: %s %s", i, s.Path, s.Status, s.Message)
				}
			}
		}
		return nil
	})

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	samplesA := watchShares(ctx, regions[0])
	var h history
	var wg sync.WaitGroup
	start := time.Now()
	h.offer(ctx, &wg, clients[0], 0, "api", 75)
	h.offer(ctx, &wg, clients[1], 1, "api", 75)
	h.offer(ctx, &wg, clients[0], 0, "strict", 10)

	at := func(d time.Duration) { time.Sleep(time.Until(start.Add(d))) }
	since := func(ts time.Time) time.Duration { return ts.Sub(start).Round(10 * time.Millisecond) }
	killGlobalLeader := func() int {
		l := global.Leader()
		if l < 0 {
			l = global.WaitLeader(10 * time.Second)
		}
		global.Kill(l)
		t.Logf("t=%v: global leader node%d killed", since(time.Now()), l)
		return l
	}
	type round struct {
		mode      string
		cut, heal time.Time
	}
	var rounds []round

	// Round 1: stall A, kill the global leader a term later, restart it, heal.
	at(faultLease)
	r := round{mode: "stall", cut: time.Now()}
	parts[0].cut("stall")
	t.Logf("t=%v: region A cut from the global cluster (stall)", since(r.cut))
	at(2 * faultLease)
	killed := killGlobalLeader()
	at(2*faultLease + faultLease/2)
	global.Restart(killed)
	t.Logf("t=%v: node%d restarted; global leader node%d", since(time.Now()), killed, global.WaitLeader(10*time.Second))
	at(3 * faultLease)
	parts[0].heal()
	r.heal = time.Now()
	t.Logf("t=%v: region A healed", since(r.heal))
	rounds = append(rounds, r)

	// Round 2: reset A and kill the global leader at once; restart; heal.
	at(6 * faultLease)
	r = round{mode: "reset", cut: time.Now()}
	parts[0].cut("reset")
	killed = killGlobalLeader()
	t.Logf("t=%v: region A cut from the global cluster (reset)", since(r.cut))
	at(6*faultLease + faultLease/2)
	global.Restart(killed)
	t.Logf("t=%v: node%d restarted; global leader node%d", since(time.Now()), killed, global.WaitLeader(10*time.Second))
	at(7*faultLease + faultLease/2)
	parts[0].heal()
	r.heal = time.Now()
	t.Logf("t=%v: region A healed", since(r.heal))
	rounds = append(rounds, r)

	// Steady again: 2 terms to come back, then a term measured.
	at(10*faultLease + faultLease/2)
	end := time.Now()
	cancel()
	wg.Wait()
	ev := h.events()
	shares := samplesA()

	// Where A decided on its fallback: from its share's end to its next grant, per round.
	var apiOut, strictOut []outage
	for _, r := range rounds {
		o := findOutage(shares["api"], r.cut, r.heal)
		so := findOutage(shares["strict"], r.cut, r.heal)
		t.Logf("%s round: cut %v, api share (%.1f/s at the cut) ended %v, strict's %v, healed %v, new api grant seen %v",
			r.mode, since(r.cut), o.rateAtCut, since(o.shareEnd), since(so.shareEnd), since(r.heal), since(o.regrant))
		if o.shareEnd.IsZero() || !o.shareEnd.Before(r.heal.Add(-time.Second)) {
			t.Fatalf("%s round: region A's api share did not end before heal (end %v, heal %v): the partition did not cut it off", r.mode, since(o.shareEnd), since(r.heal))
		}
		if o.regrant.IsZero() || o.regrant.Sub(r.heal) > 2*faultLease {
			t.Fatalf("%s round: region A had no new api grant within 2 lease terms (%v) of heal (seen at %v)", r.mode, 2*faultLease, since(o.regrant))
		}
		apiOut, strictOut = append(apiOut, o), append(strictOut, so)
	}
	inFallback := func(e event) bool {
		for _, o := range apiOut {
			if e.region == 0 && !e.at.Before(o.shareEnd) && e.at.Before(o.regrant) {
				return true
			}
		}
		return false
	}

	// 1. The global bound on every window, A's fallback admissions apart.
	var onShares []time.Time
	var total int
	for _, e := range ev {
		if e.domain != "api" || !e.ok {
			continue
		}
		total++
		if !inFallback(e) {
			onShares = append(onShares, e.at)
		}
	}
	ex, where := boundExcess(onShares, []time.Duration{time.Second, 2 * time.Second, 5 * time.Second, 10 * time.Second, end.Sub(start) + time.Second})
	util := float64(total) / (faultR * end.Sub(start).Seconds())
	t.Logf("api: %d admitted in %v (%.2f of R), %d on shares; worst window %.1f units from B + R·w(1+ρ) (%s)", total, since(end), util, len(onShares), ex, where)
	if ex > 0 {
		t.Errorf("the global bound is broken across regions: %s > B + R·w(1+ρ) by %.1f", where, ex)
	}

	count := func(region int, domain string, from, to time.Time, ok bool) (n int, msgs map[string]int) {
		msgs = map[string]int{}
		for _, e := range ev {
			if e.region == region && e.domain == domain && e.ok == ok && !e.at.Before(from) && e.at.Before(to) {
				n++
				if !ok {
					msgs[e.msg]++
				}
			}
		}
		return n, msgs
	}
	for k, o := range apiOut {
		mode := rounds[k].mode
		// 2. Until its share ends, A keeps deciding on it, never refused for want of one.
		onShare := o.shareEnd.Sub(o.cut) - 300*time.Millisecond
		n, _ := count(0, "api", o.cut, o.cut.Add(onShare), true)
		_, refusals := count(0, "api", o.cut, o.cut.Add(onShare), false)
		t.Logf("%s round: A admitted %d in the %v of its share after the cut (%.1f/s; share %.1f/s); refusals %v", mode, n, onShare.Round(time.Millisecond), float64(n)/onShare.Seconds(), o.rateAtCut, refusals)
		if float64(n) < 0.5*min(o.rateAtCut, 75)*onShare.Seconds() {
			t.Errorf("%s round: region A admitted %d in the %v after the cut while its share (%.1f/s) lasted: it should keep deciding on it", mode, n, onShare, o.rateAtCut)
		}
		for m := range refusals {
			if !strings.Contains(m, "share of the global limit is spent") {
				t.Errorf("%s round: region A refused %q while its share lasted", mode, m)
			}
		}
		// 3. Then at its slice of fallback_rate, a total split by weight over the holders
		// active at the last grant: the two regions, of the same weight, so F/2 per second
		// (and one unit of burst); and still deciding.
		fb := o.regrant.Sub(o.shareEnd)
		n, _ = count(0, "api", o.shareEnd, o.regrant, true)
		t.Logf("%s round: A admitted %d in the %v from its share's end to its new grant (%.1f/s; its slice of fallback_rate %v/s)", mode, n, fb.Round(time.Millisecond), float64(n)/fb.Seconds(), faultF/2)
		// The answers of decisions made on the share just before its end may arrive up to a
		// few ms after it: 3 units of slack.
		if float64(n) > faultF/2*fb.Seconds()*(1+faultRho)+1+3 {
			t.Errorf("%s round: region A admitted %d at api in the %v between its share's end and its new grant: more than its slice of fallback_rate, %v/s", mode, n, fb, faultF/2)
		}
		_, fbRefusals := count(0, "api", o.shareEnd.Add(100*time.Millisecond), o.regrant, false)
		for m := range fbRefusals {
			if !strings.Contains(m, "global scope domain") || !strings.Contains(m, "slice of shares.fallback_rate is spent") {
				t.Errorf("%s round: region A refused %q on its fallback; want a reason naming the global scope and the spent fallback slice", mode, m)
			}
		}
		if fb > 2*time.Second && n == 0 {
			t.Errorf("%s round: region A admitted nothing at api between its share's end and its new grant (%v): it should decide at its fallback slice", mode, fb)
		}
		// strict has no fallback_rate: refused, naming the global scope and "fail closed".
		so := strictOut[k]
		from := so.shareEnd.Add(100 * time.Millisecond)
		sn, _ := count(0, "strict", from, o.heal, true)
		_, srefused := count(0, "strict", from, o.heal, false)
		named := 0
		for m, c := range srefused {
			if strings.Contains(m, "global scope domain") && strings.Contains(m, "fail closed") {
				named += c
			}
		}
		t.Logf("%s round: strict after its share's end: %d admitted, %d refusals naming the global scope", mode, sn, named)
		if sn != 0 || named == 0 {
			t.Errorf("%s round: strict admitted %d after its share ended with the global cluster unreachable, %d refusals naming the global scope (%v); want 0 and some", mode, sn, named, srefused)
		}
	}
	// 4. No refusal for want of a share: region B throughout (the global leader's failovers
	// are invisible while shares last), region A outside its outages.
	for _, e := range ev {
		if e.ok || e.domain != "api" || inFallback(e) {
			continue
		}
		if e.region == 0 {
			inOutage := false
			for _, o := range apiOut {
				// A decision made just before the new grant may be answered after it was
				// sampled: half a second of slack.
				inOutage = inOutage || !e.at.Before(o.cut) && e.at.Before(o.regrant.Add(500*time.Millisecond))
			}
			if inOutage {
				continue
			}
		}
		if !strings.Contains(e.msg, "share of the global limit is spent") {
			t.Errorf("region %d refused at %v: %q — want only 'share spent' refusals outside region A's outages", e.region, since(e.at), e.msg)
			break
		}
	}
	// 5. Exact again: after the last heal + 2 terms both regions decide on shares, the global
	// rate used (the regions want 1.5 R).
	from := rounds[len(rounds)-1].heal.Add(2 * faultLease)
	n0, _ := count(0, "api", from, end, true)
	n1, _ := count(1, "api", from, end, true)
	u := float64(n0+n1) / (faultR * end.Sub(from).Seconds())
	t.Logf("after heal + 2 terms: A %d, B %d admitted in %v: %.2f of R", n0, n1, end.Sub(from).Round(time.Millisecond), u)
	if u < 0.8 || n0 == 0 {
		t.Errorf("after heal + 2 terms the regions admit %.2f of R (A %d, B %d): want ≥ 0.8 with both on shares", u, n0, n1)
	}
}
