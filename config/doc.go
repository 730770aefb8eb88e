// Package config reads and writes quotad limits files: envoyproxy/ratelimit's YAML format plus
// quotad's optional extensions, turned into a *quota.Limits.
//
// A limits file holds one or more YAML documents separated by "---"; each document is one
// domain. A domain may appear only once across everything loaded together.
//
//	domain: provider                      # required
//	rate_limit: {unit: second, requests_per_unit: 100, burst: 100}  # quotad: domain ceiling
//	concurrency: {max_in_flight: 50, lease_ttl: 30s}                # quotad: domain-wide
//	descriptors:
//	  - key: endpoint
//	    value: charges                    # optional; absent: every value gets its own buckets
//	    rate_limit: {unit: second, requests_per_unit: 20, burst: 10}
//	    shadow_mode: false
//	    weight: 2                         # quotad: fair-share weight
//	    concurrency: {max_in_flight: 10, lease_ttl: 30s}
//	    descriptors: [...]                # nested levels
//
// Envoy fields: domain, descriptors, key, value, rate_limit {unit, requests_per_unit,
// unit_multiplier, unlimited, name, replaces: [{name}]}, shadow_mode, detailed_metric (accepted
// and ignored). quotad also accepts unlimited, name and replaces directly on a descriptor (one
// place or the other, not both).
//
// Units are second, minute, hour, day, week, month and year, case-insensitive; a month is 30
// days and a year 365 days (fixed lengths: a token bucket refills at a constant rate).
// unit_multiplier (envoy) stretches the unit: {unit: minute, unit_multiplier: 5} is 5 minutes.
// burst defaults to requests_per_unit (one unit's worth) and is always stored explicitly.
// lease_ttl is a Go duration ("30s", "2m"); it defaults to DefaultLeaseTTL.
//
// Validation is strict, because a typo in a limits file silently removes a limit: unknown keys
// at any level, wrong YAML types, bad units, zero or negative amounts, duplicate sibling
// descriptors and duplicate domains are all errors. Every error is an *Error naming the file,
// line, key path and offending value and saying what to do; Parse reports all of them at once
// (errors.Join), sorted by line.
//
// This package only reads and writes bytes and files; it never talks to a cluster and never
// panics on any input.
package config
