package quotahttp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/quotad/quotad/client"
)

// Identity is a caller's verified identity. Tenant is required; Consumer (an integration or
// app within the tenant) is optional.
type Identity struct {
	// Tenant is the customer or organisation, e.g. "acme".
	Tenant string
	// Consumer is the integration or app within the tenant, e.g. "mobile-app"; optional.
	Consumer string
}

// IdentifyFunc returns the verified identity of r's caller, from a validated token or the
// mTLS peer, never from a header the caller can set. An error answers 401 (its text is not
// shown to the caller).
type IdentifyFunc func(r *http.Request) (Identity, error)

// DefaultStripHeaders are the inbound headers Middleware always removes: identity headers a
// caller could forge.
var DefaultStripHeaders = []string{
	"X-Tenant", "X-Tenant-Id", "X-Consumer", "X-Consumer-Id",
	"X-Quotad-Tenant", "X-Quotad-Consumer",
}

// MiddlewareConfig configures Middleware. Client, Domain and Identify are required; every
// other zero field takes the default named in its comment.
type MiddlewareConfig struct {
	// Client decides admissions. Required.
	Client *client.Client
	// Domain is the quota domain of every request. Required.
	Domain string
	// Identify returns the caller's verified identity. Required.
	Identify IdentifyFunc
	// Descriptors builds the descriptor path of a request. Default: tenant, then consumer
	// (when non-empty): [{tenant, id.Tenant}, {consumer, id.Consumer}].
	Descriptors func(r *http.Request, id Identity) []client.Entry
	// Cost returns a request's cost in units. Default: 1.
	Cost func(r *http.Request) uint64
	// StripHeaders are removed from every inbound request before Identify runs, on top of
	// DefaultStripHeaders, TenantHeader and ConsumerHeader, which are always removed. A header
	// matches whatever its case and whether it spells separators '-', '_' or '.' (X_Tenant,
	// x-tenant and X.TENANT are all X-Tenant): proxies and frameworks treat them alike.
	StripHeaders []string
	// TenantHeader and ConsumerHeader are set on the request passed to the next handler
	// from the verified identity, for upstream services. Defaults: "X-Tenant" and
	// "X-Consumer-Id". Set to "-" to not set them.
	TenantHeader, ConsumerHeader string
	// MaxWait > 0 waits up to that long for quota (Client.Acquire) instead of deciding at
	// once (Client.TryAcquire).
	MaxWait time.Duration
	// Timeout bounds the wait for a decision when the cluster is unreachable (default 1s).
	Timeout time.Duration
	// FailOpen admits requests when no decision can be had (ErrUnavailable). Default: false,
	// answer 503 with Retry-After: 1.
	FailOpen bool
	// ProblemType is the "type" URI of problem+json bodies (default "about:blank").
	ProblemType string
	// OnError, if set, is told about every error that did not come from a denial.
	OnError func(r *http.Request, err error)
}

// Middleware returns net/http middleware that admits each request through quotad.
//
// For every request it strips the configured identity headers, asks Identify for the
// verified identity (401 on error), admits the request on the path Descriptors builds, and
// then either calls next with the RateLimit fields of the decision set on the response, or
// answers 429 Too Many Requests with Retry-After, X-RateLimit-Limit, X-RateLimit-Remaining,
// X-RateLimit-Reset (Unix seconds), X-RateLimit-Scope, RateLimit, RateLimit-Policy and an
// application/problem+json body naming the scope. Concurrency permits taken for a request
// are released when next returns. The returned handler is safe for concurrent use.
func Middleware(cfg MiddlewareConfig) (func(http.Handler) http.Handler, error) {
	if cfg.Client == nil || cfg.Domain == "" || cfg.Identify == nil {
		return nil, fmt.Errorf("quotahttp: MiddlewareConfig needs Client (set: %t), Domain (%q) and Identify (set: %t)",
			cfg.Client != nil, cfg.Domain, cfg.Identify != nil)
	}
	if cfg.Descriptors == nil {
		cfg.Descriptors = defaultDescriptors
	}
	if cfg.TenantHeader == "" {
		cfg.TenantHeader = "X-Tenant"
	}
	if cfg.ConsumerHeader == "" {
		cfg.ConsumerHeader = "X-Consumer-Id"
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = time.Second
	}
	if cfg.ProblemType == "" {
		cfg.ProblemType = defaultProblemTypePrefix
	}
	m := &middleware{cfg: cfg, strip: stripSet(cfg)}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serve(w, r, next) })
	}, nil
}

func defaultDescriptors(_ *http.Request, id Identity) []client.Entry {
	es := []client.Entry{{Key: "tenant", Value: id.Tenant}}
	if id.Consumer != "" {
		es = append(es, client.Entry{Key: "consumer", Value: id.Consumer})
	}
	return es
}

type middleware struct {
	cfg   MiddlewareConfig
	strip map[string]bool // headerID of every header to strip
}

// stripSet is the set of headers cfg strips: the defaults, cfg.StripHeaders, and the headers
// the middleware itself sets from the verified identity.
func stripSet(cfg MiddlewareConfig) map[string]bool {
	set := make(map[string]bool)
	for _, list := range [][]string{DefaultStripHeaders, cfg.StripHeaders, {cfg.TenantHeader, cfg.ConsumerHeader}} {
		for _, h := range list {
			if id := headerID(h); id != "" && h != "-" {
				set[id] = true
			}
		}
	}
	return set
}

// headerID folds a header name to what identifies it for stripping: lower case, without the
// separators '-', '_' and '.'.
func headerID(name string) string {
	b := make([]byte, 0, len(name))
	for i := 0; i < len(name); i++ {
		switch c := name[i]; {
		case c == '-' || c == '_' || c == '.':
		case 'A' <= c && c <= 'Z':
			b = append(b, c+'a'-'A')
		default:
			b = append(b, c)
		}
	}
	return string(b)
}

