package quotahttp_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/client/quotahttp"
)

func newClient(t *testing.T, addr string) *client.Client {
	t.Helper()
	c, err := client.New(client.Config{Addrs: []string{addr}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// tokenIdentity is a stand-in for token verification: "Bearer tenant:consumer".
func tokenIdentity(r *http.Request) (quotahttp.Identity, error) {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok {
		return quotahttp.Identity{}, errors.New("no bearer token")
	}
	tenant, consumer, _ := strings.Cut(tok, ":")
	return quotahttp.Identity{Tenant: tenant, Consumer: consumer}, nil
}

type gateway struct {
	srv     *miniQuotad
	handler http.Handler
	// upstream records the identity headers the protected handler saw.
	upstreamTenant, upstreamConsumer atomic.Value
}

func newGateway(t *testing.T, limits map[string]miniLimit) *gateway {
	t.Helper()
	g := &gateway{srv: newMiniQuotad(limits)}
	addr, _ := g.srv.start(t)
	mw, err := quotahttp.Middleware(quotahttp.MiddlewareConfig{
		Client: newClient(t, addr), Domain: "platform", Identify: tokenIdentity,
	})
	if err != nil {
		t.Fatal(err)
	}
	g.handler = mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g.upstreamTenant.Store(r.Header.Get("X-Tenant"))
		g.upstreamConsumer.Store(r.Header.Get("X-Consumer-Id"))
		io.WriteString(w, "ok")
	}))
	return g
}

func (g *gateway) do(token string, hdr map[string]string) *httptest.ResponseRecorder {
	r := httptest.NewRequest("GET", "/orders", nil)
	if token != "" {
		r.Header.Set("Authorization", "Bearer "+token)
	}
	for k, v := range hdr {
		r.Header.Set(k, v)
	}
	w := httptest.NewRecorder()
	g.handler.ServeHTTP(w, r)
	return w
}

var minuteLimits = map[string]miniLimit{
	"tenant":   {perWindow: 100, window: time.Minute},
	"consumer": {perWindow: 2, window: time.Minute},
}

func TestSpoofedTenantHeaderChangesNothing(t *testing.T) {
	g := newGateway(t, minuteLimits)

	w := g.do("acme:app", map[string]string{"X-Tenant": "victim", "x-consumer-id": "victim-app", "X-Tenant-Id": "victim"})
	if w.Code != 200 {
		t.Fatalf("status %d, body %s", w.Code, w.Body)
	}
	if got := g.upstreamTenant.Load(); got != "acme" {
		t.Errorf("upstream saw X-Tenant %q, want the verified %q", got, "acme")
	}
	if got := g.upstreamConsumer.Load(); got != "app" {
		t.Errorf("upstream saw X-Consumer-Id %q, want the verified %q", got, "app")
	}
	g.srv.mu.Lock()
	seen := g.srv.seen[len(g.srv.seen)-1]
	g.srv.mu.Unlock()
	if got := fmt.Sprint(seen); !strings.Contains(got, `value:"acme"`) || strings.Contains(got, "victim") {
		t.Errorf("admission descriptors %s: want tenant acme only", got)
	}
	if _, ok := g.srv.bucketTokens("tenant=victim"); ok {
		t.Errorf("the victim's bucket was touched")
	}

	// A spoofed header without a verified identity is refused, not admitted as the victim.
	w = g.do("", map[string]string{"X-Tenant": "victim"})
	if w.Code != http.StatusUnauthorized {
		t.Errorf("spoofed header only: status %d, want 401", w.Code)
	}
	if _, ok := g.srv.bucketTokens("tenant=victim"); ok {
		t.Errorf("the victim's bucket was touched by an unauthenticated request")
	}
}

