// Package chaos is quotad's chaos suite: it builds the quotad binary with the chaos build tag,
// runs real agent processes (or containers), injects faults from a seeded nemesis while
// concurrent workloads spend quota through the Go client, and checks the recorded history
// against the design's invariants (DESIGN.md, "Invariants" and "Chaos suite").
//
// The checkers are plain functions over a History and run in `make test` (checkers_test.go
// feeds them broken histories). The real-process run is TestChaos, enabled by
// QUOTAD_CHAOS=1 (see chaos_test.go and the Makefile targets chaos and chaos-long); it never
// runs by accident in `go test ./...`.
//
// Everything is measured on the test process's clock: an operation's Call and Return are
// nanoseconds since the run started, taken just before the call and just after its answer, so
// the real decision happened somewhere in [Call, Return]. The checkers only ever conclude from
// that interval, never from a node's clock.
package chaos

import (
	"encoding/json"
	"os"
	"slices"
	"time"
)

// Op kinds.
const (
	KindSpend = "spend" // non-refilling budget bucket (linearizability)
	KindRate  = "rate"  // refilling bucket (bounded admission)
	KindLease = "lease" // concurrency permit (in-flight limit, reclaim)
)

// Outcomes of an admission.
const (
	Admitted = "admitted"
	Denied   = "denied"
	Unknown  = "unknown" // no answer: the decision may or may not have been made (once)
	Failed   = "error"   // the request was refused as invalid; not a quota decision
)

// Op is one admission as the workload saw it. Attempts that reused one request ID (the
// client's transport retries, and the workload's own re-send to learn a lost outcome) are one
// Op: Call is the first attempt's start and Return the answer that settled it.
type Op struct {
	Index     int    `json:"index"`
	Worker    int    `json:"worker"`
	Kind      string `json:"kind"`
	Domain    string `json:"domain"`
	Bucket    string `json:"bucket"` // the descriptor value that names the bucket
	Cost      uint64 `json:"cost"`
	ClientID  string `json:"client_id"`
	RequestID uint64 `json:"request_id"`
	Call      int64  `json:"call"`   // ns since the run started
	Return    int64  `json:"return"` // ns since the run started; meaningless when Outcome is Unknown
	Outcome   string `json:"outcome"`
	Reason    string `json:"reason,omitempty"`
	Remaining uint64 `json:"remaining,omitempty"`
	// Resolved is set when the outcome was learned by re-sending the request ID after the
	// first call gave up.
	Resolved bool `json:"resolved,omitempty"`
	// Cause says why the first call ended without an answer (deadline, lost-reply,
	// unavailable); set on every op whose outcome was unknown, resolved later or not.
	Cause string `json:"cause,omitempty"`
	// NotResent marks an unknown spend deliberately never re-sent: it stays ambiguous.
	NotResent bool `json:"not_resent,omitempty"`
	// LeaseID and LeaseTTL are set for admitted lease ops.
	LeaseID  uint64        `json:"lease_id,omitempty"`
	LeaseTTL time.Duration `json:"lease_ttl,omitempty"`
	// ReleaseCall is when the holder started releasing the lease; -1 if it never did (it
	// "crashed"). ReleaseReturn is when the release was acknowledged (-1: never).
	ReleaseCall   int64 `json:"release_call,omitempty"`
	ReleaseReturn int64 `json:"release_return,omitempty"`
}

// Replay is one re-send of an acknowledged request ID, and what came back: the dedup table
// must answer with the original decision (within the dedup window).
type Replay struct {
	Op        int    `json:"op"` // index of the original Op
	At        int64  `json:"at"`
	Phase     string `json:"phase"` // "live" (during the run) or "restart" (after a total restart)
	Outcome   string `json:"outcome"`
	Reason    string `json:"reason,omitempty"`
	LeaseID   uint64 `json:"lease_id,omitempty"`
	Remaining uint64 `json:"remaining,omitempty"`
}

