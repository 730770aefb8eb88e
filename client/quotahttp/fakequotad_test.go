package quotahttp_test

import (
	"context"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// miniQuotad is a minimal, real gRPC implementation of quotad.v1.Quota for the HTTP-layer
// tests only: one token bucket per descriptor level that has a limit, charged all-or-nothing,
// with dedup by (client_id, request_id), leases and recorded feedback. The client library's
// own behaviour is tested against the real cluster, not this.
type miniQuotad struct {
	quotadv1.UnimplementedQuotaServer

	mu        sync.Mutex
	limits    map[string]miniLimit // by descriptor key ("domain" for the domain ceiling)
	buckets   map[string]*miniBucket
	dedup     map[string]*quotadv1.Decision
	leases    map[uint64]bool
	nextLease uint64
	seen      [][]*quotadv1.Entry // descriptors of every admission, in order
	feedback  []*quotadv1.FeedbackRequest
	released  []uint64
}

type miniLimit struct {
	perWindow     uint64
	window        time.Duration
	maxInFlight   uint64
	leaseTTL      time.Duration
	concurrencyOn bool
}

type miniBucket struct {
	tokens   float64
	last     time.Time
	inFlight uint64
}

func newMiniQuotad(limits map[string]miniLimit) *miniQuotad {
	return &miniQuotad{limits: limits, buckets: map[string]*miniBucket{}, dedup: map[string]*quotadv1.Decision{}, leases: map[uint64]bool{}}
}

// start serves m on a loopback port until the test ends and returns the address.
func (m *miniQuotad) start(t *testing.T) (addr string, stop func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	quotadv1.RegisterQuotaServer(s, m)
	go s.Serve(ln)
	var once sync.Once
	stop = func() { once.Do(s.Stop) }
	t.Cleanup(stop)
	return ln.Addr().String(), stop
}

func (m *miniQuotad) Acquire(_ context.Context, req *quotadv1.AcquireRequest) (*quotadv1.AcquireResponse, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now()
	resp := &quotadv1.AcquireResponse{}
	for _, a := range req.Admissions {
		if a.RequestId == 0 || a.Domain == "" {
			return nil, status.Error(codes.InvalidArgument, "request_id and domain are required")
		}
	}
	for _, a := range req.Admissions {
		key := req.ClientId + "/" + strconv.FormatUint(a.RequestId, 10)
		if d, ok := m.dedup[key]; ok {
			resp.Decisions = append(resp.Decisions, d)
			continue
		}
		m.seen = append(m.seen, a.Descriptors)
		d := m.decide(now, a)
		m.dedup[key] = d
		resp.Decisions = append(resp.Decisions, d)
	}
	return resp, nil
}

type level struct {
	scope, key string
	lim        miniLimit
}

func (m *miniQuotad) decide(now time.Time, a *quotadv1.Admission) *quotadv1.Decision {
	cost := max(a.Cost, 1)
	var levels []level
	if l, ok := m.limits["domain"]; ok {
		levels = append(levels, level{"domain", a.Domain, l})
	}
	path := a.Domain
	for _, e := range a.Descriptors {
		path += "/" + e.Key + "=" + e.Value
		if l, ok := m.limits[e.Key]; ok {
			levels = append(levels, level{e.Key, path, l})
		}
	}
	for _, lv := range levels {
		b := m.bucket(now, lv)
		rate := float64(lv.lim.perWindow) / lv.lim.window.Seconds()
		if lv.lim.concurrencyOn && b.inFlight >= lv.lim.maxInFlight {
			return &quotadv1.Decision{Reason: "concurrency_limited", Scope: lv.scope, Limit: lv.lim.maxInFlight,
				RetryAfterMs: 1000, WindowMs: lv.lim.window.Milliseconds()}
		}
		if b.tokens < float64(cost) {
			return &quotadv1.Decision{Reason: "rate_limited", Scope: lv.scope, Limit: lv.lim.perWindow,
				Remaining:    uint64(b.tokens),
				RetryAfterMs: int64((float64(cost) - b.tokens) / rate * 1000),
				ResetAfterMs: int64((float64(lv.lim.perWindow) - b.tokens) / rate * 1000),
				WindowMs:     lv.lim.window.Milliseconds()}
		}
	}
	d := &quotadv1.Decision{Admitted: true, Reason: "ok"}
	first := true
	best := 0.0
	for _, lv := range levels {
		b := m.buckets[lv.key]
		b.tokens -= float64(cost)
		rate := float64(lv.lim.perWindow) / lv.lim.window.Seconds()
		if first || b.tokens < best {
			first, best = false, b.tokens
			d.Scope, d.Limit, d.Remaining = lv.scope, lv.lim.perWindow, uint64(b.tokens)
			d.ResetAfterMs = int64((float64(lv.lim.perWindow) - b.tokens) / rate * 1000)
			d.WindowMs = lv.lim.window.Milliseconds()
		}
		if lv.lim.concurrencyOn {
			b.inFlight++
			if d.LeaseId == 0 {
				m.nextLease++
				d.LeaseId = m.nextLease
				d.LeaseTtlMs = lv.lim.leaseTTL.Milliseconds()
				m.leases[d.LeaseId] = true
			}
		}
	}
	return d
}

func (m *miniQuotad) bucket(now time.Time, lv level) *miniBucket {
	b, ok := m.buckets[lv.key]
	if !ok {
		b = &miniBucket{tokens: float64(lv.lim.perWindow), last: now}
		m.buckets[lv.key] = b
	}
	rate := float64(lv.lim.perWindow) / lv.lim.window.Seconds()
	b.tokens = min(float64(lv.lim.perWindow), b.tokens+now.Sub(b.last).Seconds()*rate)
	b.last = now
	return b
}

func (m *miniQuotad) Release(_ context.Context, req *quotadv1.ReleaseRequest) (*quotadv1.ReleaseResponse, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.released = append(m.released, req.LeaseId)
	if !m.leases[req.LeaseId] {
		return &quotadv1.ReleaseResponse{}, nil
	}
	delete(m.leases, req.LeaseId)
	for _, b := range m.buckets {
		if b.inFlight > 0 {
			b.inFlight-- // the tests hold one lease at a time per bucket
		}
	}
	return &quotadv1.ReleaseResponse{Released: true}, nil
}

func (m *miniQuotad) Renew(_ context.Context, req *quotadv1.RenewRequest) (*quotadv1.RenewResponse, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.leases[req.LeaseId] {
		return nil, status.Error(codes.NotFound, "lease not found")
	}
	return &quotadv1.RenewResponse{LeaseTtlMs: max(req.LeaseTtlMs, 1000)}, nil
}

func (m *miniQuotad) Feedback(_ context.Context, req *quotadv1.FeedbackRequest) (*quotadv1.FeedbackResponse, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.feedback = append(m.feedback, req)
	scope := "domain"
	if n := len(req.Descriptors); n > 0 {
		scope = req.Descriptors[n-1].Key
	}
	return &quotadv1.FeedbackResponse{PausedForMs: req.RetryAfterMs, Scope: scope}, nil
}

// bucketTokens returns the whole tokens left in the bucket with the given key suffix.
func (m *miniQuotad) bucketTokens(keySuffix string) (float64, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for k, b := range m.buckets {
		if strings.HasSuffix(k, keySuffix) {
			return b.tokens, true
		}
	}
	return 0, false
}