func TestDeniedResponseCarriesEveryHeader(t *testing.T) {
	g := newGateway(t, minuteLimits)
	for i := range 2 {
		if w := g.do("acme:app", nil); w.Code != 200 {
			t.Fatalf("request %d: status %d", i, w.Code)
		}
	}
	before := time.Now()
	w := g.do("acme:app", nil)
	if w.Code != http.StatusTooManyRequests {
		t.Fatalf("third request: status %d, want 429", w.Code)
	}
	h := w.Result().Header
	// The consumer bucket (2/min) refills one token per 30 s and is empty: the next token is
	// ~30 s away and the bucket is full again in ~60 s.
	retry, _ := strconv.Atoi(h.Get("Retry-After"))
	if retry < 29 || retry > 30 {
		t.Errorf("Retry-After %q, want 29..30", h.Get("Retry-After"))
	}
	want := map[string]string{
		"X-RateLimit-Limit":     "2",
		"X-RateLimit-Remaining": "0",
		"X-RateLimit-Scope":     "consumer",
		"RateLimit-Policy":      `"consumer";q=2;w=60`,
		"Content-Type":          "application/problem+json",
	}
	for k, v := range want {
		if got := h.Get(k); got != v {
			t.Errorf("%s = %q, want %q", k, got, v)
		}
	}
	reset, err := strconv.ParseInt(h.Get("X-RateLimit-Reset"), 10, 64)
	if err != nil || math.Abs(float64(reset-before.Add(60*time.Second).Unix())) > 2 {
		t.Errorf("X-RateLimit-Reset %q, want about now+60 s = %d", h.Get("X-RateLimit-Reset"), before.Add(time.Minute).Unix())
	}
	rl := h.Get("RateLimit")
	var tSecs int
	if n, _ := fmt.Sscanf(rl, `"consumer";r=0;t=%d`, &tSecs); n != 1 || tSecs < 59 || tSecs > 60 {
		t.Errorf("RateLimit %q, want \"consumer\";r=0;t=59..60", rl)
	}
	var body map[string]any
	if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
		t.Fatalf("body %q: %v", w.Body, err)
	}
	if body["status"] != float64(429) || body["scope"] != "consumer" || body["reason"] != "rate_limited" ||
		body["title"] != "Too Many Requests" || !strings.Contains(body["detail"].(string), "consumer") {
		t.Errorf("problem body %v", body)
	}
}

func TestAdmittedResponseCarriesRateLimitFields(t *testing.T) {
	g := newGateway(t, minuteLimits)
	w := g.do("acme:app", nil)
	if w.Code != 200 {
		t.Fatalf("status %d", w.Code)
	}
	h := w.Result().Header
	if got := h.Get("RateLimit-Policy"); got != `"consumer";q=2;w=60` {
		t.Errorf("RateLimit-Policy %q", got)
	}
	if got := h.Get("RateLimit"); !strings.HasPrefix(got, `"consumer";r=1;t=`) {
		t.Errorf("RateLimit %q, want \"consumer\";r=1;t=…", got)
	}
	if h.Get("X-RateLimit-Remaining") != "1" || h.Get("X-RateLimit-Scope") != "consumer" || h.Get("Retry-After") != "" {
		t.Errorf("headers %v", h)
	}
}

func TestMiddlewareUnavailable(t *testing.T) {
	srv := newMiniQuotad(minuteLimits)
	addr, stop := srv.start(t)
	stop()
	c := newClient(t, addr)
	for _, failOpen := range []bool{false, true} {
		mw, err := quotahttp.Middleware(quotahttp.MiddlewareConfig{Client: c, Domain: "platform",
			Identify: tokenIdentity, Timeout: 200 * time.Millisecond, FailOpen: failOpen})
		if err != nil {
			t.Fatal(err)
		}
		h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
		r := httptest.NewRequest("GET", "/", nil)
		r.Header.Set("Authorization", "Bearer acme:app")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		want := http.StatusServiceUnavailable
		if failOpen {
			want = http.StatusOK
		}
		if w.Code != want {
			t.Errorf("FailOpen=%v: status %d, want %d", failOpen, w.Code, want)
		}
	}
}

