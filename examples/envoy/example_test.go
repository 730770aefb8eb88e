// Package envoy_test checks examples/envoy: envoy.yaml is a valid Envoy v3 bootstrap with the
// rate limit service wired as documented, and limits.yaml holds seed 002's limits file exactly
// and means what the seed says when Envoy asks with the descriptors envoy.yaml sends.
package envoy_test

import (
	"encoding/json"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"gopkg.in/yaml.v3"

	// Registered for the typed_config blocks of envoy.yaml.
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"

	"github.com/quotad/quotad/config"
	"github.com/quotad/quotad/quota"
)

func TestEnvoyYAMLIsAValidBootstrap(t *testing.T) {
	raw, err := os.ReadFile("envoy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var doc any
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	js, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(js, &b); err != nil {
		t.Fatalf("envoy.yaml is not an Envoy v3 bootstrap: %v", err)
	}
	if err := b.ValidateAll(); err != nil {
		t.Fatalf("envoy.yaml fails Envoy's proto validation: %v", err)
	}
	var hcm hcmv3.HttpConnectionManager
	if err := b.StaticResources.Listeners[0].FilterChains[0].Filters[0].GetTypedConfig().UnmarshalTo(&hcm); err != nil {
		t.Fatal(err)
	}
	var rl ratelimitv3.RateLimit
	if err := hcm.HttpFilters[0].GetTypedConfig().UnmarshalTo(&rl); err != nil {
		t.Fatal(err)
	}
	if rl.Domain != "platform" || !rl.FailureModeDeny || rl.Timeout.AsDuration() != 20*time.Millisecond ||
		rl.RateLimitService.GetGrpcService().GetEnvoyGrpc().GetClusterName() != "quotad" {
		t.Errorf("ratelimit filter: %v", &rl)
	}
	if n := len(hcm.GetRouteConfig().VirtualHosts[0].Routes[0].GetRoute().RateLimits); n != 3 {
		t.Errorf("%d rate_limits on /orders, want 3 (route, tenant, tenant+consumer)", n)
	}
	var tlsCtx tlsv3.UpstreamTlsContext
	for _, c := range b.StaticResources.Clusters {
		if c.Name == "quotad" {
			if err := c.TransportSocket.GetTypedConfig().UnmarshalTo(&tlsCtx); err != nil {
				t.Fatal(err)
			}
		}
	}
	if certs := tlsCtx.CommonTlsContext.GetTlsCertificates(); len(certs) != 1 || tlsCtx.Sni != "server.quotad.quotad" {
		t.Errorf("quotad cluster: want mTLS with a client certificate and the nodes' server name, got %v", &tlsCtx)
	}
}

// TestSeed002Limits: the seed's own limits file is in limits.yaml unchanged, and with the
// descriptors envoy.yaml sends the consumer's 600, the tenant's 5000 and the platform's 60000
// a minute each refuse with their own scope.
func TestSeed002Limits(t *testing.T) {
	ex, err := config.LoadFile("limits.yaml")
	if err != nil {
		t.Fatal(err)
	}
	seed, err := config.LoadFile("../../config/testdata/valid/seed002_platform.yaml") // the seed's text
	if err != nil {
		t.Fatal(err)
	}
	d := ex.Domains[0]
	if d.Name != seed.Domains[0].Name || !reflect.DeepEqual(d.Descriptors[0], seed.Domains[0].Descriptors[0]) {
		t.Fatalf("limits.yaml's tenant tree differs from the seed's:\n%+v\n%+v", d.Descriptors[0], seed.Domains[0].Descriptors[0])
	}
	if d.Rate == nil || d.Rate.RequestsPerUnit != 60000 || d.Rate.Unit != time.Minute {
		t.Fatalf("global ceiling: %+v", d.Rate)
	}
	e := quota.NewEngine()
	if err := e.SetLimits(0, ex); err != nil {
		t.Fatal(err)
	}
	// The descriptors of envoy.yaml's three rate_limits entries.
	envoyReq := func(tenant, consumer string, tenantHits, consumerHits uint64) quota.RLSRequest {
		return quota.RLSRequest{Domain: "platform", Descriptors: []quota.RLSDescriptor{
			{Entries: []quota.Entry{{Key: "generic_key", Value: "orders"}}, HasHits: true, Hits: consumerHits},
			{Entries: []quota.Entry{{Key: "tenant", Value: tenant}}, HasHits: true, Hits: tenantHits},
			{Entries: []quota.Entry{{Key: "tenant", Value: tenant}, {Key: "consumer", Value: consumer}}, HasHits: true, Hits: consumerHits},
		}}
	}
	overScope := func(r quota.RLSDecision) string {
		var scopes []string
		for _, s := range r.Statuses {
			if s.Code == quota.RLSOverLimit {
				scopes = append(scopes, s.Scope)
			}
		}
		return r.Code.String() + " " + strings.Join(scopes, ",")
	}
	now := quota.Time(0)
	for i := range 600 {
		if r := e.RateLimit(now, envoyReq("acme", "mobile", 1, 1)); r.Code != quota.RLSOK {
			t.Fatalf("request %d of the integration's 600: %s", i+1, overScope(r))
		}
	}
	if got := overScope(e.RateLimit(now, envoyReq("acme", "mobile", 1, 1))); got != "OVER_LIMIT consumer" {
		t.Errorf("601st request of one integration: %s, want over at the consumer", got)
	}
	// Another integration of the same tenant is isolated from the first...
	if r := e.RateLimit(now, envoyReq("acme", "web", 1, 1)); r.Code != quota.RLSOK {
		t.Errorf("a second integration: %s", overScope(r))
	}
	// ... until the tenant's 5000 are used: 602 so far (each descriptor is decided on its own,
	// so the refused 601st request still charged the tenant, as in envoyproxy/ratelimit).
	if r := e.RateLimit(now, envoyReq("acme", "batch", 4398, 1)); r.Code != quota.RLSOK {
		t.Fatalf("filling the tenant to 5000: %s", overScope(r))
	}
	if got := overScope(e.RateLimit(now, envoyReq("acme", "other", 1, 1))); got != "OVER_LIMIT tenant" {
		t.Errorf("the tenant's 5001st request: %s, want over at the tenant", got)
	}
	// Another tenant is untouched; the platform's 60000 hold across all tenants (12 x 5000).
	// (Requests on another route: the orders route's own 30000 would answer first.)
	search := func(tenant string, hits uint32) quota.RLSRequest {
		return quota.RLSRequest{Domain: "platform", Hits: uint64(hits), Descriptors: []quota.RLSDescriptor{
			{Entries: []quota.Entry{{Key: "generic_key", Value: "search"}}},
			{Entries: []quota.Entry{{Key: "tenant", Value: tenant}}},
		}}
	}
	// The ceiling is charged once per admitted request (its hits_addend, here 1): 602 so far.
	for i := range 11 {
		if r := e.RateLimit(now, search("t"+string(rune('a'+i)), 5000)); r.Code != quota.RLSOK {
			t.Fatalf("tenant %d's 5000: %s", i, overScope(r))
		}
	}
	// 602 + 55000: 4398 left.
	if r := e.RateLimit(now, search("tz", 4398)); r.Code != quota.RLSOK {
		t.Fatalf("the ceiling's last unit: %s", overScope(r))
	}
	if got := overScope(e.RateLimit(now, search("ty", 1))); got != "OVER_LIMIT domain,domain" {
		t.Errorf("over the platform's 60000: %s, want every descriptor over at the domain", got)
	}
	// A minute later everything has refilled.
	if r := e.RateLimit(now.Add(time.Minute), envoyReq("acme", "mobile", 1, 1)); r.Code != quota.RLSOK {
		t.Errorf("a minute later: %s", overScope(r))
	}
	// The seed's own action list (tenant, consumer, generic_key as one descriptor) is deeper
	// than the tree: Envoy's rule gives it no limit at all (docs/envoy.md).
	one := quota.RLSRequest{Domain: "platform", Descriptors: []quota.RLSDescriptor{{Entries: []quota.Entry{
		{Key: "tenant", Value: "acme"}, {Key: "consumer", Value: "mobile"}, {Key: "generic_key", Value: "orders"}}}}}
	if r := e.RateLimit(now.Add(time.Minute), one); r.Code != quota.RLSOK || r.Statuses[0].Limited {
		t.Errorf("the seed's single descriptor: %+v, want OK without a limit", r.Statuses[0])
	}
}
