package rpc

import (
	"encoding/json"
	"net/http"
	"slices"
	"time"
)

// FairView is the fair scheduler's state on one node, served as JSON at /debug/fair (the
// data behind `quotad top`). Only the leader has queues. Tenants appear by flow name here —
// this is an operator's view, not a metrics label.
type FairView struct {
	Node     string `json:"node"`
	IsLeader bool   `json:"is_leader"`
	Waiting  int    `json:"waiting"`
	// ReleaseHorizonMs is how far ahead of a bucket's next unit grants are released (the
	// leader's estimate of how long a released grant takes to reach a log entry).
	ReleaseHorizonMs float64 `json:"release_horizon_ms"`
	// MomentExchanges counts the held moments newcomers took from grants released ahead of
	// them since this node started (rpc/sched_exchange.go).
	MomentExchanges uint64           `json:"moment_exchanges"`
	Buckets         []FairBucketView `json:"buckets"`
}

// FairBucketView is one contended bucket: its waiters and who got its capacity lately.
type FairBucketView struct {
	Domain string `json:"domain"`
	Scope  string `json:"scope"`
	Key    string `json:"key"`
	// Waiting admissions and their total cost.
	Waiting     int    `json:"waiting"`
	WaitingCost uint64 `json:"waiting_cost"`
	// OldestWaitMs is the age of the longest-waiting admission.
	OldestWaitMs float64 `json:"oldest_wait_ms"`
	// LargestShare is the largest tenant's share of the admitted cost in the window.
	LargestShare float64 `json:"largest_share"`
	// WindowS is the length of the usage window, seconds (between one and two windows).
	WindowS float64        `json:"window_s"`
	Flows   []FairFlowView `json:"flows"`
}

// FairFlowView is one tenant (flow) on a contended bucket.
type FairFlowView struct {
	Flow         string  `json:"flow"`
	Tier         string  `json:"tier"`
	Weight       uint32  `json:"weight"`
	Waiting      int     `json:"waiting"`
	OldestWaitMs float64 `json:"oldest_wait_ms"`
	// AdmittedCost in the usage window and its share of the bucket's admitted cost.
	AdmittedCost uint64  `json:"admitted_cost"`
	Share        float64 `json:"share"`
	AvgWaitMs    float64 `json:"avg_wait_ms"`
	MaxWaitMs    float64 `json:"max_wait_ms"`
}

// FairView returns the scheduler's current state.
func (s *Server) FairView(nodeID string) FairView {
	f := s.fair
	now := time.Now()
	v := FairView{Node: nodeID, IsLeader: s.node.IsLeader()}
	f.mu.Lock()
	defer f.mu.Unlock()
	v.ReleaseHorizonMs = ms(f.horizon)
	v.MomentExchanges = f.holds.count()
	keys := make([]string, 0, len(f.usage))
	for k := range f.usage {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		u, q := f.usage[k], f.queues[k]
		if q == nil && u.idle(now) {
			delete(f.usage, k) // as pruneUsage does
			continue
		}
		fl, total := u.flows(now)
		b := FairBucketView{Key: k, Domain: u.domain, Scope: u.scope, WindowS: now.Sub(u.started).Seconds() + u.length.Seconds()}
		flows := map[string]*FairFlowView{}
		get := func(name string) *FairFlowView {
			if x := flows[name]; x != nil {
				return x
			}
			x := &FairFlowView{Flow: name}
			flows[name] = x
			return x
		}
		if q != nil {
			b.Domain, b.Scope, b.Waiting, b.WaitingCost = q.domain, q.scope, q.q.Len(), q.cost
			if t, ok := q.q.Oldest(); ok {
				b.OldestWaitMs = ms(now.Sub(t))
			}
			for _, fs := range q.q.Flows() {
				x := get(fs.Flow)
				x.Weight, x.Waiting, x.OldestWaitMs = fs.Weight, fs.Waiting, ms(now.Sub(fs.Oldest))
			}
		}
		for name, us := range fl {
			x := get(name)
			x.Tier, x.AdmittedCost = us.Tier, us.Cost
			if total > 0 {
				x.Share = float64(us.Cost) / float64(total)
				b.LargestShare = max(b.LargestShare, x.Share)
			}
			if us.N > 0 {
				x.AvgWaitMs = ms(us.WaitSum) / float64(us.N)
			}
			x.MaxWaitMs = ms(us.WaitMax)
		}
		for _, x := range flows {
			b.Flows = append(b.Flows, *x)
		}
		slices.SortFunc(b.Flows, func(a, c FairFlowView) int {
			if a.AdmittedCost != c.AdmittedCost {
				if a.AdmittedCost > c.AdmittedCost {
					return -1
				}
				return 1
			}
			if a.Flow < c.Flow {
				return -1
			}
			if a.Flow > c.Flow {
				return 1
			}
			return 0
		})
		v.Waiting += b.Waiting
		v.Buckets = append(v.Buckets, b)
	}
	return v
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func (s *Server) fairHandler(nodeID string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(s.FairView(nodeID))
	})
}

// FairView returns this agent's fair scheduler state (see Server.FairView).
func (a *Agent) FairView() FairView { return a.server.FairView(a.cfg.Cluster.ID) }
