package quotahttp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"sync"
	"time"

	"github.com/quotad/quotad/client"
)

// Transport is an http.RoundTripper for requests to a provider whose quota is shared through
// quotad. For each request it acquires admission (with the concurrency lease, if the path
// has one) before sending, releases the lease when the response body is closed (or when
// sending fails), and reports a provider answer of 429 or 503 to the cluster's Feedback API
// so the quota domain the provider named is paused for every worker. The provider's
// response is always returned to the caller unchanged.
//
// A denial is returned as the RoundTrip error, wrapping *client.DeniedError: with
// http.Client, errors.As(err, &denied) works through the *url.Error, and
// denied.Decision.RetryAt() says when to reschedule the job.
//
// Transport is safe for concurrent use. Client and Request must be set; the zero values of
// the other fields are usable.
type Transport struct {
	// Client decides admissions. Required.
	Client *client.Client
	// Request maps an outgoing request to its admission (domain, descriptors, cost, work
	// class, attempt). An error fails the RoundTrip without sending. Required.
	Request func(r *http.Request) (client.Request, error)
	// Base sends admitted requests (default http.DefaultTransport).
	Base http.RoundTripper
	// Wait, if true, waits for quota within the request's context (Client.Acquire) instead
	// of failing at once with a denial (Client.TryAcquire).
	Wait bool
	// ReasonHeader is the provider's limiter-reason response header (for example
	// "Stripe-Rate-Limited-Reason"); its value is passed on as Feedback.Reason.
	ReasonHeader string
	// FeedbackScope chooses what a provider 429/503 pauses: the descriptors of the level the
	// provider limited (nil: the whole domain) and whether to report it at all. Default:
	// report every 429 and 503 for the whole domain. The cluster does not assume a report
	// for the whole domain without a reason (ReasonHeader empty or absent) is global: it
	// pauses and adapts nothing. Providers whose throttles are per-account or per-endpoint
	// deserve their own FeedbackScope naming that level.
	FeedbackScope func(r *http.Request, resp *http.Response, adm client.Request) (descriptors []client.Entry, report bool)
	// FeedbackTimeout bounds the Feedback RPC (default 1s). It runs before RoundTrip returns,
	// so the pause is in force before this worker's next admission.
	FeedbackTimeout time.Duration
	// OnFeedback, if set, is told the outcome of every Feedback report.
	OnFeedback func(r *http.Request, f client.Feedback, res client.FeedbackResult, err error)
}

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(r *http.Request) (*http.Response, error) {
	if t.Client == nil || t.Request == nil {
		return nil, errors.New("quotahttp: Transport needs Client and Request")
	}
	adm, err := t.Request(r)
	if err != nil {
		closeBody(r)
		return nil, fmt.Errorf("quotahttp: mapping %s %s to an admission: %w", r.Method, r.URL.Redacted(), err)
	}
	var lease *client.Lease
	if t.Wait {
		lease, err = t.Client.Acquire(r.Context(), adm)
	} else {
		lease, err = t.Client.TryAcquire(r.Context(), adm)
	}
	if err != nil {
		closeBody(r)
		return nil, fmt.Errorf("quotahttp: admission for %s %s: %w", r.Method, r.URL.Redacted(), err)
	}
	base := t.Base
	if base == nil {
		base = http.DefaultTransport
	}
	resp, err := base.RoundTrip(r)
	if err != nil {
		releaseAsync(lease)
		return nil, err
	}
	if resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusServiceUnavailable {
		t.feedback(r, resp, adm)
	}
	resp.Body = newLeaseBody(resp.Body, lease)
	return resp, nil
}

func (t *Transport) feedback(r *http.Request, resp *http.Response, adm client.Request) {
	var descs []client.Entry
	if t.FeedbackScope != nil {
		var report bool
		if descs, report = t.FeedbackScope(r, resp, adm); !report {
			return
		}
	}
	f := client.Feedback{Domain: adm.Domain, Descriptors: descs, StatusCode: resp.StatusCode}
	if ra, ok := ParseRetryAfter(resp.Header.Get(HeaderRetryAfter), time.Now()); ok {
		f.RetryAfter = ra
	}
	if t.ReasonHeader != "" {
		f.Reason = resp.Header.Get(t.ReasonHeader)
	}
	timeout := t.FeedbackTimeout
	if timeout <= 0 {
		timeout = time.Second
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), timeout)
	defer cancel()
	res, err := t.Client.Feedback(ctx, f)
	if t.OnFeedback != nil {
		t.OnFeedback(r, f, res, err)
	}
}

func closeBody(r *http.Request) {
	if r.Body != nil {
		_ = r.Body.Close()
	}
}

// leaseBody releases its lease when closed. If the caller never closes it, a cleanup releases
// the lease once the body is garbage (a missed Close would otherwise renew the permits
// forever).
type leaseBody struct {
	io.ReadCloser
	state *leaseRelease
}

type leaseRelease struct {
	once  sync.Once
	lease *client.Lease
}

func (s *leaseRelease) release() { s.once.Do(func() { releaseAsync(s.lease) }) }

func newLeaseBody(body io.ReadCloser, lease *client.Lease) io.ReadCloser {
	if lease.ID() == 0 {
		_ = lease.Release(context.Background()) // holds no permits: nothing to wait for
		return body
	}
	lb := &leaseBody{ReadCloser: body, state: &leaseRelease{lease: lease}}
	runtime.AddCleanup(lb, func(s *leaseRelease) { s.release() }, lb.state)
	return lb
}

// Close closes the body and releases the lease.
func (b *leaseBody) Close() error {
	err := b.ReadCloser.Close()
	b.state.release()
	return err
}
