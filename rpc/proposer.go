package rpc

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	"github.com/quotad/quotad/fsm"
)

// Applier is what the proposer needs of a cluster node (cluster.Node implements it).
type Applier interface {
	// ApplyNow takes the leader's FSM timestamp (an error if this node is not an established
	// leader), commits the entry encode builds from it and from the command version to write
	// it at (0: this build's), and returns the FSM's response and the timestamp
	// (cluster.Node.ApplyNow, cluster.Node.CommandVersion).
	ApplyNow(ctx context.Context, encode func(ts int64, version int) []byte) (any, int64, error)
	// EnqueueNow is ApplyNow's first half: it stamps and queues the entry and returns the
	// wait for its commit; entries queued by successive calls from one goroutine reach the
	// log in that order (cluster.Node.EnqueueNow).
	EnqueueNow(ctx context.Context, encode func(ts int64, version int) []byte) (func() (any, int64, error), error)
}

// ProposerConfig tunes group commit.
type ProposerConfig struct {
	// MaxBatch caps the operations in one log entry.
	MaxBatch int
	// MaxInflight is how many log entries may be committing at once. While they commit, new
	// operations queue and go out together in the next entry.
	MaxInflight int
	// ApplyTimeout bounds one raft apply.
	ApplyTimeout time.Duration
}

// DefaultProposerConfig returns settings measured on a 2-core machine (see docs/performance.md).
func DefaultProposerConfig() ProposerConfig {
	return ProposerConfig{MaxBatch: 1024, MaxInflight: 2, ApplyTimeout: 5 * time.Second}
}

// Validate reports a setting that cannot work, quoting it.
func (c ProposerConfig) Validate() error {
	switch {
	case c.MaxBatch < 1 || c.MaxBatch > 1<<16:
		return fmt.Errorf("rpc: MaxBatch (--max-entry-ops) is %d; use 1 to 65536 (default %d)", c.MaxBatch, DefaultProposerConfig().MaxBatch)
	case c.MaxInflight < 1 || c.MaxInflight > 64:
		return fmt.Errorf("rpc: MaxInflight (--max-entries-in-flight) is %d; use 1 to 64 (default %d)", c.MaxInflight, DefaultProposerConfig().MaxInflight)
	}
	return nil
}

// proposer coalesces concurrent operations into shared log entries (group commit): it takes
// whatever has queued, stamps one timestamp, commits one entry, and hands each caller its own
// result. Under no load an operation goes out at once; under load the batch grows by itself.
//
// Ops arrive already encoded (each caller encodes its own, in parallel) and a whole call's
// ops are queued under one lock and answered through one channel: per op there is no
// channel operation and no allocation on the single goroutine that cuts entries.
type proposer struct {
	node Applier
	cfg  ProposerConfig
	// ordered: entries reach Raft in the order their ops were submitted (newOrderedProposer).
	ordered bool

	mu      sync.Mutex
	queue   []queuedOp
	drained chan struct{} // closed (and replaced) whenever the loop takes ops off the queue
	wake    chan struct{} // capacity 1: the queue became non-empty
	slots   chan struct{}
	stop    chan struct{}
	stopped sync.WaitGroup
	// observe, if set, is told the size and commit latency of each entry (metrics).
	observe func(ops int, took time.Duration, err error)
	// directs counts calls that committed from their own goroutine (do).
	directs atomic.Uint64
}

// queuedOp is one encoded op of a call, waiting for an entry.
type queuedOp struct {
	data []byte
	c    *call
	i    int
}

// call is one caller's ops; results[i] answers ops[i]. done is closed when all are answered.
type call struct {
	results []proposalResult
	left    atomic.Int32
	done    chan struct{}
}

// proposalResult answers one op: res points into the entry's fsm.Result (no copy of it per
// op); it is nil when err is set.
type proposalResult struct {
	res *fsm.OpResult
	err error
	// ts is the timestamp (leader FSM time) stamped on the op's entry: a scheduled grant
	// (Decision.RetryAfter on an admission) takes effect RetryAfter after it.
	ts int64
}

// errStopped: the proposer is shutting down.
var errStopped = errors.New("rpc: server is shutting down")

func newProposer(node Applier, cfg ProposerConfig) *proposer { return startProposer(node, cfg, false) }

// newOrderedProposer is a proposer whose entries reach Raft in the order their ops were
// submitted, also with several entries committing at once: its loop stamps and queues each
// entry in Raft itself, one after the other, and only the wait for the commit runs on a
// goroutine of its own (newProposer's loop hands each entry to a goroutine that stamps and
// queues it, and MaxInflight of those race each other to Raft's queue). There is no direct
// path (a caller's goroutine committing would race the loop). The waiting lane's (fair.prop):
// the scheduler submits its batches in release order, and the FSM must grant them in it.
func newOrderedProposer(node Applier, cfg ProposerConfig) *proposer {
	return startProposer(node, cfg, true)
}

