// Package quotahttp connects net/http to a quotad cluster: Middleware admits inbound requests
// (a gateway) and writes 429 responses with rate-limit headers; Transport admits outbound
// requests (a worker calling a provider) and reports the provider's throttling back.
//
// Identity for inbound admission comes only from a caller-supplied function that returns a
// verified identity (a validated token, an mTLS peer). This package never reads a tenant or
// consumer from a request header, and it strips such headers from inbound requests.
package quotahttp

import (
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/quotad/quotad/client"
)

// Header names written by this package.
const (
	HeaderRetryAfter          = "Retry-After"
	HeaderXRateLimitLimit     = "X-RateLimit-Limit"
	HeaderXRateLimitRemaining = "X-RateLimit-Remaining"
	HeaderXRateLimitReset     = "X-RateLimit-Reset"
	HeaderXRateLimitScope     = "X-RateLimit-Scope"
	HeaderRateLimit           = "RateLimit"
	HeaderRateLimitPolicy     = "RateLimit-Policy"
	problemContentType        = "application/problem+json"
	defaultProblemTypePrefix  = "about:blank"
)

// SetRateLimitHeaders writes the rate-limit fields describing d into h:
//
//	X-RateLimit-Limit:     d.Limit
//	X-RateLimit-Remaining: d.Remaining
//	X-RateLimit-Reset:     Unix time (seconds, rounded up) at which the bucket is full again
//	X-RateLimit-Scope:     d.Scope ("domain", "tenant", "consumer", ...)
//	RateLimit-Policy:      "<scope>";q=<limit>;w=<window seconds>
//	RateLimit:             "<scope>";r=<remaining>;t=<seconds until reset>
//
// RateLimit and RateLimit-Policy follow draft-ietf-httpapi-ratelimit-headers-11 (Structured
// Field lists of strings with integer parameters); the policy is named after the scope. now
// is the local time the reset is counted from, normally d.At. A decision with no scope (no
// limit applied) writes nothing. Retry-After is not written; see SetRetryAfter.
func SetRateLimitHeaders(h http.Header, d client.Decision, now time.Time) {
	if d.Scope == "" {
		return
	}
	resetSecs := ceilSeconds(d.ResetAfter)
	h.Set(HeaderXRateLimitLimit, strconv.FormatUint(d.Limit, 10))
	h.Set(HeaderXRateLimitRemaining, strconv.FormatUint(d.Remaining, 10))
	h.Set(HeaderXRateLimitReset, strconv.FormatInt(now.Unix()+resetSecs, 10))
	h.Set(HeaderXRateLimitScope, d.Scope)
	h.Set(HeaderRateLimitPolicy, RateLimitPolicy(d))
	h.Set(HeaderRateLimit, RateLimitField(d))
}

// RateLimitPolicy formats d's limit as a RateLimit-Policy field value:
// "<scope>";q=<limit>;w=<window seconds> (w omitted when the window is unknown).
func RateLimitPolicy(d client.Decision) string {
	var b strings.Builder
	b.WriteString(sfString(d.Scope))
	b.WriteString(";q=")
	b.WriteString(strconv.FormatUint(clampSFInt(d.Limit), 10))
	if d.Window > 0 {
		b.WriteString(";w=")
		b.WriteString(strconv.FormatInt(ceilSeconds(d.Window), 10))
	}
	return b.String()
}

// RateLimitField formats d's state as a RateLimit field value:
// "<scope>";r=<remaining>;t=<seconds until the bucket is full again>.
func RateLimitField(d client.Decision) string {
	var b strings.Builder
	b.WriteString(sfString(d.Scope))
	b.WriteString(";r=")
	b.WriteString(strconv.FormatUint(clampSFInt(d.Remaining), 10))
	b.WriteString(";t=")
	b.WriteString(strconv.FormatInt(ceilSeconds(d.ResetAfter), 10))
	return b.String()
}

// SetRetryAfter writes Retry-After as whole seconds, rounded up and at least 1 (a 429 that
// says "retry after 0" invites an immediate retry storm).
func SetRetryAfter(h http.Header, retryAfter time.Duration) {
	h.Set(HeaderRetryAfter, strconv.FormatInt(max(1, ceilSeconds(retryAfter)), 10))
}

// ParseRetryAfter parses a Retry-After value, either delay-seconds or an HTTP-date relative
// to now. It reports false for a missing or malformed value.
func ParseRetryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if secs, err := strconv.ParseInt(v, 10, 64); err == nil {
		if secs < 0 {
			return 0, false
		}
		if secs > int64(365*24*time.Hour/time.Second) {
			secs = int64(365 * 24 * time.Hour / time.Second)
		}
		return time.Duration(secs) * time.Second, true
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(0, t.Sub(now)), true
	}
	return 0, false
}

func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	secs := int64(d / time.Second)
	if d%time.Second != 0 {
		secs++
	}
	return secs
}

// clampSFInt keeps v within a Structured Field Integer (at most 15 digits).
func clampSFInt(v uint64) uint64 {
	const maxSFInt = 999_999_999_999_999
	return min(v, maxSFInt)
}

// sfString formats s as a Structured Field String (RFC 9651 §3.3.3): quoted, with '"' and
// '\' escaped; characters outside printable ASCII, which a String cannot hold, become '_'.
func sfString(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 2)
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			b.WriteByte('\\')
			b.WriteByte(c)
		case c < 0x20 || c > 0x7e:
			b.WriteByte('_')
		default:
			b.WriteByte(c)
		}
	}
	b.WriteByte('"')
	return b.String()
}
