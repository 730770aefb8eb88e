package main

import (
	"fmt"

	"github.com/spf13/pflag"

	"github.com/quotad/quotad/rpc"
)

// rlsFlags configure Envoy's rate limit service (docs/envoy.md).
type rlsFlags struct {
	unknownDomain string
	headers       string
	nearRatio     float64
	overrides     bool
}

func (r *rlsFlags) register(f *pflag.FlagSet) {
	f.StringVar(&r.unknownDomain, "rls-unknown-domain", "allow", "Envoy RLS answer for a domain the limits do not define: allow (OK, as envoyproxy/ratelimit) or deny (OVER_LIMIT)")
	f.StringVar(&r.headers, "rls-headers", "none", "Envoy RLS response headers: none, ratelimit (RateLimit-Limit/-Remaining/-Reset/-Scope) or x-ratelimit (X-RateLimit-...)")
	f.BoolVar(&r.overrides, "rls-limit-overrides", false, "accept a descriptor's own limit in Envoy RLS requests (Envoy's per-descriptor override; it replaces the configured limit, so only when the RLS callers are trusted gateways; docs/envoy.md)")
	f.Float64Var(&r.nearRatio, "rls-near-limit-ratio", rpc.DefaultNearLimitRatio, "share of a limit above which Envoy RLS hits count as near_limit (envoyproxy/ratelimit's NEAR_LIMIT_RATIO)")
}

func (r *rlsFlags) apply(cfg *rpc.AgentConfig) error {
	switch r.unknownDomain {
	case "allow":
		cfg.RLS.DenyUnknownDomain = false
	case "deny":
		cfg.RLS.DenyUnknownDomain = true
	default:
		return fmt.Errorf("--rls-unknown-domain %q: use allow or deny", r.unknownDomain)
	}
	switch r.headers {
	case "none":
		cfg.RLS.Headers = rpc.RLSHeadersOff
	case rpc.RLSHeadersRateLimit, rpc.RLSHeadersXRateLimit:
		cfg.RLS.Headers = r.headers
	default:
		return fmt.Errorf("--rls-headers %q: use none, ratelimit or x-ratelimit", r.headers)
	}
	if r.nearRatio <= 0 || r.nearRatio > 1 {
		return fmt.Errorf("--rls-near-limit-ratio %v: use a ratio above 0 and at most 1 (default %v)", r.nearRatio, rpc.DefaultNearLimitRatio)
	}
	cfg.RLS.NearLimitRatio = r.nearRatio
	cfg.RLS.AllowLimitOverride = r.overrides
	return nil
}
