package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/client/quotahttp"
	"github.com/quotad/quotad/internal/proccluster"
)

// aimdProviderBurst is the simulated provider's token-bucket burst: 5 (a twelfth of a second of
// its capacity), the strict provider of the engine's deterministic
// TestAIMDConvergesOnHiddenCapacity. A lenient provider (-aimd-provider-burst 60, one second,
// the usual token-bucket default) absorbs the bunching of admissions described at aimdDomain.
var aimdProviderBurst = flag.Int("aimd-provider-burst", aimdHiddenDefaultBurst, "aimd: the simulated provider's burst")

// aimdDomain is the limits of domain "provider" (%s: its name, "provider" or "provider-N" for
// the N-th run of -aimd-runs; %d: its burst, flag -aimd-burst).
const aimdDomain = `# AIMD against a simulated provider whose hidden capacity is 60/s, 60 %% of this ceiling
# (aimd.go). Every confirmed 429 costs twice: the domain is paused until the provider's
# Retry-After, which over HTTP is whole seconds (a 1 s stop, about 55 requests of a 60/s
# provider, at each 429), and the rate is multiplied down. So the parameters aim at few, mild
# decreases:
#   decrease_percent 90: a sawtooth just under 60 (about 54..61) wastes little; 100 -> 59 still
#     takes only five decreases (about 10 s with the 2 s window), well inside the 30 s budget.
#   increase 1 per stable_window 2s: a slow climb back (0.5/s) makes the sawtooth long (about
#     17 s), so the fixed cost of each 429's pause is spread over more requests, and the rate
#     overshoots the hidden capacity slowly, so the provider's small burst runs dry gently and
#     one or two requests get a 429 before the pause is in force. The window also makes a burst
#     of 429s from many workers count as one decrease.
#   floor 20: a fifth of the ceiling; never reached here.
#   burst 2 (flag -aimd-burst): admissions reach the provider bunched (likely a commit stall
#     delivers what the bucket paid meanwhile at once; up to 10-12 requests within 100 ms were
#     seen against 6 at a steady 60/s), and a strict provider (burst 5) answers 429 to the
#     bunches even at 40/s; each 429 then pauses and decreases, so the rate ratchets down (with
#     burst 5: 26/s after 60 s, 40 %% utilization). Burst 1 bunches least but allows one
#     admission in flight through Raft at a time (the scheduler counts released, unanswered
#     cost against the burst), which caps the rate at 1/commit latency (about 46/s here, 76 %%).
#     Burst 2 keeps two in flight and the bunches small.
#   resume_jitter 250ms: the waiters queue on the leader through a pause; the jitter only
#     spreads requests refused as paused, and a long one would idle the provider after each
#     1 s pause.
domain: %s
rate_limit: {unit: second, requests_per_unit: 100, burst: %d}
adaptive: {floor: 20, decrease_percent: 90, increase: 1, stable_window: 2s}
resume_jitter: 250ms
`

var (
	aimdBurst = flag.Int("aimd-burst", 2, "aimd: burst of domain provider")
	aimdRuns  = flag.Int("aimd-runs", 1, "aimd: how many times to run the scenario, each on a domain of its own (fresh adaptive state)")
)

// aimdDomainName is the domain of the run-th AIMD run (1-based).
func aimdDomainName(run int) string {
	if run <= 1 {
		return "provider"
	}
	return fmt.Sprint("provider-", run)
}

func aimdLimits() string {
	var b strings.Builder
	for run := 1; run <= max(*aimdRuns, 1); run++ {
		if run > 1 {
			b.WriteString("---\n")
		}
		fmt.Fprintf(&b, aimdDomain, aimdDomainName(run), *aimdBurst)
	}
	return b.String()
}

// The AIMD scenario's simulated provider and its load.
const (
	aimdHiddenDefaultBurst = 5
	// aimdHidden is the provider's real capacity, 60 % of the ceiling; quotad is not told.
	aimdHidden = 60
	// aimdWorkers keep requests outstanding; each sends its next request as soon as the last
	// one is answered, so the offered load is far above the ceiling (quotad is the limiter).
	aimdWorkers = 40
	// aimdReasonHeader is the provider's limiter-reason header.
	aimdReasonHeader = "X-Provider-Limit-Reason"
)

