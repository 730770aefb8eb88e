package rpc

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	"github.com/quotad/quotad/fsm"
)

// gatedApplier is an Applier whose commits wait for the test: each Apply records its entry's
// ops (their owners, from Release ops) and blocks until gate lets it through. It stands in
// for the cluster node only where the test must hold a commit in flight; the real path is
// covered by the server tests on real clusters.
type gatedApplier struct {
	mu      sync.Mutex
	entries [][]string
	started chan struct{} // one send per Apply, before it waits
	gate    chan struct{} // one receive per Apply
}

func newGatedApplier() *gatedApplier {
	return &gatedApplier{started: make(chan struct{}, 16), gate: make(chan struct{}, 16)}
}

func (g *gatedApplier) ApplyNow(ctx context.Context, encode func(ts int64, version int) []byte) (any, int64, error) {
	wait, err := g.EnqueueNow(ctx, encode)
	if err != nil {
		return nil, 0, err
	}
	return wait()
}

// EnqueueNow records the entry at once (its place in the "log") and returns the wait for
// the gate.
func (g *gatedApplier) EnqueueNow(ctx context.Context, encode func(ts int64, version int) []byte) (func() (any, int64, error), error) {
	ts := time.Now().UnixNano()
	var cmd fsmv1.Command
	if err := proto.Unmarshal(encode(ts, 0), &cmd); err != nil {
		return nil, err
	}
	var ids []string
	for _, op := range cmd.Ops {
		ids = append(ids, op.GetRelease().GetOwner())
	}
	g.mu.Lock()
	g.entries = append(g.entries, ids)
	g.mu.Unlock()
	g.started <- struct{}{}
	return func() (any, int64, error) {
		select {
		case <-g.gate:
		case <-ctx.Done():
			return nil, 0, ctx.Err()
		}
		return &fsm.Result{Ops: make([]fsm.OpResult, len(cmd.Ops))}, ts, nil
	}, nil
}

func (g *gatedApplier) got() [][]string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([][]string(nil), g.entries...)
}

func releaseOp(t *testing.T, id string) []byte {
	t.Helper()
	b, err := fsm.EncodeOp(&fsmv1.Op{Op: &fsmv1.Op_Release{Release: &fsmv1.Release{LeaseId: 1, Owner: id}}})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func waitStarted(t *testing.T, g *gatedApplier) {
	t.Helper()
	select {
	case <-g.started:
	case <-time.After(5 * time.Second):
		t.Fatal("no commit started")
	}
}

// An idle proposer commits a lone call from the caller's goroutine; a call that finds a
// commit in flight with no slot free, or ops already queued, goes through the loop behind
// them, so ops keep their order.
func TestProposerDirectOnlyWhenIdle(t *testing.T) {
	g := newGatedApplier()
	p := newProposer(g, ProposerConfig{MaxBatch: 16, MaxInflight: 1, ApplyTimeout: 5 * time.Second})
	defer p.close()
	ctx := context.Background()

	// Idle: direct. The commit runs in this goroutine, so let it through before the call.
	g.gate <- struct{}{}
	c, err := p.do(ctx, [][]byte{releaseOp(t, "a")})
	if err != nil || c.results[0].err != nil {
		t.Fatalf("idle call: %v %v", err, c.results[0].err)
	}
	<-g.started
	if n := p.directs.Load(); n != 1 {
		t.Fatalf("idle call: %d direct commits, want 1", n)
	}

	// Busy: "b" holds the only slot (direct, blocked in Apply); "c" then finds no slot and
	// queues; "d" finds "c" queued and queues behind it.
	type res struct {
		id  string
		err error
	}
	done := make(chan res, 3)
	call := func(id string) {
		c, err := p.do(ctx, [][]byte{releaseOp(t, id)})
		if err == nil {
			err = c.results[0].err
		}
		done <- res{id, err}
	}
	go call("b")
	waitStarted(t, g)
	go call("c")
	waitQueued(t, p, 1)
	go call("d")
	waitQueued(t, p, 2)
	if n := p.directs.Load(); n != 2 {
		t.Fatalf("%d direct commits after b, c and d, want 2 (a and b; c and d found the proposer busy)", n)
	}
	for range 2 {
		g.gate <- struct{}{}
	}
	for range 3 {
		r := <-done
		if r.err != nil {
			t.Fatalf("call %s: %v", r.id, r.err)
		}
	}
	want := [][]string{{"a"}, {"b"}, {"c", "d"}}
	if got := g.got(); len(got) != len(want) || len(got[2]) != 2 || got[1][0] != "b" || got[2][0] != "c" || got[2][1] != "d" {
		t.Fatalf("entries %v, want %v", got, want)
	}

	// Idle again: direct again — once the loop has parked. A wake signal left from "d" makes
	// it take a slot, find the queue empty and give the slot back; a call in that moment found
	// no slot and queued (make test -race, once: "2 direct commits, want 3").
	waitParked(t, p)
	g.gate <- struct{}{}
	if _, err := p.do(ctx, [][]byte{releaseOp(t, "e")}); err != nil {
		t.Fatal(err)
	}
	if n := p.directs.Load(); n != 3 {
		t.Fatalf("%d direct commits, want 3", n)
	}
}

// A direct call whose context ends while its entry commits returns with the context's error
// (the outcome is unknown, as on the queued path); its entry keeps the commit slot until it
// resolves (a caller giving up must not let more entries into Raft than MaxInflight), then
// the slot is free for the next call.
func TestProposerDirectHonorsContext(t *testing.T) {
	g := newGatedApplier()
	p := newProposer(g, ProposerConfig{MaxBatch: 16, MaxInflight: 1, ApplyTimeout: 5 * time.Second})
	defer p.close()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	c, err := p.do(ctx, [][]byte{releaseOp(t, "x")})
	if err == nil {
		err = c.results[0].err
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err %v, want the context's deadline", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("returned after %v, want about the context's 50 ms", d)
	}
	<-g.started
	time.Sleep(20 * time.Millisecond)
	if n := len(p.slots); n != 1 {
		t.Fatalf("%d commit slots held after the caller gave up, want 1: its entry is still being applied", n)
	}
	g.gate <- struct{}{}
	for deadline := time.Now().Add(2 * time.Second); len(p.slots) != 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the slot was not freed after the entry resolved")
		}
	}
	g.gate <- struct{}{} // y's entry applies at once
	if c, err := p.do(context.Background(), [][]byte{releaseOp(t, "y")}); err != nil || c.results[0].err != nil {
		t.Fatalf("next call: %v", err)
	}
	if n := p.directs.Load(); n != 2 {
		t.Fatalf("%d direct commits, want 2 (the slot was freed)", n)
	}
}

