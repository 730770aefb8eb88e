package client

import (
	"errors"
	"fmt"
	"time"
)

// Sentinel errors. Errors returned by this package wrap exactly one of them (or a plain
// gRPC status error for outcomes outside this taxonomy, such as PermissionDenied); test with
// errors.Is.
var (
	// ErrDenied means the cluster decided and the answer was no. The error is a
	// *DeniedError carrying the Decision.
	ErrDenied = errors.New("quotad: denied")

	// ErrUnavailable means no decision could be had before the caller's context ended: no
	// leader, no reachable node, or answers lost. For Allow, Wait and Acquire the outcome is
	// then unknown — the cluster may have decided (and debited) a request whose answer never
	// arrived. It did so at most once: every retry carried the same request ID. The error also
	// wraps the context's error, so errors.Is(err, context.DeadlineExceeded) works.
	ErrUnavailable = errors.New("quotad: unavailable")

	// ErrInvalid means the request itself is wrong (malformed, naming an unknown domain, or
	// reusing a request ID for a different request: request_id_conflict). Retrying it unchanged
	// will not help.
	ErrInvalid = errors.New("quotad: invalid request")

	// ErrClosed means the Client was closed.
	ErrClosed = errors.New("quotad: client closed")

	// ErrLeaseLost means a lease ended without Release: the cluster no longer has it (it
	// expired, or renewals could not reach the cluster within its TTL). Work that needed the
	// permit should stop.
	ErrLeaseLost = errors.New("quotad: lease lost")
)

// DeniedError is the error for a decision that did not admit. It matches ErrDenied.
type DeniedError struct {
	// Decision is the denial, with Reason, Scope, RetryAfter and the rest.
	Decision Decision
}

// Error describes the denial: reason, scope and retry-after.
func (e *DeniedError) Error() string {
	d := e.Decision
	s := fmt.Sprintf("quotad: denied: %s", d.Reason)
	if d.Scope != "" {
		s += fmt.Sprintf(" at scope %q", d.Scope)
	}
	if d.RetryAfter > 0 {
		s += fmt.Sprintf(", retry after %v", d.RetryAfter)
	}
	if d.Message != "" {
		s += ": " + d.Message
	}
	return s
}

// Is reports whether target is ErrDenied.
func (e *DeniedError) Is(target error) bool { return target == ErrDenied }

// RetryAfter returns how long to wait before retrying when err carries a denial, and
// whether it does.
func RetryAfter(err error) (wait time.Duration, ok bool) {
	var de *DeniedError
	if errors.As(err, &de) {
		return de.Decision.RetryAfter, true
	}
	return 0, false
}

// decisionError turns a decision into the error Allow returns with it.
func decisionError(d Decision) error {
	switch {
	case d.Admitted:
		return nil
	case d.Reason == ReasonInvalid || d.Reason == ReasonUnknownDomain || d.Reason == ReasonRequestIDConflict:
		msg := d.Message
		if msg == "" {
			msg = string(d.Reason)
		}
		return fmt.Errorf("%w: %s: %s", ErrInvalid, d.Reason, msg)
	default:
		return &DeniedError{Decision: d}
	}
}