// provider is a simulated provider API on loopback: a GCRA token bucket of aimdHidden/s and
// aimdProviderBurst; what exceeds it gets 429 with Retry-After (whole seconds, rounded up, at
// least 1 — what an HTTP API can say) and the reason header.
type provider struct {
	interval, tolerance time.Duration

	mu       sync.Mutex
	tat      time.Time
	arrivals []arrival

	sent, ok, throttled atomic.Int64
}

func newProvider(perSecond, burst int) *provider {
	iv := time.Second / time.Duration(perSecond)
	return &provider{interval: iv, tolerance: time.Duration(burst-1) * iv}
}

// allow admits at now or says how long until it would.
func (p *provider) allow(now time.Time) (bool, time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if earliest := p.tat.Add(-p.tolerance); now.Before(earliest) {
		p.arrivals = append(p.arrivals, arrival{at: now})
		return false, earliest.Sub(now)
	}
	if p.tat.Before(now) {
		p.tat = now
	}
	p.tat = p.tat.Add(p.interval)
	p.arrivals = append(p.arrivals, arrival{at: now, ok: true})
	return true, 0
}

func (p *provider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.sent.Add(1)
	ok, wait := p.allow(time.Now())
	if !ok {
		p.throttled.Add(1)
		secs := max(1, int64((wait+time.Second-1)/time.Second))
		w.Header().Set(quotahttp.HeaderRetryAfter, strconv.FormatInt(secs, 10))
		w.Header().Set(aimdReasonHeader, "rate")
		http.Error(w, "rate limited", http.StatusTooManyRequests)
		return
	}
	p.ok.Add(1)
	_, _ = io.WriteString(w, "ok\n")
}

type arrival struct {
	at time.Time
	ok bool
}

// clumping describes the arrivals in [from, to): the most requests within any 100 ms (a
// steady 60/s gives 6), and the 429s answered while the second before them (429 included)
// held at most the hidden capacity: throttling caused by bunching, not by the average rate.
func (p *provider) clumping(from, to time.Time) (max100ms, underCapacity429 int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	a := p.arrivals
	for i, j, k := 0, 0, 0; i < len(a); i++ {
		for a[j].at.Before(a[i].at.Add(-100 * time.Millisecond)) {
			j++
		}
		for a[k].at.Before(a[i].at.Add(-time.Second)) {
			k++
		}
		if a[i].at.Before(from) || !a[i].at.Before(to) {
			continue
		}
		max100ms = max(max100ms, i-j+1)
		if !a[i].ok && i-k+1 <= aimdHidden {
			underCapacity429++
		}
	}
	return max100ms, underCapacity429
}

type providerCounts struct {
	at                  time.Time
	sent, ok, throttled int64
}

func (p *provider) snapshot() providerCounts {
	return providerCounts{at: time.Now(), sent: p.sent.Load(), ok: p.ok.Load(), throttled: p.throttled.Load()}
}

// window is what the provider saw between two snapshots.
type window struct {
	secs                float64
	sent, ok, throttled int64
}

func between(a, b providerCounts) window {
	return window{secs: b.at.Sub(a.at).Seconds(), sent: b.sent - a.sent, ok: b.ok - a.ok, throttled: b.throttled - a.throttled}
}

func (w window) rate429() float64 {
	if w.sent == 0 {
		return 0
	}
	return float64(w.throttled) / float64(w.sent)
}

func (w window) utilization() float64 { return float64(w.ok) / (aimdHidden * w.secs) }

func (w window) String() string {
	return fmt.Sprintf("%.1fs: sent %d (%.1f/s), accepted %d, 429 %d (%.2f%%), utilization of hidden capacity %.1f%%",
		w.secs, w.sent, float64(w.sent)/w.secs, w.ok, w.throttled, 100*w.rate429(), 100*w.utilization())
}

