package client

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ErrLeaseReleased is what Lease.Err returns after Release.
var ErrLeaseReleased = errors.New("quotad: lease released")

// Lease holds the concurrency permits of an admitted request (when its path has a
// concurrency limit) and renews them in the background every third of their TTL until
// Release.
//
// The cluster can drop a lease while its holder still works: its TTL ran out while the
// process was paused or partitioned, an admin released it, or a snapshot restore dropped it.
// A renewal answered NotFound then ends the lease at once: renewals stop, Done is closed and
// Err returns an error matching ErrLeaseLost that says why; Stats.LeasesLost counts it and
// Config.Logger (if set) logs it, once. The holder is no longer within the concurrency limit and
// should stop the work the permit was for. A renewal that fails for another reason (no
// leader during an election, a node unreachable) is retried until the lease's TTL, counted
// locally from the last renewal that succeeded, would have run out; only then is the lease
// reported lost (the cluster may have expired it). A Release that finds the lease already
// gone says so the same way (Err matches ErrLeaseLost) but is not an error. A Lease is safe
// for concurrent use; its zero value is not usable.
type Lease struct {
	c   *Client
	d   Decision
	ttl time.Duration // requested TTL for renewals (0: the limit's)

	ctx       context.Context // canceled by Release: stops renewals, including one in flight
	stopRenew context.CancelFunc
	done      chan struct{}
	mu        sync.Mutex
	err       error
	release   sync.Once
	relErr    error
}

func (c *Client) newLease(d Decision, ttl time.Duration) *Lease {
	l := &Lease{c: c, d: d, ttl: ttl, done: make(chan struct{})}
	if d.LeaseID == 0 {
		return l
	}
	l.ctx, l.stopRenew = context.WithCancel(c.baseCtx)
	c.leasesMu.Lock()
	c.leases[l] = struct{}{}
	c.leasesMu.Unlock()
	go l.renew()
	return l
}

// Decision returns the admission decision the lease came from.
func (l *Lease) Decision() Decision { return l.d }

// ID returns the cluster's lease ID, 0 when the path had no concurrency limit.
func (l *Lease) ID() uint64 { return l.d.LeaseID }

// Done is closed when the lease ends: released, or lost.
func (l *Lease) Done() <-chan struct{} { return l.done }

// Err is nil while the lease is held, ErrLeaseReleased after Release, and an error matching
// ErrLeaseLost if the lease ended on its own — also when Release found it already gone on
// the cluster, and it stays so after Release.
func (l *Lease) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

// end records why the lease ended, once; before runs first (under the lease's lock, before
// Done closes), so a caller woken by Done sees what it did.
func (l *Lease) end(err error, before ...func()) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return false
	}
	for _, f := range before {
		f()
	}
	l.err = err
	close(l.done)
	l.c.leasesMu.Lock()
	delete(l.c.leases, l)
	l.c.leasesMu.Unlock()
	return true
}

// lost ends the lease with err (matching ErrLeaseLost), stops renewals, and counts and logs
// the loss once.
func (l *Lease) lost(err error) {
	if l.stopRenew != nil {
		l.stopRenew()
	}
	// Counted and logged before Done closes: a caller woken by Done reads Stats.LeasesLost
	// and its logger's line (they came after it: CI ci1 read an empty log under -race).
	l.end(err, func() { l.c.leaseLost(err) })
}

// lostAtRelease records that Release found the lease already gone on the cluster: Err
// reports the loss instead of ErrLeaseReleased, counted and logged once.
func (l *Lease) lostAtRelease() {
	err := fmt.Errorf("%w: lease %d was already gone on the cluster when released (expired, released by an admin, or dropped by a restore)", ErrLeaseLost, l.d.LeaseID)
	l.mu.Lock()
	l.err = err
	l.mu.Unlock()
	l.c.leaseLost(err)
}

