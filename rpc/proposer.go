package rpc

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	"github.com/quotad/quotad/fsm"
)

// Applier is what the proposer needs of a cluster node (cluster.Node implements it).
type Applier interface {
	// Now returns the leader's FSM timestamp, or an error if this node is not an established leader.
	Now() (int64, error)
	// Apply commits data to the log and returns the FSM's response.
	Apply(ctx context.Context, data []byte) (any, error)
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

// proposer coalesces concurrent operations into shared log entries (group commit): it takes
// whatever has queued, stamps one timestamp, commits one entry, and hands each caller its own
// result. Under no load an operation goes out at once; under load the batch grows by itself.
type proposer struct {
	node Applier
	cfg  ProposerConfig

	queue   chan *proposal
	slots   chan struct{}
	stop    chan struct{}
	stopped sync.WaitGroup
	// observe, if set, is told the size and commit latency of each entry (metrics).
	observe func(ops int, took time.Duration, err error)
}

type proposal struct {
	op   *fsmv1.Op
	done chan proposalResult
}

type proposalResult struct {
	res fsm.OpResult
	err error
}

var proposalPool = sync.Pool{New: func() any { return &proposal{done: make(chan proposalResult, 1)} }}

// errStopped: the proposer is shutting down.
var errStopped = errors.New("rpc: server is shutting down")

func newProposer(node Applier, cfg ProposerConfig) *proposer {
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
		node:  node,
		cfg:   cfg,
		queue: make(chan *proposal, cfg.MaxBatch*4),
		slots: make(chan struct{}, cfg.MaxInflight),
		stop:  make(chan struct{}),
	}
	p.stopped.Add(1)
	go p.loop()
	return p
}

// propose submits op and waits for its result. If ctx ends first the outcome is unknown: the
// operation may still commit (which is why admissions carry request IDs).
func (p *proposer) propose(ctx context.Context, op *fsmv1.Op) (fsm.OpResult, error) {
	pr, err := p.submit(ctx, op)
	if err != nil {
		return fsm.OpResult{}, err
	}
	return p.wait(ctx, pr)
}

// submit queues op for the next log entry without waiting for it; pair it with wait. Submitting
// all of a call's operations before waiting lets them share entries.
func (p *proposer) submit(ctx context.Context, op *fsmv1.Op) (*proposal, error) {
	pr := proposalPool.Get().(*proposal)
	pr.op = op
	select {
	case p.queue <- pr:
		return pr, nil
	case <-ctx.Done():
		pr.op = nil
		proposalPool.Put(pr)
		return nil, ctx.Err()
	case <-p.stop:
		return nil, errStopped
	}
}

// wait returns the result of a submitted proposal.
func (p *proposer) wait(ctx context.Context, pr *proposal) (fsm.OpResult, error) {
	select {
	case r := <-pr.done:
		pr.op = nil
		proposalPool.Put(pr)
		return r.res, r.err
	case <-ctx.Done():
		// The commit still owns pr (it will write to done); let the collector have it.
		return fsm.OpResult{}, ctx.Err()
	case <-p.stop:
		return fsm.OpResult{}, errStopped
	}
}

func (p *proposer) close() {
	close(p.stop)
	p.stopped.Wait()
}

func (p *proposer) loop() {
	defer p.stopped.Done()
	for {
		var first *proposal
		select {
		case first = <-p.queue:
		case <-p.stop:
			return
		}
		// Wait for a commit slot before collecting the batch: while the previous entries commit,
		// more proposals queue up and ride along.
		select {
		case p.slots <- struct{}{}:
		case <-p.stop:
			first.done <- proposalResult{err: errStopped}
			return
		}
		batch := []*proposal{first}
	collect:
		for len(batch) < p.cfg.MaxBatch {
			select {
			case pr := <-p.queue:
				batch = append(batch, pr)
			default:
				break collect
			}
		}
		go p.commit(batch)
	}
}

func (p *proposer) commit(batch []*proposal) {
	defer func() { <-p.slots }()
	start := time.Now()
	res, err := p.apply(batch)
	if p.observe != nil {
		p.observe(len(batch), time.Since(start), err)
	}
	for i, pr := range batch {
		if err != nil {
			pr.done <- proposalResult{err: err}
			continue
		}
		pr.done <- proposalResult{res: res.Ops[i]}
	}
}

func (p *proposer) apply(batch []*proposal) (*fsm.Result, error) {
	ts, err := p.node.Now()
	if err != nil {
		return nil, err
	}
	cmd := &fsmv1.Command{Ts: ts, Ops: make([]*fsmv1.Op, len(batch))}
	for i, pr := range batch {
		cmd.Ops[i] = pr.op
	}
	data, err := fsm.Encode(cmd)
	if err != nil {
		return nil, fmt.Errorf("rpc: encoding a command of %d ops: %w", len(batch), err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.ApplyTimeout)
	defer cancel()
	out, err := p.node.Apply(ctx, data)
	if err != nil {
		return nil, err
	}
	res, ok := out.(*fsm.Result)
	if !ok || len(res.Ops) != len(batch) {
		return nil, fmt.Errorf("rpc: the FSM answered %T for a command of %d ops", out, len(batch))
	}
	return res, nil
}