// StatusSample is one linearizable Status read of a concurrency-limited bucket.
type StatusSample struct {
	At          int64  `json:"at"`
	Bucket      string `json:"bucket"`
	InFlight    uint64 `json:"in_flight"`
	MaxInFlight uint64 `json:"max_in_flight"`
}

// StateSample is one replica's /debug/state.
type StateSample struct {
	At           int64  `json:"at"`
	Node         string `json:"node"`
	AppliedIndex uint64 `json:"applied_index"`
	Hash         uint64 `json:"hash"`
}

// Fault is one injected fault, from injection to heal.
type Fault struct {
	Kind   string   `json:"kind"` // one of FaultKinds
	Name   string   `json:"name"` // e.g. "kill-leader", "partition-ring"
	Nodes  []string `json:"nodes,omitempty"`
	Start  int64    `json:"start"`
	End    int64    `json:"end"`
	Detail string   `json:"detail,omitempty"`
	// Rate is the clock rate of a rate-skew fault (on Nodes, from Start to End).
	Rate float64 `json:"rate,omitempty"`
	// Skipped says why a planned fault could not be injected.
	Skipped string `json:"skipped,omitempty"`
}

// Reclaim is the after-heal lease check: when the last fault was healed, when Status first
// showed no permit in flight, and whether max_in_flight fresh permits could then be taken.
type Reclaim struct {
	Bucket      string `json:"bucket"`
	HealAt      int64  `json:"heal_at"`
	ReclaimedAt int64  `json:"reclaimed_at"` // -1: never within the wait
	Capacity    uint64 `json:"capacity"`     // max_in_flight
	Reacquired  uint64 `json:"reacquired"`   // fresh permits admitted at once afterwards
	CrashedHeld int    `json:"crashed_held"` // leases never released by their (crashed) holder
}

// History is everything a run recorded.
type History struct {
	Seed    int64          `json:"seed"`
	Start   time.Time      `json:"start"`
	Ops     []Op           `json:"ops"`
	Replays []Replay       `json:"replays"`
	Status  []StatusSample `json:"status"`
	States  []StateSample  `json:"states"`
	Faults  []Fault        `json:"faults"`
	Reclaim []Reclaim      `json:"reclaim"`
	// FirstFault is when the first fault was injected (ns since start; 0: none).
	FirstFault int64 `json:"first_fault"`
	// LoadStart is when the workload started.
	LoadStart int64 `json:"load_start"`
	// Strays lists nodes found down outside any fault (crashed, or stopped from outside).
	Strays []string `json:"strays,omitempty"`
	// Forgeries are the forge faults' records.
	Forgeries []Forgery `json:"forgeries,omitempty"`
	// HolderFaults are the shares workload's faults on holder processes (shares.go).
	HolderFaults []HolderFault `json:"holder_faults,omitempty"`
}

// Write saves h as JSON.
func (h *History) Write(path string) error {
	b, err := json.MarshalIndent(h, "", " ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

// ReadHistory loads a history written by Write.
func ReadHistory(path string) (*History, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var h History
	return &h, json.Unmarshal(b, &h)
}

// opsOf returns the ops of one kind grouped by bucket, buckets sorted.
func opsOf(h *History, kind string) (buckets []string, byBucket map[string][]Op) {
	byBucket = make(map[string][]Op)
	for _, op := range h.Ops {
		if op.Kind == kind {
			byBucket[op.Bucket] = append(byBucket[op.Bucket], op)
		}
	}
	for b := range byBucket {
		buckets = append(buckets, b)
	}
	slices.Sort(buckets)
	return buckets, byBucket
}

// rateSpans returns, over [0, end], the clock-rate faults as a piecewise-constant function:
// the largest rate of any node at each time (never below 1).
type rateSpan struct {
	from, to int64
	rate     float64
}

func maxRateSpans(h *History) []rateSpan {
	var out []rateSpan
	for _, f := range h.Faults {
		if f.Rate > 1 && f.Skipped == "" {
			out = append(out, rateSpan{f.Start, f.End, f.Rate})
		}
	}
	return out
}
