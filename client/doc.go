// Package client is the Go client library of a quotad cluster: the thing a worker or a gateway
// calls before it spends a unit of a shared quota.
//
// A Client talks to any node of the cluster, learns the leader from the "x-quotad-leader"
// response header and sends its calls there, and moves on to another node when one fails.
// Every admission gets a request ID (the client ID plus an atomic sequence) that is reused on
// every retry of that call, so the cluster's dedup table answers a retry with the original
// decision and never debits twice. Retries use exponential backoff with full jitter and are
// bounded by the caller's context only.
//
// The API follows golang.org/x/time/rate and golang.org/x/sync/semaphore:
//
//	Allow       decide now                              (rate.Limiter.Allow)
//	Wait        decide, sleeping per retry-after        (rate.Limiter.Wait)
//	TryAcquire  decide now, hold the concurrency lease  (semaphore.Weighted.TryAcquire)
//	Acquire     wait, then hold the concurrency lease   (semaphore.Weighted.Acquire)
//	Refund      give back tokens of an admission that was never used; RefundResult says
//	            whether it was found and refunded now (RefundOutcome)
//
// Outcomes are told apart with errors.Is and errors.As:
//
//	err == nil                      admitted
//	errors.Is(err, ErrDenied)       a decision was made and it was no; errors.As gives the
//	                                *DeniedError with the Decision (RetryAfter, Scope, ...)
//	errors.Is(err, ErrUnavailable)  no decision could be had before the context ended; the
//	                                outcome may be unknown (see ErrUnavailable)
//	errors.Is(err, ErrInvalid)      the request itself is wrong; retrying will not help
//
// A Lease can be lost while held (its TTL ran out during a pause or partition, an admin
// released it, a restore dropped it): Lease.Done closes and errors.Is(l.Err(), ErrLeaseLost);
// stop the work it was for. A failover is not a loss (see Lease).
//
// The client logs nothing unless Config.Logger is set (slog.Default() for the program's own
// logger), as a library should: what it would log (a lease lost while held) is also in
// Lease.Err and Stats, where the caller decides what to do with it.
//
// Concurrent calls from many goroutines are coalesced into one Acquire RPC per short window
// (see BatchConfig); each caller still gets its own decision. Waiting admissions (Wait,
// Acquire, MaxWait) share one AcquireStream to the leader instead, each answered as soon as
// it is decided (see StreamConfig).
//
// The package imports only quotad's API package: it never depends on the server's internals.
// Package quotahttp builds net/http middleware and an outbound http.RoundTripper on top of it.
package client
