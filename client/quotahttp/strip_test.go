package quotahttp_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"testing"

	"github.com/quotad/quotad/client/quotahttp"
)

// TestStripHeaderVariants: the default identity headers, a custom StripHeaders list and the
// configured TenantHeader and ConsumerHeader are all stripped — in any case and with '_' or
// '.' for '-' — before Identify and the next handler see the request; the next handler sees
// only the verified identity in TenantHeader and ConsumerHeader.
func TestStripHeaderVariants(t *testing.T) {
	srv := newMiniQuotad(minuteLimits)
	addr, _ := srv.start(t)
	var identifySaw, upstreamSaw http.Header
	mw, err := quotahttp.Middleware(quotahttp.MiddlewareConfig{
		Client: newClient(t, addr), Domain: "platform",
		Identify: func(r *http.Request) (quotahttp.Identity, error) {
			identifySaw = r.Header.Clone()
			return tokenIdentity(r)
		},
		StripHeaders:   []string{"X-Org"}, // adds to the defaults, does not replace them
		TenantHeader:   "X-Acct",
		ConsumerHeader: "X-App",
	})
	if err != nil {
		t.Fatal(err)
	}
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		upstreamSaw = r.Header.Clone()
		io.WriteString(w, "ok")
	}))
	forged := []string{
		"X-Tenant", "X_Tenant", "x_tenant", "x-tenant", "X-TENANT", "X.Tenant", // default list
		"X_Tenant_Id", "x-consumer", "X_QUOTAD_TENANT", "x-quotad-consumer", "X-Consumer_Id",
		"X-Org", "x_org", // custom list
		"X-Acct", "x_acct", "X-ACCT", // configured tenant header
		"X-App", "x.app", "X_APP", // configured consumer header
	}
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set("Authorization", "Bearer acme:app")
	r.Header.Set("X-Keep", "kept")
	for _, name := range forged {
		r.Header[name] = []string{"victim"} // as sent: not canonicalized
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != 200 {
		t.Fatalf("status %d: %s", w.Code, w.Body)
	}
	for who, hdr := range map[string]http.Header{"Identify": identifySaw, "the next handler": upstreamSaw} {
		var leaked []string
		for k, v := range hdr {
			if strings.Contains(strings.Join(v, ","), "victim") {
				leaked = append(leaked, k)
			}
		}
		sort.Strings(leaked)
		if len(leaked) > 0 {
			t.Errorf("%s saw forged headers %v", who, leaked)
		}
		if hdr.Get("X-Keep") != "kept" {
			t.Errorf("%s lost an unrelated header", who)
		}
	}
	if got, want := upstreamSaw.Get("X-Acct"), "acme"; got != want {
		t.Errorf("upstream X-Acct %q, want the verified %q", got, want)
	}
	if got, want := upstreamSaw.Get("X-App"), "app"; got != want {
		t.Errorf("upstream X-App %q, want the verified %q", got, want)
	}
	//lint:ignore SA1008 the caller sent the non-canonical X_Tenant on purpose
	if r.Header.Get("X-Keep") != "kept" || len(r.Header["X_Tenant"]) == 0 {
		t.Error("the caller's request was modified (the middleware must work on a clone)")
	}
}