func TestHeaderFormatting(t *testing.T) {
	d := client.Decision{Scope: `we"ird\scope`, Limit: 100, Remaining: 50, Window: 1500 * time.Millisecond, ResetAfter: 29001 * time.Millisecond}
	if got, want := quotahttp.RateLimitPolicy(d), `"we\"ird\\scope";q=100;w=2`; got != want {
		t.Errorf("policy %s, want %s", got, want)
	}
	if got, want := quotahttp.RateLimitField(d), `"we\"ird\\scope";r=50;t=30`; got != want {
		t.Errorf("field %s, want %s", got, want)
	}
	h := http.Header{}
	quotahttp.SetRetryAfter(h, time.Duration(math.MaxInt64))
	if h.Get("Retry-After") != "9223372037" {
		t.Errorf("Retry-After for a 'never' decision: %q, want 9223372037 (no overflow)", h.Get("Retry-After"))
	}
	quotahttp.SetRetryAfter(h, 0)
	if h.Get("Retry-After") != "1" {
		t.Errorf("Retry-After for 0: %q, want 1", h.Get("Retry-After"))
	}
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, tc := range []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"12", 12 * time.Second, true},
		{" 0 ", 0, true},
		{"-1", 0, false},
		{"soon", 0, false},
		{"", 0, false},
		{now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second, true},
		{now.Add(-time.Hour).Format(http.TimeFormat), 0, true},
	} {
		got, ok := quotahttp.ParseRetryAfter(tc.in, now)
		if got != tc.want || ok != tc.ok {
			t.Errorf("ParseRetryAfter(%q) = %v, %v; want %v, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
}

func TestTransportReleasesLeaseAndReportsFeedback(t *testing.T) {
	srv := newMiniQuotad(map[string]miniLimit{
		"domain": {perWindow: 1000, window: time.Second, concurrencyOn: true, maxInFlight: 1, leaseTTL: 5 * time.Second},
	})
	addr, _ := srv.start(t)
	c := newClient(t, addr)

	var status atomic.Int64
	status.Store(200)
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s := int(status.Load()); s != 200 {
			w.Header().Set("Retry-After", "7")
			w.Header().Set("Provider-Limit-Reason", "global-rate")
			w.WriteHeader(s)
		}
		io.WriteString(w, "hello")
	}))
	defer provider.Close()
	var fed atomic.Int64
	hc := &http.Client{Transport: &quotahttp.Transport{
		Client:       c,
		Request:      func(*http.Request) (client.Request, error) { return client.Request{Domain: "provider"}, nil },
		ReasonHeader: "Provider-Limit-Reason",
		OnFeedback: func(_ *http.Request, _ client.Feedback, res client.FeedbackResult, err error) {
			if err == nil && res.PausedFor == 7*time.Second {
				fed.Add(1)
			}
		},
	}}

	resp, err := hc.Get(provider.URL)
	if err != nil {
		t.Fatal(err)
	}
	// While the body is open the single permit is held: a second request is denied, and the
	// denial is visible with errors.As through http.Client's *url.Error.
	_, err = hc.Get(provider.URL)
	var denied *client.DeniedError
	if !errors.As(err, &denied) || denied.Decision.Reason != client.ReasonConcurrencyLimited {
		t.Fatalf("second request while the first body is open: err %v, want a concurrency_limited denial", err)
	}
	io.ReadAll(resp.Body)
	resp.Body.Close()
	waitFor(t, func() bool { srv.mu.Lock(); defer srv.mu.Unlock(); return len(srv.released) == 1 })

	// The permit is back; a provider 429 is reported through Feedback.
	status.Store(http.StatusTooManyRequests)
	resp, err = hc.Get(provider.URL)
	if err != nil {
		t.Fatalf("after release: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != 429 {
		t.Errorf("the provider's 429 was not passed on: %d", resp.StatusCode)
	}
	srv.mu.Lock()
	fb := srv.feedback
	srv.mu.Unlock()
	if len(fb) != 1 || fb[0].StatusCode != 429 || fb[0].RetryAfterMs != 7000 || fb[0].Reason != "global-rate" || fb[0].Domain != "provider" {
		t.Errorf("feedback %v, want one 429 for domain provider, retry 7000 ms, reason global-rate", fb)
	}
	if fed.Load() != 1 {
		t.Errorf("OnFeedback saw %d successful reports, want 1", fed.Load())
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 5s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}
