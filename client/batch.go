package client

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// pending is one caller's admission waiting in (or for) a batch.
type pending struct {
	ctx  context.Context
	adm  *quotadv1.Admission
	done chan result // buffered: the sender never blocks on a caller that left
	// tries are the attempts of the batch that carries it (nil until it is sent), so a caller
	// that gives up can say why the batch got no answer.
	tries atomic.Pointer[tries]
}

// tries counts a batch's RPC attempts and keeps each node's last error. Safe for concurrent
// use (the batch's sender writes, its callers read).
type tries struct {
	mu     sync.Mutex
	n      int
	byNode nodeErrors
}

// record counts an attempt against the node at addr and its error.
func (t *tries) record(addr string, err error) {
	t.mu.Lock()
	t.n++
	if err != nil {
		t.byNode.add(addr, err)
	}
	t.mu.Unlock()
}

// get returns the attempts so far and the nodes' last errors (0, nil for a nil t).
func (t *tries) get() (int, error) {
	if t == nil {
		return 0, nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.n, t.byNode.err()
}

type result struct {
	d   *quotadv1.Decision
	at  time.Time
	err error
}

// batcher coalesces admissions from concurrent callers into Acquire RPCs. When no batch is in
// flight an admission is sent at once (with whatever else is already queued); otherwise the
// first admission of a batch opens a window of cfg.Window, and the batch is sent when the
// window closes or it reaches cfg.MaxSize. Batches are sent concurrently; each caller gets its
// own decision.
type batcher struct {
	c       *Client
	in      chan *pending
	window  time.Duration
	maxSize int
	// inflight counts batches being sent.
	inflight atomic.Int64
	stop     chan struct{}
	stopped  chan struct{}
	// latest are the attempts of the batch sent last: why a caller still queued behind it
	// got nothing.
	latest atomic.Pointer[tries]
}

func newBatcher(c *Client, cfg BatchConfig) *batcher {
	b := &batcher{
		c:       c,
		in:      make(chan *pending, cfg.MaxSize),
		window:  cfg.Window,
		maxSize: cfg.MaxSize,
		stop:    make(chan struct{}),
		stopped: make(chan struct{}),
	}
	go b.run()
	return b
}

func (b *batcher) run() {
	defer close(b.stopped)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		var first *pending
		select {
		case first = <-b.in:
		case <-b.stop:
			return
		}
		batch := make([]*pending, 1, b.maxSize)
		batch[0] = first
	drain: // whatever is already waiting goes along at no cost
		for len(batch) < b.maxSize {
			select {
			case p := <-b.in:
				batch = append(batch, p)
			default:
				break drain
			}
		}
		// Only hold the batch open for the window while another batch is on the wire: a
		// lone caller (nothing in flight) is sent at once and pays no window, while under
		// load batches fill up during the round trip of the previous ones.
		if b.inflight.Load() > 0 && len(batch) < b.maxSize {
			b.c.metrics.held.Add(1)
			timer.Reset(b.window)
		collect:
			for len(batch) < b.maxSize {
				select {
				case p := <-b.in:
					batch = append(batch, p)
				case <-timer.C:
					break collect
				case <-b.stop:
					break collect
				}
			}
			timer.Stop()
		}
		b.inflight.Add(1)
		go b.send(batch)
	}
}

// submit queues adm and waits for its decision or for ctx to end.
func (b *batcher) submit(ctx context.Context, adm *quotadv1.Admission) (*quotadv1.Decision, time.Time, error) {
	p := &pending{ctx: ctx, adm: adm, done: make(chan result, 1)}
	select {
	case <-b.c.closing:
		return nil, time.Time{}, ErrClosed
	default:
	}
	select {
	case b.in <- p:
	case <-ctx.Done():
		_, last := b.latest.Load().get()
		return nil, time.Time{}, b.c.unavailable("Acquire", 0, last, ctx.Err())
	case <-b.c.closing:
		return nil, time.Time{}, ErrClosed
	}
	select {
	case r := <-p.done:
		if r.err != nil && ctx.Err() != nil {
			// The batch gave up because this caller did: report the caller's own reason.
			n, _ := p.tries.Load().get()
			return nil, time.Time{}, b.c.unavailable("Acquire", max(n, 1), r.err, ctx.Err())
		}
		return r.d, r.at, r.err
	case <-b.stopped:
		// Closed while queued: the batcher will never take it.
		select {
		case r := <-p.done:
			return r.d, r.at, r.err
		case <-time.After(10 * time.Millisecond):
		}
		return nil, time.Time{}, ErrClosed
	case <-ctx.Done():
		// A decision may have arrived in the same instant; prefer it.
		select {
		case r := <-p.done:
			if r.err == nil {
				return r.d, r.at, nil
			}
		default:
		}
		// The batch may still be retrying: say what its attempts met so far (a plaintext
		// client of a TLS cluster otherwise learns only "context deadline exceeded").
		n, last := p.tries.Load().get()
		if last == nil {
			_, last = b.latest.Load().get()
		}
		return nil, time.Time{}, b.c.unavailable("Acquire", n, last, ctx.Err())
	}
}

