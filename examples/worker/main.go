// Command worker is an example of many worker goroutines sharing one provider quota through
// quotad (seed 000). Jobs of several tenants go to a provider over an http.Client whose
// Transport asks quotad before every request; a denied job is rescheduled at the decision's
// RetryAt (a stand-in for a durable job queue) instead of holding a goroutine, and the
// provider's own 429s are reported back to quotad's Feedback API.
//
// By default it starts a fake provider on loopback that allows -provider-rps requests per
// second and answers 429 with Retry-After above that, so you can see quotad keep the fleet
// under the provider's limit. Run a cluster with `make run`, then:
//
//	go run ./examples/worker -domain provider -jobs 300
//
// The cluster's limits must define the domain (-domain). Each request's descriptor path is
// endpoint=<-endpoint>, tenant=<tenant>; levels the limits do not define charge nothing.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/client/quotahttp"
)

type job struct {
	id      int
	tenant  string
	attempt uint32
}

type tenantKey struct{}

func main() {
	conn := client.Flags(flag.CommandLine, "127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103") // and $QUOTAD_* (source dev.env)
	domain := flag.String("domain", "provider", "quota domain of the provider")
	endpoint := flag.String("endpoint", "sync", "descriptor endpoint=VALUE before tenant=...; empty: tenant only")
	tenants := flag.Int("tenants", 4, "number of tenants; tenant 0 submits half of all jobs")
	workers := flag.Int("workers", 32, "worker goroutines")
	jobs := flag.Int("jobs", 400, "jobs to run")
	providerURL := flag.String("provider-url", "", "provider URL (default: start a fake provider on loopback)")
	providerRPS := flag.Int("provider-rps", 50, "fake provider's own limit in requests per second")
	timeout := flag.Duration("timeout", 2*time.Minute, "give up after this long")
	spread := flag.Duration("spread", 500*time.Millisecond, "rescheduled jobs wake at RetryAt plus a random delay up to this")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()

	url := *providerURL
	var provider *fakeProvider
	if url == "" {
		var err error
		provider, url, err = startFakeProvider(*providerRPS)
		if err != nil {
			log.Fatal(err)
		}
	}

	qc, err := client.New(conn())
	if err != nil {
		log.Fatal(err)
	}
	defer qc.Close()

	var providerThrottles atomic.Int64
	hc := &http.Client{Transport: &quotahttp.Transport{
		Client: qc,
		Request: func(r *http.Request) (client.Request, error) {
			j, _ := r.Context().Value(tenantKey{}).(*job)
			if j == nil {
				return client.Request{}, errors.New("request has no job")
			}
			descs := client.Descriptors("tenant", j.tenant)
			if *endpoint != "" {
				descs = append(client.Descriptors("endpoint", *endpoint), descs...)
			}
			return client.Request{Domain: *domain, Descriptors: descs, Attempt: j.attempt}, nil
		},
		ReasonHeader: "X-Provider-Limit-Reason",
		OnFeedback: func(_ *http.Request, f client.Feedback, res client.FeedbackResult, err error) {
			providerThrottles.Add(1)
			if err != nil {
				log.Printf("feedback for a provider %d: %v", f.StatusCode, err)
			}
		},
	}}

	// The queue: due jobs on a channel, future ones parked on timers.
	queue := make(chan *job, *jobs)
	var remaining sync.WaitGroup
	for i := range *jobs {
		t := 0
		if i%2 == 1 && *tenants > 1 {
			t = 1 + i/2%(*tenants-1)
		}
		remaining.Add(1)
		queue <- &job{id: i, tenant: fmt.Sprintf("tenant-%d", t), attempt: 1}
	}
	reschedule := func(j *job, at time.Time) {
		// Spread wake-ups so rescheduled jobs do not all return at the same instant (a
		// backlog of jobs polling at every RetryAt would turn into a denial storm).
		d := time.Until(at) + time.Duration(rand.Int64N(int64(*spread)+1))
		time.AfterFunc(d, func() { queue <- j })
	}

	var denied, done atomic.Int64
	perTenant := sync.Map{}
	start := time.Now()
	for range *workers {
		go func() {
			for {
				var j *job
				select {
				case j = <-queue:
				case <-ctx.Done():
					return
				}
				req, _ := http.NewRequestWithContext(context.WithValue(ctx, tenantKey{}, j), "GET", url, nil)
				resp, err := hc.Do(req)
				var de *client.DeniedError
				switch {
				case errors.As(err, &de):
					denied.Add(1)
					reschedule(j, de.Decision.RetryAt())
				case err != nil:
					if ctx.Err() == nil {
						log.Printf("job %d: %v", j.id, err)
						reschedule(j, time.Now().Add(time.Second))
					}
				default:
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close() // releases the lease, if the path holds one
					if resp.StatusCode != http.StatusOK {
						j.attempt++
						ra, _ := quotahttp.ParseRetryAfter(resp.Header.Get("Retry-After"), time.Now())
						reschedule(j, time.Now().Add(ra))
						continue
					}
					done.Add(1)
					n, _ := perTenant.LoadOrStore(j.tenant, new(atomic.Int64))
					n.(*atomic.Int64).Add(1)
					remaining.Done()
				}
			}
		}()
	}
	finished := make(chan struct{})
	go func() { remaining.Wait(); close(finished) }()
	select {
	case <-finished:
	case <-ctx.Done():
		log.Printf("stopped: %v", ctx.Err())
	}
	elapsed := time.Since(start)
	fmt.Printf("done %d/%d jobs in %v (%.1f/s); quotad denials %d; provider throttles %d\n",
		done.Load(), *jobs, elapsed.Round(time.Millisecond), float64(done.Load())/elapsed.Seconds(), denied.Load(), providerThrottles.Load())
	for t := range *tenants {
		name := fmt.Sprintf("tenant-%d", t)
		n, _ := perTenant.LoadOrStore(name, new(atomic.Int64))
		fmt.Printf("  %s: %d\n", name, n.(*atomic.Int64).Load())
	}
	if provider != nil {
		fmt.Printf("fake provider: %d served, %d answered 429\n", provider.served.Load(), provider.throttled.Load())
	}
	s := qc.Stats()
	fmt.Printf("client: %d admissions in %d RPCs (%d batches), %d retries\n", s.Admissions, s.RPCs, s.Batches, s.Retries)
}

// fakeProvider allows rps requests per second (token bucket, burst rps) and answers 429 with
// Retry-After: 1 beyond that.
type fakeProvider struct {
	mu                sync.Mutex
	tokens            float64
	last              time.Time
	rps               float64
	served, throttled atomic.Int64
}

func startFakeProvider(rps int) (*fakeProvider, string, error) {
	p := &fakeProvider{tokens: float64(rps), last: time.Now(), rps: float64(rps)}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", err
	}
	go http.Serve(ln, p)
	return p, "http://" + ln.Addr().String() + "/v1/things", nil
}

func (p *fakeProvider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	now := time.Now()
	p.tokens = min(p.rps, p.tokens+now.Sub(p.last).Seconds()*p.rps)
	p.last = now
	ok := p.tokens >= 1
	if ok {
		p.tokens--
	}
	p.mu.Unlock()
	if !ok {
		p.throttled.Add(1)
		w.Header().Set("Retry-After", "1")
		w.Header().Set("X-Provider-Limit-Reason", "global-rate")
		http.Error(w, "slow down", http.StatusTooManyRequests)
		return
	}
	p.served.Add(1)
	io.WriteString(w, `{"ok":true}`)
}
