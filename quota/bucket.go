package quota

import (
	"fmt"
	"math"
	"math/bits"
	"time"
)

// microPerUnit is the fixed-point scale of bucket balances: one unit is 1e6 micro-units, so
// slow rates (one unit per day) still refill in small integral steps.
const microPerUnit = 1_000_000

// maxDuration saturates durations that would not fit in a time.Duration.
const maxDuration = time.Duration(math.MaxInt64)

// rateParams is a Rate in the form the bucket arithmetic needs.
type rateParams struct {
	rpu      uint64 // RequestsPerUnit
	capUnits uint64 // capacity in units
	capMicro uint64
	rpuMicro uint64 // RequestsPerUnit in micro-units, credited per unit ns
	unit     uint64 // Unit in ns, > 0
	window   time.Duration
}

func newRateParams(r *Rate) (*rateParams, error) {
	if r.Unit <= 0 {
		return nil, fmt.Errorf("rate_limit.unit must be > 0 (got %v); use e.g. 1s, 1m, 1h", r.Unit)
	}
	if r.RequestsPerUnit == 0 {
		return nil, fmt.Errorf("rate_limit.requests_per_unit must be > 0 (got 0); use unlimited: true for no limit")
	}
	if r.RequestsPerUnit > maxUnits {
		return nil, fmt.Errorf("rate_limit.requests_per_unit must be <= %d (got %d)", maxUnits, r.RequestsPerUnit)
	}
	if r.Burst > maxUnits {
		return nil, fmt.Errorf("rate_limit.burst must be <= %d (got %d)", maxUnits, r.Burst)
	}
	c := r.Capacity()
	return &rateParams{
		rpu:      r.RequestsPerUnit,
		capUnits: c,
		capMicro: c * microPerUnit,
		rpuMicro: r.RequestsPerUnit * microPerUnit,
		unit:     uint64(r.Unit),
		window:   r.Unit,
	}, nil
}

func (r *rateParams) same(o *rateParams) bool { return *r == *o }

// refill returns the balance (micro-units) of a bucket that held tokens at time last, as of now,
// and the new "last": the instant up to which refill has been credited.
//
// It never over-credits: the credit is floor(elapsed·rate), and last advances only by the
// (rounded-up) time those whole micro-units took, so the fractional remainder is kept for later
// rather than lost (a frequently touched slow bucket still refills) or rounded up.
func (r *rateParams) refill(tokens uint64, last, now Time) (uint64, Time) {
	if tokens >= r.capMicro {
		return r.capMicro, now
	}
	if now <= last {
		return tokens, last
	}
	elapsed := uint64(now - last)
	hi, lo := bits.Mul64(elapsed, r.rpuMicro)
	if hi >= r.unit { // the credit alone exceeds 2^64 micro-units
		return r.capMicro, now
	}
	q, _ := bits.Div64(hi, lo, r.unit)
	if q >= r.capMicro-tokens {
		return r.capMicro, now
	}
	// q·unit/rpuMicro ≤ elapsed < 2^63, so the quotient fits and hi < rpuMicro.
	hi, lo = bits.Mul64(q, r.unit)
	d, rem := bits.Div64(hi, lo, r.rpuMicro)
	if rem != 0 {
		d++
	}
	return tokens + q, last + Time(d)
}

// timeFor returns how long refill takes to credit needMicro micro-units (rounded up).
func (r *rateParams) timeFor(needMicro uint64) time.Duration {
	if needMicro == 0 {
		return 0
	}
	hi, lo := bits.Mul64(needMicro, r.unit)
	if hi >= r.rpuMicro {
		return maxDuration
	}
	d, rem := bits.Div64(hi, lo, r.rpuMicro)
	if rem != 0 {
		d++
	}
	if d > math.MaxInt64 {
		return maxDuration
	}
	return time.Duration(d)
}

// fullAt returns when a bucket whose stored state is (tokens, last) is full, absent debits.
func (r *rateParams) fullAt(tokens uint64, last Time) Time {
	if tokens >= r.capMicro {
		// Full already — also when last is ahead of the clock (a scheduled grant, then a
		// refund that made it whole): it equals an absent bucket at any time.
		return 0
	}
	return addSat(last, r.timeFor(r.capMicro-tokens))
}

// waitUntil returns how long after now a bucket whose stored state is (tokens, last) holds
// wantMicro micro-units (0 if it already does). Computed from the stored state, not a refilled
// copy, so it is exact for what later refills will compute.
func (r *rateParams) waitUntil(tokens uint64, last, now Time, wantMicro uint64) time.Duration {
	if tokens >= wantMicro {
		return 0
	}
	d := r.timeFor(wantMicro - tokens)
	if d == maxDuration || int64(last) > math.MaxInt64-int64(d) {
		return maxDuration
	}
	at := last + Time(d)
	if at <= now {
		return 0
	}
	return at.Sub(now)
}