// waitParked waits until p's loop has no pending wake and holds no commit slot, twice 5 ms
// apart (it then waits in its select for the next wake).
func waitParked(t *testing.T, p *proposer) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for quiet := 0; quiet < 2; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the proposer's loop never parked")
		}
		if len(p.wake) == 0 && len(p.slots) == 0 {
			quiet++
		} else {
			quiet = 0
		}
	}
}

func waitQueued(t *testing.T, p *proposer, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		p.mu.Lock()
		q := len(p.queue)
		p.mu.Unlock()
		if q == n {
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("queue never held %d ops", n)
}

// The ordered proposer queues its entries in Raft one after the other from its loop, yet
// keeps MaxInflight of them committing at once: the second entry is queued while the first
// still commits (waiting for each commit before queueing the next would cap the waiting
// lane at one entry per commit latency), and a third waits for a free slot.
func TestOrderedProposerKeepsEntriesInFlight(t *testing.T) {
	g := newGatedApplier()
	p := newOrderedProposer(g, ProposerConfig{MaxBatch: 1, MaxInflight: 2, ApplyTimeout: 5 * time.Second})
	defer p.close()
	ctx := context.Background()
	var calls []*call
	for _, id := range []string{"a", "b", "c"} {
		c, err := p.submit(ctx, [][]byte{releaseOp(t, id)})
		if err != nil {
			t.Fatal(err)
		}
		calls = append(calls, c)
	}
	waitStarted(t, g)
	waitStarted(t, g) // b queued in Raft while a still commits
	time.Sleep(20 * time.Millisecond)
	if got := fmt.Sprint(g.got()); got != "[[a] [b]]" {
		t.Fatalf("entries %s with two commit slots, both held, want [[a] [b]]", got)
	}
	g.gate <- struct{}{} // one commit resolves: c takes its slot
	waitStarted(t, g)
	g.gate <- struct{}{}
	g.gate <- struct{}{}
	for i, c := range calls {
		if err := p.wait(ctx, c); err != nil || c.results[0].err != nil {
			t.Fatalf("call %d: %v %v", i, err, c.results[0].err)
		}
	}
	if got := fmt.Sprint(g.got()); got != "[[a] [b] [c]]" {
		t.Fatalf("entries %s, want [[a] [b] [c]]", got)
	}
	if n := p.directs.Load(); n != 0 {
		t.Fatalf("%d direct commits: the ordered proposer has no direct path (it would race the loop)", n)
	}
}