func startProposer(node Applier, cfg ProposerConfig, ordered bool) *proposer {
	if cfg.MaxBatch <= 0 {
		cfg.MaxBatch = DefaultProposerConfig().MaxBatch
	}
	if cfg.MaxInflight <= 0 {
		cfg.MaxInflight = DefaultProposerConfig().MaxInflight
	}
	if cfg.ApplyTimeout <= 0 {
		cfg.ApplyTimeout = DefaultProposerConfig().ApplyTimeout
	}
	p := &proposer{
		node:    node,
		cfg:     cfg,
		ordered: ordered,
		drained: make(chan struct{}),
		wake:    make(chan struct{}, 1),
		slots:   make(chan struct{}, cfg.MaxInflight),
		stop:    make(chan struct{}),
	}
	p.stopped.Add(1)
	go p.loop()
	return p
}

// maxQueued bounds the ops waiting for an entry; a caller beyond it waits for room (or for
// its context), which pushes back on clients when the log cannot keep up.
func (p *proposer) maxQueued() int { return p.cfg.MaxBatch * (p.cfg.MaxInflight + 2) }

// propose submits one op and waits for its result. If ctx ends first the outcome is unknown:
// the operation may still commit (which is why admissions carry request IDs).
func (p *proposer) propose(ctx context.Context, op *fsmv1.Op) (fsm.OpResult, error) {
	data, err := fsm.EncodeOp(op)
	if err != nil {
		return fsm.OpResult{}, fmt.Errorf("rpc: encoding an op: %w", err)
	}
	c, err := p.do(ctx, [][]byte{data})
	if err != nil {
		return fsm.OpResult{}, err
	}
	r := c.results[0]
	if r.err != nil {
		return fsm.OpResult{}, r.err
	}
	return *r.res, nil
}

// do commits a call's encoded ops and waits for their results (submit, then wait). When the
// proposer is idle — nothing queued and a commit slot free — the caller's goroutine commits
// the ops itself, as the loop would have at once: the entry and its timing are the same, but a
// lone call (the serial path) skips two goroutine hand-offs and a new goroutine (the loop's
// wake-up, its commit goroutine, the answer back). Under load the queue is not empty and
// calls go through the loop and batch as before.
func (p *proposer) do(ctx context.Context, ops [][]byte) (*call, error) {
	c, ok := p.direct(ops)
	if !ok {
		var err error
		if c, err = p.submit(ctx, ops); err != nil {
			return nil, err
		}
	}
	if err := p.wait(ctx, c); err != nil {
		return nil, err
	}
	return c, nil
}

// direct starts committing ops at once if the proposer is idle (see do); ok is false (and
// nothing happened) otherwise. The commit runs detached from the caller, as the loop's do: the
// caller's context ending (its wait returns, the outcome unknown) must not free the commit
// slot while the entry is still in Raft — review: short-deadline callers during an fsync stall
// would each free their slot and go direct again, hundreds of one-op entries instead of a few
// batched ones, exactly when the log is slow.
func (p *proposer) direct(ops [][]byte) (*call, bool) {
	if p.ordered || len(ops) == 0 || len(ops) > p.cfg.MaxBatch {
		return nil, false
	}
	select {
	case <-p.stop:
		return nil, false // submit reports it
	default:
	}
	p.mu.Lock()
	if len(p.queue) > 0 {
		p.mu.Unlock()
		return nil, false
	}
	select {
	case p.slots <- struct{}{}:
	default:
		p.mu.Unlock()
		return nil, false
	}
	p.mu.Unlock()
	p.directs.Add(1)
	c := &call{results: make([]proposalResult, len(ops)), done: make(chan struct{})}
	c.left.Store(int32(len(ops)))
	batch := make([]queuedOp, len(ops))
	for i, op := range ops {
		batch[i] = queuedOp{data: op, c: c, i: i}
	}
	go p.commit(batch)
	return c, true
}

// submit queues a call's encoded ops, in order, for the next log entries.
func (p *proposer) submit(ctx context.Context, ops [][]byte) (*call, error) {
	c := &call{results: make([]proposalResult, len(ops)), done: make(chan struct{})}
	c.left.Store(int32(len(ops)))
	for i := 0; i < len(ops); {
		p.mu.Lock()
		room := p.maxQueued() - len(p.queue)
		if room <= 0 {
			drained := p.drained
			p.mu.Unlock()
			select {
			case <-drained:
				continue
			case <-ctx.Done():
				// Ops already queued still commit; their callers' outcome is unknown anyway.
				return nil, ctx.Err()
			case <-p.stop:
				return nil, errStopped
			}
		}
		for ; i < len(ops) && room > 0; i, room = i+1, room-1 {
			p.queue = append(p.queue, queuedOp{data: ops[i], c: c, i: i})
		}
		p.mu.Unlock()
		select {
		case p.wake <- struct{}{}:
		default:
		}
	}
	return c, nil
}

