package rpc

import (
	"strings"
	"testing"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// TestObserveDecisionsMatchesOneByOne: counting a call's decisions in runs of equal reasons
// exports exactly what observing them one at a time does.
func TestObserveDecisionsMatchesOneByOne(t *testing.T) {
	calls := [][]string{
		{"ok"},
		{"ok", "ok", "ok", "rate_limited", "rate_limited", "ok", "invalid"},
		{"rate_limited", "ok", "rate_limited"},
		{},
	}
	one, batched := NewMetrics(), NewMetrics()
	for i, reasons := range calls {
		took := time.Duration(i+1) * 700 * time.Microsecond
		ds := make([]*quotadv1.Decision, len(reasons))
		for j, r := range reasons {
			ds[j] = &quotadv1.Decision{Reason: r}
			one.observeDecision(r, took)
		}
		batched.observeDecisions(ds, took)
	}
	want, got := decisionMetrics(t, one), decisionMetrics(t, batched)
	if got != want {
		t.Fatalf("observeDecisions exported\n%s\nobserving one by one exported\n%s", got, want)
	}
	if !strings.Contains(want, "rate_limited") || !strings.Contains(want, "sample_count:11") {
		t.Fatalf("the test observed less than it meant to:\n%s", want)
	}
	var nilMetrics *Metrics
	nilMetrics.observeDecisions([]*quotadv1.Decision{{Reason: "ok"}}, time.Millisecond) // records nothing, no panic
}

func decisionMetrics(t *testing.T, m *Metrics) string {
	t.Helper()
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, mf := range mfs {
		if strings.HasPrefix(mf.GetName(), "quotad_decision") {
			for _, m := range mf.GetMetric() { // when a series was created differs, of course
				if c := m.GetCounter(); c != nil {
					c.CreatedTimestamp = nil
				}
				if h := m.GetHistogram(); h != nil {
					h.CreatedTimestamp = nil
				}
			}
			b.WriteString(strings.ReplaceAll(mf.String(), " ", "") + "\n")
		}
	}
	return b.String()
}
