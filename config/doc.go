// Package config reads and writes quotad limits files: envoyproxy/ratelimit's YAML format plus
// quotad's optional extensions, turned into a *quota.Limits.
//
// A limits file holds one or more YAML documents separated by "---"; each document is one
// domain. A domain may appear only once across everything loaded together.
//
//	domain: provider                      # required
//	rate_limit: {unit: second, requests_per_unit: 100, burst: 100}  # quotad: domain ceiling
//	concurrency: {max_in_flight: 50, lease_ttl: 30s}                # quotad: domain-wide
//	adaptive: {floor: 20, decrease_percent: 70, increase: 1, stable_window: 5s}  # quotad: AIMD
//	retry_budget: {ratio_percent: 10, min_per_second: 1}           # quotad: retries (attempt > 1)
//	work_classes: [{name: interactive, reserve_percent: 10}, {name: backfill}]   # quotad
//	resume_jitter: 1s                     # quotad: spread of resumption after a provider pause
//	max_pause: 5m                         # quotad: longest pause one provider feedback may set
//	max_keys: 100000                      # quotad: buckets the domain may hold at once
//	strict_keys: true                     # quotad: refuse descriptor keys not defined here
//	descriptors:
//	  - key: endpoint
//	    value: charges                    # optional; absent: every value gets its own buckets
//	    rate_limit: {unit: second, requests_per_unit: 20, burst: 10}
//	    shadow_mode: false
//	    weight: 2                         # quotad: fair-share weight
//	    concurrency: {max_in_flight: 10, lease_ttl: 30s}
//	    adaptive: {floor: 2}              # quotad: AIMD under this level's rate_limit
//	    descriptors:
//	      - key: consumer
//	        rate_limit: {unit: second, requests_per_unit: 5}
//	        max_keys_per_parent: 1000     # quotad: buckets per value of the level above
//	    descriptors: [...]                # nested levels
//
// Envoy fields (envoyproxy/ratelimit's loader accepts them; quotad gives them the same
// meaning): domain, descriptors, key, value, rate_limit {unit, requests_per_unit, unlimited,
// name, replaces: [{name}]}, shadow_mode, quota_mode, detailed_metric, value_to_metric,
// share_threshold. In detail:
//   - requests_per_unit 0, or a rate_limit with a unit and no requests_per_unit, blocks the
//     level: every request is refused there (burst is then refused);
//   - a value ending in * is a wildcard: it matches every value with that prefix ("*" every
//     value), each value with its own buckets; the first wildcard in file order wins and an
//     exact value beats every wildcard; a * anywhere else is an ordinary character;
//     share_threshold: true (wildcards only) makes the matching values share one bucket;
//   - unlimited: true may come with requests_per_unit (ignored, as envoy does) but not with a
//     unit; unquoted YAML 1.1 booleans (yes/no/on/off) are read as envoy reads them;
//   - quota_mode answers a descriptor over its limit OK on the RLS and reports it;
//     detailed_metric and value_to_metric choose the key of the RLS statistics.
// `metadata` is not an envoyproxy/ratelimit key (its loader refuses it), so quotad refuses it.
//
// quotad extensions, which envoyproxy/ratelimit's loader refuses: burst, unit_multiplier
// (proposed upstream for Envoy's RLS proto; stretches the unit), concurrency, adaptive,
// weight, the domain-level keys other than domain/descriptors, and unlimited, name and
// replaces given directly on a descriptor (one place or the other, not both). A domain-level
// rate_limit is accepted by envoy and ignored there; in quotad it is the domain's ceiling.
// A file may hold several documents (envoy reads only the first). docs/envoy.md lists every
// difference.

// Units are second, minute, hour, day, week, month and year, case-insensitive; a month is 30
// days and a year 365 days (fixed lengths: a token bucket refills at a constant rate).
// unit_multiplier (envoy) stretches the unit: {unit: minute, unit_multiplier: 5} is 5 minutes.
// burst defaults to requests_per_unit (one unit's worth) and is always stored explicitly.
// lease_ttl is a Go duration ("30s", "2m"); it defaults to DefaultLeaseTTL.
// adaptive needs a rate_limit on its level (the ceiling) and a floor; decrease_percent (the share
// kept on a confirmed 429, 1..99), increase and stable_window default to DefaultDecreasePercent,
// DefaultIncrease and DefaultStableWindow. work_classes' reserve_percent may be 0 and must add
// up to at most 100; names are unique. retry_budget needs ratio_percent (0..100);
// min_per_second defaults to 0; both 0 is an error. max_keys (1..2^30, default
// quota.DefaultMaxKeys) caps the buckets the domain stores at once (a bucket is stored while it
// is not full); an admission that would store more is refused with reason too_many_keys,
// except for a shadow_mode level's bucket, which is then not stored and the level reported
// (shadow, not enforced; fsm command version 7). A share lend that would store buckets beyond
// max_keys or max_keys_per_parent is not made: the path is decided centrally.
// max_keys_per_parent (1..2^30, on a rate-limited level without a value) caps the buckets that
// level stores under one path of its parent (e.g. the consumers of one tenant), so callers who
// may invent values there fill only their own part of max_keys; beyond it, too_many_keys. It
// needs every node at fsm command version 6 (ApplyLimits refuses it before).
// strict_keys: true (default false) refuses, as invalid and naming it, a request's descriptor
// key the domain does not define at that point of its tree; without it, matching stops there
// and the levels below are not charged (envoy's behaviour), so a typo (endpont=charges) skips
// the endpoint's limit silently.
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