// wait waits until every op of c is answered (results in c.results) or ctx ends.
func (p *proposer) wait(ctx context.Context, c *call) error {
	select {
	case <-c.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-p.stop:
		return errStopped
	}
}

func (c *call) answer(i int, r proposalResult) {
	c.results[i] = r
	if c.left.Add(-1) == 0 {
		close(c.done)
	}
}

func (p *proposer) close() {
	close(p.stop)
	p.stopped.Wait()
}

func (p *proposer) loop() {
	defer p.stopped.Done()
	for {
		select {
		case <-p.wake:
		case <-p.stop:
			return
		}
		for {
			// Wait for a commit slot before taking the batch: while the previous entries
			// commit, more ops queue up and ride along.
			select {
			case p.slots <- struct{}{}:
			case <-p.stop:
				return
			}
			p.mu.Lock()
			n := min(len(p.queue), p.cfg.MaxBatch)
			if n == 0 {
				p.mu.Unlock()
				<-p.slots
				break
			}
			batch := make([]queuedOp, n)
			copy(batch, p.queue)
			rest := copy(p.queue, p.queue[n:])
			clear(p.queue[rest:])
			p.queue = p.queue[:rest]
			close(p.drained)
			p.drained = make(chan struct{})
			p.mu.Unlock()
			if p.ordered {
				p.enqueue(batch)
			} else {
				go p.commit(batch)
			}
		}
	}
}

func (p *proposer) commit(batch []queuedOp) { p.commitCtx(context.Background(), batch) }

// commitCtx commits batch as one entry, frees the commit slot its caller took, then answers
// its ops. ctx (with ApplyTimeout) bounds the wait.
func (p *proposer) commitCtx(ctx context.Context, batch []queuedOp) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, p.cfg.ApplyTimeout)
	defer cancel()
	out, ts, err := p.node.ApplyNow(ctx, p.encode(batch))
	p.finish(batch, start, out, ts, err)
}

// enqueue stamps batch's entry and queues it in Raft from the calling goroutine (the
// ordered proposer's loop: entries reach the log in the order it takes batches), then waits
// for the commit, frees the slot and answers the ops on a goroutine of its own, as commit.
func (p *proposer) enqueue(batch []queuedOp) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.ApplyTimeout)
	wait, err := p.node.EnqueueNow(ctx, p.encode(batch))
	if err != nil {
		cancel()
		p.finish(batch, start, nil, 0, err)
		return
	}
	go func() {
		defer cancel()
		out, ts, err := wait()
		p.finish(batch, start, out, ts, err)
	}()
}

// finish frees the commit slot of batch's entry, resolved with the FSM's response out (or
// err), then answers its ops: a caller that goes again as soon as it has its answer finds
// the proposer idle (the direct path).
func (p *proposer) finish(batch []queuedOp, start time.Time, out any, ts int64, err error) {
	var res *fsm.Result
	if err == nil {
		var ok bool
		if res, ok = out.(*fsm.Result); !ok || len(res.Ops) != len(batch) {
			err = fmt.Errorf("rpc: the FSM answered %T for a command of %d ops", out, len(batch))
		}
	}
	if p.observe != nil {
		p.observe(len(batch), time.Since(start), err)
	}
	<-p.slots
	for i, q := range batch {
		if err != nil {
			q.c.answer(q.i, proposalResult{err: err})
			continue
		}
		q.c.answer(q.i, proposalResult{res: &res.Ops[i], ts: ts})
	}
}

// stampedHook, if set (tests only), runs in every proposal between taking its timestamp and
// queueing its entry in raft. Atomic: tests set and clear it while clusters run.
var stampedHook atomic.Pointer[func()]

// encode returns what builds batch's entry from its timestamp (cluster.Node.ApplyNow).
func (p *proposer) encode(batch []queuedOp) func(ts int64, version int) []byte {
	ops := make([][]byte, len(batch))
	for i, q := range batch {
		ops[i] = q.data
	}
	// Timestamp and enqueue are one step a snapshot restore excludes (cluster.Node.ApplyNow).
	return func(ts int64, version int) []byte {
		if h := stampedHook.Load(); h != nil {
			(*h)()
		}
		return fsm.EncodeEntryAt(version, ts, ops)
	}
}