// aimd runs aimdWorkers workers that call the simulated provider through quotahttp.Transport
// (admission by client.Acquire on the leader's fair scheduler; a 429 is reported through the
// Feedback RPC with its Retry-After and reason, which pauses domain "provider" and — being
// confirmed rate limiting — multiplies its adaptive rate down). The adaptive rate starts at
// the ceiling. The first `warm` is convergence; the keys are measured over the following
// `measure`: 429s / requests the provider received, and accepted / (hidden capacity · T).
func aimd(c *proccluster.Cluster, domain string, warm, measure time.Duration) (conv, steady window) {
	cl := newClient(c)
	defer cl.Close()
	prov := newProvider(aimdHidden, *aimdProviderBurst)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	check(err)
	srv := &http.Server{Handler: prov, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	url := "http://" + ln.Addr().String() + "/v1/charge"

	var decreases atomic.Int64
	var feedbackErrs atomic.Int64
	hc := &http.Client{Transport: &quotahttp.Transport{
		Client:       cl,
		Request:      func(*http.Request) (client.Request, error) { return client.Request{Domain: domain}, nil },
		Base:         &http.Transport{MaxIdleConnsPerHost: aimdWorkers, MaxConnsPerHost: aimdWorkers},
		Wait:         true,
		ReasonHeader: aimdReasonHeader,
		OnFeedback: func(_ *http.Request, _ client.Feedback, res client.FeedbackResult, err error) {
			switch {
			case err != nil:
				feedbackErrs.Add(1)
			case res.Decreased:
				decreases.Add(1)
			}
		},
	}}

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var denied atomic.Int64
	for range aimdWorkers {
		wg.Go(func() {
			for ctx.Err() == nil {
				rctx, rc := context.WithTimeout(ctx, 10*time.Second)
				req, err := http.NewRequestWithContext(rctx, http.MethodPost, url, nil)
				check(err)
				resp, err := hc.Do(req)
				if err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				} else if errors.Is(err, client.ErrDenied) {
					denied.Add(1) // Wait gave up before its context's deadline: ask again
				} else if ctx.Err() == nil {
					time.Sleep(10 * time.Millisecond)
				}
				rc()
			}
		})
	}

	// Log the trajectory: effective limit (from Status) and the provider's view every 5 s.
	limit := func() uint64 {
		sctx, sc := context.WithTimeout(ctx, 2*time.Second)
		defer sc()
		st, err := cl.Status(sctx, domain)
		if err != nil || len(st.Buckets) == 0 {
			return 0
		}
		return st.Buckets[0].Limit
	}
	start := prov.snapshot()
	warmEnd, end := start.at.Add(warm), start.at.Add(warm+measure)
	prev, mid := start, providerCounts{}
	for {
		next := time.Now().Add(5 * time.Second)
		if mid.at.IsZero() {
			next = minTime(next, warmEnd)
		}
		time.Sleep(time.Until(minTime(next, end)))
		cur := prov.snapshot()
		if mid.at.IsZero() && !cur.at.Before(warmEnd) {
			mid = cur
		}
		logf("aimd: t=%2.0fs effective limit %d/s, %d decreases so far; last %s", cur.at.Sub(start.at).Seconds(),
			limit(), decreases.Load(), between(prev, cur))
		prev = cur
		if !cur.at.Before(end) {
			break
		}
	}
	stop := prev
	cancel()
	wg.Wait()
	conv, steady = between(start, mid), between(mid, stop)
	logf("aimd: provider %d/s, burst %d; %d workers; %d decreases, %d feedback errors, %d admissions given up by Wait", aimdHidden, *aimdProviderBurst, aimdWorkers,
		decreases.Load(), feedbackErrs.Load(), denied.Load())
	for _, w := range []struct {
		name     string
		from, to time.Time
	}{{"convergence", start.at, mid.at}, {"measured", mid.at, stop.at}} {
		m, u := prov.clumping(w.from, w.to)
		logf("aimd: %s: at most %d requests within 100 ms at the provider (6 at a steady 60/s); %d 429s while the second before held <= %d requests",
			w.name, m, u, aimdHidden)
	}
	logf("aimd: convergence (first %v): %s", warm, conv)
	logf("aimd: measured (next %v): %s", measure, steady)
	return conv, steady
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}
