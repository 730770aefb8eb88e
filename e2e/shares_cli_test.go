package e2e

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/client"
)

const sharesLimits = `
domain: api
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100, burst: 100}
    shares: {lease: 6s}
`

// TestCLIShares: a Limiter in this process holds a share of api/tenant=acme on a 3-process
// secure cluster; `quotad shares` (the binary, admin credentials from the environment) lists
// it with its rate, burst, expiry, demand and acknowledgement, in text and JSON, for the
// domain and for the path; another tenant's path lists nobody; a bad flag is named.
func TestCLIShares(t *testing.T) {
	c := startClusterWith(t, 3, sharesLimits)
	qc, err := client.New(c.ClientConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer qc.Close()
	lim := qc.Limiter(client.Request{Domain: "api", Descriptors: []client.Entry{{Key: "tenant", Value: "acme"}}}, client.LimiterOptions{Demand: 40})
	defer lim.Close()
	deadline := time.Now().Add(15 * time.Second)
	for !lim.Share().Local {
		if time.Now().After(deadline) {
			t.Fatalf("no local share within 15 s: %+v", lim.Share())
		}
		lim.Allow()
		time.Sleep(50 * time.Millisecond)
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { // demand of 40/s: a holder with no demand is lent nothing
		defer close(done)
		for tk := time.NewTicker(25 * time.Millisecond); ; {
			select {
			case <-stop:
				tk.Stop()
				return
			case <-tk.C:
				lim.Allow()
			}
		}
	}()
	var out sharesJSONOut
	var raw string
	for { // the holder acknowledges its first grant at its next renewal (≤ 2.2 s)
		raw = mustCLI(t, c, "shares", "--domain", "api", "--descriptor", "tenant=acme", "--json")
		if err := json.Unmarshal([]byte(raw), &out); err != nil {
			t.Fatalf("%v:\n%s", err, raw)
		}
		if len(out.Holders) == 1 && out.Holders[0].Acknowledged || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if len(out.Buckets) != 1 || len(out.Holders) != 1 {
		t.Fatalf("shares --json: want one bucket and one holder:\n%s", raw)
	}
	b, h := out.Buckets[0], out.Holders[0]
	if b.Key != "api/tenant=acme" || b.Rate != 100 || b.Holders != 1 || b.LentRate != h.Rate || b.ReserveRate < 10 {
		t.Fatalf("bucket:\n%s", raw)
	}
	if h.Owner == "" || h.Rate <= 0 || h.Rate > 90 || h.Burst <= 0 || h.ExpiresInMs <= 0 || h.ExpiresInMs > 6250 ||
		h.Demand == nil || !h.Acknowledged || h.Seq < 1 {
		t.Fatalf("holder:\n%s", raw)
	}
	text := mustCLI(t, c, "shares", "--domain", "api")
	for _, w := range []string{"api/tenant=acme", "lent ", "to 1 holders", "reserve", "expires in", "acknowledged", h.HolderID} {
		if !strings.Contains(text, w) {
			t.Fatalf("shares text lacks %q:\n%s", w, text)
		}
	}
	if other := mustCLI(t, c, "shares", "--domain", "api", "--descriptor", "tenant=other"); !strings.Contains(other, "no lendable bucket with holders") {
		t.Fatalf("another tenant's path:\n%s", other)
	}
	if all := mustCLI(t, c, "shares"); !strings.Contains(all, "api/tenant=acme") || !strings.Contains(all, h.HolderID) {
		t.Fatalf("shares without --domain (every domain):\n%s", all)
	}
	wantCLI(t, c, 1, []string{"--descriptor needs --domain"}, "shares", "--descriptor", "tenant=acme")
	// A domain the limits do not define is refused as bucket status refuses it (user trial:
	// "no lendable bucket with holders or lends in nosuch", exit 0, for a misspelled domain).
	wantCLI(t, c, 1, []string{"NotFound", `"nosuch"`, "unknown domain"}, "shares", "--domain", "nosuch")
	wantCLI(t, c, 1, []string{`--descriptor "tenant"`}, "shares", "--domain", "api", "--descriptor", "tenant")

	// After Close the share is released: nobody holds it any more.
	close(stop)
	<-done
	lim.Close()
	if got := mustCLI(t, c, "shares", "--domain", "api"); strings.Contains(got, h.HolderID) {
		t.Fatalf("holder listed after its release:\n%s", got)
	}
}

type sharesJSONOut struct {
	Buckets []struct {
		Key         string  `json:"key"`
		Rate        float64 `json:"rate"`
		LentRate    float64 `json:"lent_rate"`
		ReserveRate float64 `json:"reserve_rate"`
		Holders     int     `json:"holders"`
	} `json:"buckets"`
	Holders []struct {
		Key          string   `json:"key"`
		Owner        string   `json:"owner"`
		HolderID     string   `json:"holder_id"`
		Rate         float64  `json:"rate"`
		Burst        float64  `json:"burst"`
		ExpiresInMs  int64    `json:"expires_in_ms"`
		Demand       *float64 `json:"demand"`
		Seq          uint64   `json:"seq"`
		Acknowledged bool     `json:"acknowledged"`
	} `json:"holders"`
}