// send decides a batch with retries. The RPC lives until it succeeds, fails permanently, or
// every caller in the batch has given up; admissions of callers who gave up are left out of
// later attempts (their request IDs may already be decided; leaving them out never debits
// twice, it only avoids spending quota for nobody).
//
// The batch stops counting as in flight (run holds new batches open only while one is) as
// soon as its RPC is over, before any caller is woken: a serial caller's next admission must
// find nothing in flight and go out at once. Counting it until send returned held that next
// admission for the window whenever the caller was quicker than send's cleanup (1 of 300
// serial calls in TestClusterSerialCallerPaysNoWindow; each such call waits up to Window).
func (b *batcher) send(batch []*pending) {
	landed := sync.OnceFunc(func() { b.inflight.Add(-1) })
	defer landed()
	ctx, cancel := context.WithCancel(b.c.baseCtx)
	defer cancel()
	var live atomic.Int64
	live.Store(int64(len(batch)))
	for _, p := range batch {
		stop := context.AfterFunc(p.ctx, func() {
			if live.Add(-1) == 0 {
				cancel()
			}
		})
		defer stop()
	}
	b.c.metrics.batches.Add(1)
	t := &tries{}
	for _, p := range batch {
		p.tries.Store(t)
	}
	b.latest.Store(t)

	var sent []*pending
	var resp *quotadv1.AcquireResponse
	err := b.c.invoke(ctx, "Acquire", 0, func(ctx context.Context, qc quotadv1.QuotaClient, opts ...grpc.CallOption) error {
		sent = sent[:0]
		req := &quotadv1.AcquireRequest{ClientId: b.c.id, Admissions: make([]*quotadv1.Admission, 0, len(batch))}
		for _, p := range batch {
			if p.ctx.Err() == nil {
				sent = append(sent, p)
				req.Admissions = append(req.Admissions, p.adm)
			}
		}
		if len(sent) == 0 {
			return status.Error(codes.Canceled, "every caller in the batch has given up")
		}
		b.c.metrics.rpcs.Add(1)
		var err error
		resp, err = qc.Acquire(ctx, req, opts...)
		t.record(attemptAddr(ctx), err)
		return err
	})
	at := time.Now()
	landed()
	switch {
	case err == nil && len(resp.GetDecisions()) != len(sent):
		err = fmt.Errorf("quotad: Acquire: the cluster returned %d decisions for %d admissions", len(resp.GetDecisions()), len(sent))
	case errors.Is(err, ErrInvalid) && len(sent) > 1:
		// One malformed admission rejects the whole RPC, and nothing of it was decided:
		// decide each on its own (same request IDs) so the others are not punished.
		for _, p := range sent {
			go func() {
				d, at, err := b.c.acquireOne(p.ctx, p.adm)
				p.done <- result{d: d, at: at, err: err}
			}()
		}
		return
	}
	if err != nil {
		for _, p := range batch {
			p.done <- result{err: err}
		}
		return
	}
	for i, p := range sent {
		p.done <- result{d: resp.Decisions[i], at: at}
	}
}

// acquireOne decides a single admission in its own RPC.
func (c *Client) acquireOne(ctx context.Context, adm *quotadv1.Admission) (*quotadv1.Decision, time.Time, error) {
	req := &quotadv1.AcquireRequest{ClientId: c.id, Admissions: []*quotadv1.Admission{adm}}
	var resp *quotadv1.AcquireResponse
	extra := time.Duration(adm.MaxWaitMs) * time.Millisecond
	err := c.invoke(ctx, "Acquire", extra, func(ctx context.Context, qc quotadv1.QuotaClient, opts ...grpc.CallOption) error {
		c.metrics.rpcs.Add(1)
		var err error
		resp, err = qc.Acquire(ctx, req, opts...)
		return err
	})
	if err != nil {
		return nil, time.Time{}, err
	}
	if len(resp.GetDecisions()) != 1 {
		return nil, time.Time{}, fmt.Errorf("quotad: Acquire: the cluster returned %d decisions for 1 admission", len(resp.GetDecisions()))
	}
	return resp.Decisions[0], time.Now(), nil
}
