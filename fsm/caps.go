package fsm

import (
	"fmt"

	"github.com/quotad/quotad/quota"
)

// admissionFingerprint is a 64-bit FNV-1a hash of what an admission asks for: domain,
// descriptors, cost, lease TTL, attempt and work class (cost 0 counts as 1 and attempt 0 as
// 1, as the engine reads them). It leaves out the request's IDs (the dedup key) and max_wait,
// which a client or the leader's scheduler may change between retries of one request. Never
// 0: 0 marks a record whose fingerprint is not known.
func admissionFingerprint(a *acquireOp) uint64 {
	const prime = 1099511628211
	h := uint64(14695981039346656037)
	str := func(s string) {
		for i := 0; i < len(s); i++ {
			h = (h ^ uint64(s[i])) * prime
		}
		h = (h ^ 0xff) * prime // terminator: "ab"+"c" differs from "a"+"bc"
	}
	u64 := func(v uint64) {
		for range 8 {
			h = (h ^ (v & 0xff)) * prime
			v >>= 8
		}
	}
	r := &a.req
	str(r.Domain)
	u64(uint64(len(r.Descriptors)))
	for _, e := range r.Descriptors {
		str(e.Key)
		str(e.Value)
	}
	u64(max(r.Cost, 1))
	u64(uint64(r.LeaseTTL))
	u64(uint64(max(r.Attempt, 1)))
	str(r.WorkClass)
	if h == 0 {
		h = 1
	}
	return h
}

// conflictDecision is the answer to a request ID reused for a different request.
func conflictDecision(clientID string, id uint64) quota.Decision {
	return quota.Decision{Reason: quota.ReasonRequestIDConflict, Message: fmt.Sprintf(
		"request_id %d of client_id %.64q was already used for a different request (domain, descriptors, cost, lease TTL, attempt or work class differ); "+
			"use a new request ID for a new request, and resend a retry unchanged", id, clientID)}
}

// opProblem returns why a decoded Acquire op carries more than the rpc layer lets through,
// or "". A correct leader never proposes such an op; checking it here keeps every replica's
// answer the same whatever a leader proposed (the engine checks the admission's own fields).
func opProblem(a *acquireOp) string {
	if n := len(a.clientID); n > quota.MaxFieldBytes {
		return fmt.Sprintf("client_id is %d bytes; the limit is %d bytes", n, quota.MaxFieldBytes)
	}
	return ""
}