func (m *middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	// Strip first, so neither Identify nor next can see a forged identity header. The
	// request is cloned: a handler must not modify the request it was given.
	r = r.Clone(r.Context())
	for h := range r.Header {
		if m.strip[headerID(h)] {
			delete(r.Header, h) // the key as sent: Del would canonicalize it
		}
	}
	id, err := m.cfg.Identify(r)
	if err != nil || id.Tenant == "" {
		if err == nil {
			err = errors.New("the identity function returned an empty tenant")
		}
		m.report(r, err)
		writeProblem(w, http.StatusUnauthorized, problem{Type: m.cfg.ProblemType, Title: "Unauthorized",
			Status: http.StatusUnauthorized, Detail: "the request carries no verified identity"})
		return
	}
	if m.cfg.TenantHeader != "-" {
		r.Header.Set(m.cfg.TenantHeader, id.Tenant)
	}
	if m.cfg.ConsumerHeader != "-" && id.Consumer != "" {
		r.Header.Set(m.cfg.ConsumerHeader, id.Consumer)
	}

	req := client.Request{Domain: m.cfg.Domain, Descriptors: m.cfg.Descriptors(r, id), Cost: 1}
	if m.cfg.Cost != nil {
		req.Cost = m.cfg.Cost(r)
	}
	ctx, cancel := context.WithTimeout(r.Context(), m.cfg.Timeout+m.cfg.MaxWait)
	var lease *client.Lease
	if m.cfg.MaxWait > 0 {
		wctx, wcancel := context.WithTimeout(ctx, m.cfg.MaxWait)
		lease, err = m.cfg.Client.Acquire(wctx, req)
		wcancel()
	} else {
		lease, err = m.cfg.Client.TryAcquire(ctx, req)
	}
	cancel()

	var denied *client.DeniedError
	switch {
	case err == nil:
		defer releaseAsync(lease)
		d := lease.Decision()
		SetRateLimitHeaders(w.Header(), d, d.At)
		next.ServeHTTP(w, r)
	case errors.As(err, &denied):
		WriteDenied(w, denied.Decision, m.cfg.ProblemType)
	case errors.Is(err, client.ErrUnavailable) && m.cfg.FailOpen:
		m.report(r, err)
		next.ServeHTTP(w, r)
	case errors.Is(err, client.ErrUnavailable):
		m.report(r, err)
		SetRetryAfter(w.Header(), time.Second)
		writeProblem(w, http.StatusServiceUnavailable, problem{Type: m.cfg.ProblemType, Title: "Service Unavailable",
			Status: http.StatusServiceUnavailable, Detail: "the quota service could not decide in time; retry shortly"})
	default:
		m.report(r, err)
		writeProblem(w, http.StatusInternalServerError, problem{Type: m.cfg.ProblemType, Title: "Internal Server Error",
			Status: http.StatusInternalServerError, Detail: "the request could not be admitted (quota configuration error)"})
	}
}

// releaseTimeout bounds a background Release; past it the permits return by TTL.
const releaseTimeout = 5 * time.Second

// releaseAsync releases l without making the response wait for the RPC.
func releaseAsync(l *client.Lease) {
	if l.ID() == 0 {
		_ = l.Release(context.Background()) // no RPC
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
		defer cancel()
		_ = l.Release(ctx)
	}()
}

func (m *middleware) report(r *http.Request, err error) {
	if m.cfg.OnError != nil {
		m.cfg.OnError(r, err)
	}
}

// problem is an RFC 9457 problem details object, extended with the quota fields.
type problem struct {
	Type       string `json:"type"`
	Title      string `json:"title"`
	Status     int    `json:"status"`
	Detail     string `json:"detail,omitempty"`
	Scope      string `json:"scope,omitempty"`
	Reason     string `json:"reason,omitempty"`
	Limit      uint64 `json:"limit,omitempty"`
	RetryAfter int64  `json:"retry_after,omitempty"`
}

// WriteDenied answers 429 Too Many Requests for a denial d: Retry-After, the headers of
// SetRateLimitHeaders, and an application/problem+json body with members type, title,
// status, detail, scope, reason, limit and retry_after (seconds). problemType is the body's
// "type" URI ("" for "about:blank").
func WriteDenied(w http.ResponseWriter, d client.Decision, problemType string) {
	if problemType == "" {
		problemType = defaultProblemTypePrefix
	}
	at := d.At
	if at.IsZero() {
		at = time.Now()
	}
	h := w.Header()
	SetRetryAfter(h, d.RetryAfter)
	SetRateLimitHeaders(h, d, at)
	retry := max(1, ceilSeconds(d.RetryAfter))
	detail := fmt.Sprintf("quota exceeded (%s)", d.Reason)
	if d.Scope != "" {
		detail = fmt.Sprintf("the %s limit of %d was reached (%s)", d.Scope, d.Limit, d.Reason)
	}
	detail += fmt.Sprintf("; retry after %d s", retry)
	writeProblem(w, http.StatusTooManyRequests, problem{
		Type: problemType, Title: "Too Many Requests", Status: http.StatusTooManyRequests,
		Detail: detail, Scope: d.Scope, Reason: string(d.Reason), Limit: d.Limit, RetryAfter: retry,
	})
}

func writeProblem(w http.ResponseWriter, code int, p problem) {
	body, _ := json.Marshal(p) // a struct of strings and integers always marshals
	h := w.Header()
	h.Set("Content-Type", problemContentType)
	h.Set("Content-Length", fmt.Sprint(len(body)+1))
	w.WriteHeader(code)
	_, _ = w.Write(append(body, '\n'))
}
