package e2e

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/quotad/quotad/client"
)

// streamLimits paces waiters at 200/s below a domain level that does not refill during a test
// (a year's unit, a large burst): burst − remaining counts every debit.
const streamLimits = `
domain: counted
rate_limit: {unit: year, requests_per_unit: 1, burst: 1000000}
descriptors:
  - key: pace
    rate_limit: {unit: second, requests_per_unit: 200, burst: 1}
`

// TestStreamLeaderPausedFallsBackToUnary: the leader process is stopped (SIGSTOP: its
// connections stay open, nothing answers) while a client's stream carries waiting admissions.
// The client gives up on the stream after AttemptTimeout plus the admissions' max wait and
// decides every one of them unary on the new leader with the same request IDs: every caller
// gets an outcome, and the cluster debited admitted ≤ debits ≤ admitted + unknown outcomes.
func TestStreamLeaderPausedFallsBackToUnary(t *testing.T) {
	if testing.Short() {
		t.Skip("process cluster")
	}
	c := startClusterWith(t, 3, streamLimits)
	cfg := c.ClientConfig()
	cfg.AttemptTimeout = time.Second
	cl, err := client.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	leader, err := c.WaitLeader(15 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	// One wait first: the stream is open to the leader before the load.
	if _, err := cl.Wait(ctx, client.Request{Domain: "counted", Descriptors: client.Descriptors("pace", "warm")}); err != nil {
		t.Fatal(err)
	}

	const n = 300
	var (
		mu                            sync.Mutex
		admitted, denied, unavailable int
		other                         []error
		wg                            sync.WaitGroup
	)
	for range n {
		wg.Go(func() {
			d, err := cl.Wait(ctx, client.Request{Domain: "counted", Descriptors: client.Descriptors("pace", "p"), MaxWait: 2 * time.Second})
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil && d.Admitted:
				admitted++
			case errors.Is(err, client.ErrDenied):
				denied++
			case errors.Is(err, client.ErrUnavailable):
				unavailable++
			default:
				other = append(other, err)
			}
		})
	}
	time.Sleep(300 * time.Millisecond) // a third of the load decided, the rest waiting
	before := cl.Stats()
	c.Pause(leader)
	resumed := false
	defer func() {
		if !resumed {
			c.Resume(leader)
		}
	}()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatal("callers still waiting after a minute")
	}
	c.Resume(leader)
	resumed = true
	st := cl.Stats()
	t.Logf("paused node%d with %d admissions sent on the stream: admitted %d, denied %d, unavailable %d, other %v; client %+v",
		leader, before.StreamAdmissions, admitted, denied, unavailable, other, st)
	if len(other) > 0 {
		t.Fatalf("unexpected outcomes: %v", other)
	}
	if st.StreamFallbacks == 0 {
		t.Fatal("nothing fell back to unary: the pause did not catch admissions on the stream")
	}
	if admitted < n/2 {
		t.Fatalf("only %d of %d admitted", admitted, n)
	}
	got, err := debited(ctx, cl)
	if err != nil {
		t.Fatal(err)
	}
	if got < uint64(admitted+1) || got > uint64(admitted+1+unavailable) { // +1: the warm-up
		t.Fatalf("the cluster debited %d units; the client saw %d admitted (+1 warm-up) and %d unknown outcomes", got, admitted, unavailable)
	}
}

// debited is burst − remaining of the counted domain's own level.
func debited(ctx context.Context, cl *client.Client) (uint64, error) {
	s, err := cl.Status(ctx, "counted")
	if err != nil {
		return 0, err
	}
	for _, b := range s.Buckets {
		if b.Scope == "domain" {
			return b.Burst - b.Remaining, nil
		}
	}
	return 0, fmt.Errorf("no domain bucket in %+v", s)
}

// TestStreamStalledLeaderIsLeft: the leader process is stopped (SIGSTOP) for 12 s while
// workers call Wait with a 2 s deadline (no MaxWait: each asks the leader to queue it for most
// of its deadline, so no admission's own timer ever gives up on the stream). The leader sends
// a heartbeat every second while admissions are undecided; the client takes its silence as a
// stall and goes to another node, so admissions resume within seconds of the new leader, not
// when the stopped one comes back (trial: none for the whole 15 s of a stop). Debits stay
// within admitted … admitted + unknown outcomes.
func TestStreamStalledLeaderIsLeft(t *testing.T) {
	if testing.Short() {
		t.Skip("process cluster")
	}
	c := startClusterWith(t, 3, streamLimits)
	cl, err := client.New(c.ClientConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	leader, err := c.WaitLeader(15 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Wait(ctx, client.Request{Domain: "counted", Descriptors: client.Descriptors("pace", "warm")}); err != nil {
		t.Fatal(err)
	}
	var (
		mu                    sync.Mutex
		admittedAt            []time.Time
		admitted, unavailable int
		other                 []error
		wg                    sync.WaitGroup
	)
	stop := make(chan struct{})
	for range 50 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				wctx, wc := context.WithTimeout(ctx, 2*time.Second)
				d, err := cl.Wait(wctx, client.Request{Domain: "counted", Descriptors: client.Descriptors("pace", "p")})
				wc()
				mu.Lock()
				switch {
				case err == nil && d.Admitted:
					admitted++
					admittedAt = append(admittedAt, time.Now())
				case errors.Is(err, client.ErrUnavailable), errors.Is(err, client.ErrDenied):
					unavailable++ // a denial at its deadline may follow an unknown outcome too
				default:
					other = append(other, err)
				}
				mu.Unlock()
			}
		})
	}
	time.Sleep(time.Second)
	paused := time.Now()
	c.Pause(leader)
	resumed := false
	defer func() {
		if !resumed {
			c.Resume(leader)
		}
	}()
	time.Sleep(12 * time.Second)
	c.Resume(leader)
	resumed = true
	close(stop)
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	var first time.Time
	for _, at := range admittedAt {
		if at.After(paused.Add(500*time.Millisecond)) && (first.IsZero() || at.Before(first)) {
			first = at
		}
	}
	st := cl.Stats()
	t.Logf("node%d stopped for 12 s: first admission %v after the stop; admitted %d, unknown or denied %d; client %+v",
		leader, first.Sub(paused).Round(time.Millisecond), admitted, unavailable, st)
	if len(other) > 0 {
		t.Fatalf("unexpected outcomes: %v", other[:min(len(other), 5)])
	}
	if first.IsZero() || first.Sub(paused) > 8*time.Second {
		t.Fatalf("no admission within 8 s of stopping the leader (first %v after): the client stayed on the stopped leader's stream", first.Sub(paused))
	}
	if st.StreamStalls == 0 {
		t.Fatal("no stream was given up as stalled")
	}
	got, err := debited(ctx, cl)
	if err != nil {
		t.Fatal(err)
	}
	if got < uint64(admitted+1) || got > uint64(admitted+1+unavailable) { // +1: the warm-up
		t.Fatalf("the cluster debited %d units; the client saw %d admitted (+1 warm-up) and %d unknown outcomes", got, admitted, unavailable)
	}
}