// Release returns the permits and stops renewals. Only the first call does anything; later
// calls return its result. Releasing a lease the cluster already dropped is not an error: it
// returns nil, sends nothing if a renewal had already found the lease gone, and Err then
// says the lease was lost (errors.Is(l.Err(), ErrLeaseLost)). If Release fails
// (ErrUnavailable), the permits come back by themselves after their TTL.
func (l *Lease) Release(ctx context.Context) error {
	l.release.Do(func() {
		if l.stopRenew != nil {
			l.stopRenew()
		}
		lost := !l.end(ErrLeaseReleased)
		if l.d.LeaseID == 0 || lost {
			return
		}
		req := &quotadv1.ReleaseRequest{LeaseId: l.d.LeaseID}
		var (
			resp     *quotadv1.ReleaseResponse
			attempts int
		)
		l.relErr = l.c.invoke(ctx, "Release", 0, func(ctx context.Context, qc quotadv1.QuotaClient, opts ...grpc.CallOption) error {
			attempts++
			var err error
			resp, err = qc.Release(ctx, req, opts...)
			return err
		})
		// Releases carry no request ID: after a retried attempt, "not held" may be the
		// answer to our own first attempt that committed, so only a first answer says the
		// lease was gone before.
		if l.relErr == nil && !resp.GetReleased() && attempts == 1 {
			l.lostAtRelease()
		}
	})
	return l.relErr
}

func (l *Lease) renew() {
	ttl := l.d.LeaseTTL
	if ttl <= 0 {
		ttl = l.ttl
	}
	if ttl <= 0 {
		ttl = 10 * time.Second
	}
	// expires is a conservative local bound on when the cluster ends the lease: its TTL counted
	// from when the admission was first sent (the cluster started counting later, at commit),
	// less 2 % for a leader clock that runs fast.
	start := l.d.sent
	if start.IsZero() {
		start = l.d.At
	}
	expires := start.Add(ttl - ttl/50)
	for {
		interval := max(ttl/3, minLeaseRenewInterval)
		t := time.NewTimer(interval)
		select {
		case <-l.ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		sent := time.Now()
		ctx, cancel := context.WithDeadline(l.ctx, expires)
		// Retries at most a tenth of the TTL apart: after the leader dies, the new one is
		// elected within the TTL but can be late in it (TestClusterLeaseSurvivesLeaderFailover).
		ctx = withBackoffMax(ctx, max(ttl/10, minRenewRetry))
		// And each attempt at most a third of it: a node that never answers (a blackholed
		// path) held an attempt for AttemptTimeout (2 s), longer than a short lease's whole
		// remaining window (TestLeaseRenewalSurvivesBlackholedNode).
		ctx = withAttemptMax(ctx, max(ttl/3, minRenewAttempt))
		req := &quotadv1.RenewRequest{LeaseId: l.d.LeaseID, LeaseTtlMs: durationMillisCeil(l.ttl)}
		var resp *quotadv1.RenewResponse
		err := l.c.invoke(ctx, "Renew", 0, func(ctx context.Context, qc quotadv1.QuotaClient, opts ...grpc.CallOption) error {
			var err error
			resp, err = qc.Renew(ctx, req, opts...)
			return err
		})
		cancel()
		if l.ctx.Err() != nil {
			return // released or client closed
		}
		switch {
		case err == nil:
			if got := millis(resp.GetLeaseTtlMs()); got > 0 {
				ttl = got
			}
			// As for the admission: from the first send, less 2 % for a fast leader clock.
			expires = sent.Add(ttl - ttl/50)
		case status.Code(err) == codes.NotFound:
			l.lost(fmt.Errorf("%w: lease %d is gone on the cluster (expired, released by an admin, or dropped by a restore): %w", ErrLeaseLost, l.d.LeaseID, err))
			return
		case !time.Now().Before(expires):
			l.lost(fmt.Errorf("%w: lease %d could not be renewed within its TTL %v (the cluster may have expired it): %w", ErrLeaseLost, l.d.LeaseID, ttl, err))
			return
		default:
			// Some other refusal; keep trying until the TTL runs out.
		}
	}
}
