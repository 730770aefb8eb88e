package fsm

import (
	"bytes"
	"io"
	"testing"
	"time"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/quota"
)

var policyLimits = &quota.Limits{Domains: []quota.Domain{{
	Name:         "provider",
	Rate:         &quota.Rate{Unit: time.Second, RequestsPerUnit: 100},
	Adaptive:     &quota.Adaptive{Floor: 10, DecreasePercent: 50, Increase: 5, StableWindow: time.Second},
	RetryBudget:  &quota.RetryBudget{RatioPercent: 10},
	ResumeJitter: time.Second,
	Descriptors:  []quota.Node{{Key: "tenant", Rate: &quota.Rate{Unit: time.Second, RequestsPerUnit: 50}}},
}}}

func feedback(prefix []*quotadv1.Entry, status uint32, retryAfter time.Duration, reason string) *fsmv1.Op {
	return &fsmv1.Op{Op: &fsmv1.Op_Feedback{Feedback: &fsmv1.Feedback{Domain: "provider", Prefix: prefix,
		StatusCode: status, RetryAfterNs: int64(retryAfter), Reason: reason}}}
}

func retryOp(client string, id uint64, tenant string) *fsmv1.Op {
	op := acquire(client, id, tenant, 1)
	op.GetAcquire().Admission.Attempt = 2
	return op
}

func policyLog(t *testing.T) *log {
	l := &log{t: t, f: New(Options{DedupWindow: 10 * time.Second})}
	if r := l.apply(0, setLimits(t, policyLimits)); r.Ops[0].Other.Err != nil {
		t.Fatal(r.Ops[0].Other.Err)
	}
	return l
}

// TestFeedbackOpPausesScopeWithJitter: the Feedback op pauses exactly the named tenant; paused
// requests get the pause end plus a jitter derived from their IDs, the same on every replica.
func TestFeedbackOpPausesScopeWithJitter(t *testing.T) {
	l, r := policyLog(t), policyLog(t)
	acme := []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}
	for _, lg := range []*log{l, r} {
		res := lg.apply(time.Second, feedback(acme, 429, 5*time.Second, "")).Ops[0].Other
		if res.Err != nil || res.PausedFor != 5*time.Second || res.Scope != "tenant" || !res.Feedback.Attributed {
			t.Fatalf("feedback: %+v", res)
		}
	}
	seen := map[time.Duration]bool{}
	for id := uint64(1); id <= 50; id++ {
		d := l.apply(2*time.Second, acquire("c", id, "acme", 1)).Ops[0].Decision
		if d.Reason != quota.ReasonPaused || d.RetryAfter < 4*time.Second || d.RetryAfter >= 5*time.Second {
			t.Fatalf("request %d: %+v, want paused with retry_after in [4s, 5s)", id, d)
		}
		if rd := r.apply(2*time.Second, acquire("c", id, "acme", 1)).Ops[0].Decision; rd.RetryAfter != d.RetryAfter {
			t.Fatalf("replicas disagree on retry_after: %v vs %v", d.RetryAfter, rd.RetryAfter)
		}
		seen[d.RetryAfter] = true
	}
	if len(seen) < 45 {
		t.Errorf("only %d distinct retry_after values over 50 requests: resumption not spread", len(seen))
	}
	if l.f.Hash() != r.f.Hash() {
		t.Error("replicas' hashes differ")
	}
	if d := l.apply(2*time.Second, acquire("c", 100, "other", 1)).Ops[0].Decision; !d.Admitted {
		t.Errorf("another tenant was paused: %+v", d)
	}
	if res := l.apply(3*time.Second, feedback(nil, 500, 0, "x")).Ops[0].Other; res.Err == nil {
		t.Error("status 500 accepted")
	}
}

// TestPolicyStateSurvivesSnapshot: adaptive rates and retry budgets are in snapshots; a
// restored replica continues exactly like the original, and a retried request ID is charged
// to the retry budget once.
func TestPolicyStateSurvivesSnapshot(t *testing.T) {
	l := policyLog(t)
	res := l.apply(time.Second, feedback(nil, 429, 0, "global")).Ops[0].Other.Feedback
	if !res.Decreased || res.Limit != 50 {
		t.Fatalf("feedback: %+v", res)
	}
	for id := uint64(1); id <= 10; id++ {
		if d := l.apply(time.Second, retryOp("c", id, "acme")).Ops[0].Decision; !d.Admitted {
			t.Fatalf("retry %d: %+v", id, d)
		}
	}
	if op := l.apply(time.Second, retryOp("c", 10, "acme")).Ops[0]; !op.Duplicate || !op.Decision.Admitted {
		t.Fatalf("transport retry of an admitted request: %+v", op)
	}
	if d := l.apply(time.Second, retryOp("c", 11, "acme")).Ops[0].Decision; d.Reason != quota.ReasonRetryBudgetExhausted {
		t.Fatalf("11th retry: %+v", d)
	}

	snap := snapshotBytes(t, l.f)
	restored := New(Options{DedupWindow: 10 * time.Second})
	if err := restored.Restore(io.NopCloser(bytes.NewReader(snap))); err != nil {
		t.Fatal(err)
	}
	if restored.Hash() != l.f.Hash() {
		t.Fatal("restored hash differs")
	}
	r := &log{t: t, f: restored, index: l.index}
	for i, op := range []*fsmv1.Op{retryOp("c", 12, "acme"), acquire("c", 13, "acme", 1), feedback(nil, 429, time.Second, "global")} {
		a, b := l.apply(1500*time.Millisecond+time.Duration(i)*time.Second, op).Ops[0], r.apply(1500*time.Millisecond+time.Duration(i)*time.Second, op).Ops[0]
		if a.Decision.Reason != b.Decision.Reason || feedbackOf(a) != feedbackOf(b) {
			t.Fatalf("op %d: original %+v, restored %+v", i, a, b)
		}
	}
	if restored.Hash() != l.f.Hash() {
		t.Fatal("hashes differ after the same ops")
	}
	st, err := restored.Status("provider", nil)
	// 50 after the first decrease, +5 at 2s and 3s, then halved at 3.5s.
	if err != nil || st[0].Limit != 30 || st[0].Ceiling != 100 {
		t.Errorf("status after two decreases: %+v %v, want limit 30 of 100", st, err)
	}
}

// feedbackOf is a feedback op's result, or the zero value for an op of another kind.
func feedbackOf(r OpResult) quota.FeedbackResult {
	if r.Other == nil {
		return quota.FeedbackResult{}
	}
	return r.Other.Feedback
}
