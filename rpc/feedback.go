package rpc

import (
	"strconv"

	"github.com/quotad/quotad/quota"
)

// observeFeedback counts one applied provider feedback. domain is a configured domain (the FSM
// refused unknown ones), so the label's cardinality is that of the limits file.
func (m *Metrics) observeFeedback(domain string, statusCode uint32, r quota.FeedbackResult) {
	if m == nil {
		return
	}
	outcome := "evidence"
	switch {
	case r.Decreased:
		outcome = "decreased"
	case r.PausedFor > 0:
		outcome = "paused"
	case r.Attributed:
		outcome = "attributed"
	}
	m.feedback.WithLabelValues(domain, strconv.FormatUint(uint64(statusCode), 10), outcome).Inc()
}
