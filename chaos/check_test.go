package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/quotad/quotad/chaos/faults"
)

const sec = int64(time.Second)

func spend(i, worker int, bucket string, cost uint64, call, ret int64, outcome string) Op {
	return Op{Index: i, Worker: worker, Kind: KindSpend, Domain: "budget", Bucket: bucket, Cost: cost,
		ClientID: "c", RequestID: uint64(i + 1), Call: call, Return: ret, Outcome: outcome}
}

func TestLinearizableAcceptsConcurrentAndUnknown(t *testing.T) {
	h := &History{Ops: []Op{
		spend(0, 0, "b1", 6, 0, 10, Admitted),
		spend(1, 1, "b1", 6, 5, 20, Denied),    // concurrent with op 0: ordered after it
		spend(2, 2, "b1", 3, 1, 0, Unknown),    // may have happened
		spend(3, 0, "b1", 2, 30, 40, Admitted), // 10-6=4 → 2 left if op 2 did not happen
		spend(4, 1, "b1", 3, 50, 60, Denied),
	}}
	res, st := CheckLinearizable(h, LinearizabilityConfig{Initial: 10, Timeout: 10 * time.Second})
	if !res.OK {
		t.Fatalf("a linearizable history was rejected: %+v", res)
	}
	if st.Ops != 5 || st.Unknown != 1 {
		t.Fatalf("stats = %+v", st)
	}
}

func TestLinearizableCatchesDoubleSpend(t *testing.T) {
	// Two sequential admissions of 6 from a bucket of 10: a unit was granted twice.
	h := &History{Ops: []Op{
		spend(0, 0, "b1", 6, 0, 10, Admitted),
		spend(1, 1, "b1", 6, 20, 30, Admitted),
		spend(2, 0, "b2", 1, 0, 10, Admitted), // another bucket, fine
	}}
	dir := t.TempDir()
	res, _ := CheckLinearizable(h, LinearizabilityConfig{Initial: 10, Timeout: 10 * time.Second, VisualizeDir: dir})
	if res.OK || res.Anomalies != 1 {
		t.Fatalf("double spend not reported exactly once: %+v", res)
	}
	if len(res.Files) != 1 {
		t.Fatalf("no visualization written: %+v", res)
	}
	if b, err := os.ReadFile(res.Files[0]); err != nil || !strings.Contains(string(b), "<html") {
		t.Fatalf("visualization %s unreadable: %v", res.Files[0], err)
	}
}

func TestLinearizableUnknownsCannotHideADoubleSpend(t *testing.T) {
	// Ambiguous ops (never answered, never re-sent) may or may not have debited: neither way
	// makes two sequential admissions of 6 from 10 legal. A resolved op's interval ends at
	// the re-send's answer, so it may be ordered late — here before the denial that needs it.
	h := &History{Ops: []Op{
		spend(0, 0, "b1", 6, 0, 10, Admitted),
		spend(1, 2, "b1", 3, 1, 0, Unknown),
		spend(2, 3, "b1", 1, 2, 0, Unknown),
		spend(3, 1, "b1", 6, 20, 30, Admitted),
	}}
	if res, st := CheckLinearizable(h, LinearizabilityConfig{Initial: 10, Timeout: 10 * time.Second}); res.OK || st.Unknown != 2 {
		t.Fatalf("unknown outcomes hid a double spend: %+v %+v", res, st)
	}
	// A resolved op (first call lost, answer learned by a re-send at 100) may have been
	// decided anywhere in [1, 100]: here before the denial at 20–30 that needs its debit.
	resolved := spend(1, 2, "b1", 3, 1, 100, Admitted)
	resolved.Resolved = true
	h = &History{Ops: []Op{
		spend(0, 0, "b1", 6, 0, 10, Admitted),
		resolved,
		spend(2, 1, "b1", 2, 20, 30, Denied), // 1 left only if the resolved op came first
		spend(3, 1, "b1", 1, 110, 120, Admitted),
	}}
	if res, st := CheckLinearizable(h, LinearizabilityConfig{Initial: 10, Timeout: 10 * time.Second}); !res.OK || st.Resolved != 1 {
		t.Fatalf("a resolved op was not placed inside its interval: %+v %+v", res, st)
	}
}

func TestLinearizableCatchesLostDebit(t *testing.T) {
	// Admitted 8 of 10, then a denial of 1 that only a forgotten debit... no: a denial of 2
	// when 2 remain means a phantom debit (e.g. a retry debited twice).
	h := &History{Ops: []Op{
		spend(0, 0, "b1", 8, 0, 10, Admitted),
		spend(1, 0, "b1", 2, 20, 30, Denied),
	}}
	res, _ := CheckLinearizable(h, LinearizabilityConfig{Initial: 10, Timeout: 10 * time.Second})
	if res.OK {
		t.Fatalf("a denial with enough remaining was accepted: %+v", res)
	}
}

func rateOp(i int, bucket string, call, ret int64) Op {
	return Op{Index: i, Kind: KindRate, Bucket: bucket, Cost: 1, Call: call, Return: ret, Outcome: Admitted}
}

func TestBoundedAdmission(t *testing.T) {
	lim := map[string]RateLimit{"r": {Burst: 5, RefillPerSecond: 10}}
	// 5 at once, then 10/s for 3 s: exactly at the bound.
	var ok []Op
	for i := range 5 {
		ok = append(ok, rateOp(i, "r", 0, int64(time.Millisecond)))
	}
	for i := range 30 {
		at := int64(i+1) * sec / 10
		ok = append(ok, rateOp(5+i, "r", at, at+int64(time.Millisecond)))
	}
	if res := CheckBoundedAdmission(&History{Ops: ok}, lim); !res.OK {
		t.Fatalf("admission at the bound was rejected: %+v", res)
	}
	// The same plus a burst of 4 more in the middle: over-admission.
	bad := append([]Op(nil), ok...)
	for i := range 4 {
		bad = append(bad, rateOp(100+i, "r", 2*sec, 2*sec+int64(time.Millisecond)))
	}
	res := CheckBoundedAdmission(&History{Ops: bad}, lim)
	if res.OK {
		t.Fatalf("over-admission not reported: %+v", res)
	}
	// A 2x clock on some node during [1s, 3s] allows 20 more units over that span: the
	// extra 4 fit.
	h := &History{Ops: bad, Faults: []Fault{{Kind: "clock", Start: sec, End: 3 * sec, Rate: 2}}}
	if res := CheckBoundedAdmission(h, lim); !res.OK {
		t.Fatalf("admission within (1+ρ) was rejected: %+v", res)
	}
}

// TestBoundedAdmissionMatchesBruteForce compares the O(n log n) sweep with the definition.
func TestBoundedAdmissionMatchesBruteForce(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := range 300 {
		lim := RateLimit{Burst: float64(1 + rng.IntN(5)), RefillPerSecond: float64(1 + rng.IntN(20))}
		var ops []Op
		n := 1 + rng.IntN(40)
		for i := range n {
			call := rng.Int64N(3 * sec)
			ops = append(ops, Op{Index: i, Kind: KindRate, Bucket: "r", Cost: uint64(1 + rng.IntN(3)),
				Call: call, Return: call + rng.Int64N(sec/2), Outcome: Admitted})
		}
		var faults []Fault
		if rng.IntN(2) == 0 {
			s := rng.Int64N(2 * sec)
			faults = append(faults, Fault{Kind: "clock", Start: s, End: s + rng.Int64N(sec), Rate: 1.5})
		}
		h := &History{Ops: ops, Faults: faults}
		ts := newTimeScale(maxRateSpans(h))
		want := true
		for _, a := range ops {
			for _, b := range ops {
				t1, t2 := a.Call, b.Return
				if t2 < t1 {
					continue
				}
				var cost float64
				for _, o := range ops {
					if o.Call >= t1 && o.Return <= t2 {
						cost += float64(o.Cost)
					}
				}
				if cost > lim.Burst+lim.RefillPerSecond*(ts.at(t2)-ts.at(t1))/1e9+1e-6 {
					want = false
				}
			}
		}
		got := CheckBoundedAdmission(h, map[string]RateLimit{"r": lim}).OK
		if got != want {
			t.Fatalf("trial %d: sweep says ok=%v, brute force %v (%d ops, %+v)", trial, got, want, n, lim)
		}
	}
}

func leaseOp(i int, call, ret, release int64) Op {
	return Op{Index: i, Kind: KindLease, Bucket: "p", Cost: 1, Call: call, Return: ret, Outcome: Admitted,
		LeaseID: uint64(i + 1), LeaseTTL: 3 * time.Second, ReleaseCall: release}
}

func TestLeasesInFlight(t *testing.T) {
	limit := map[string]uint64{"p": 2}
	ok := &History{Ops: []Op{
		leaseOp(0, 0, sec, 2*sec),
		leaseOp(1, 0, sec, 2*sec),
		leaseOp(2, sec, 2*sec, -1), // granted when the others were released: concurrent calls
		leaseOp(3, 10*sec, 11*sec, -1),
		leaseOp(4, 14*sec, 14*sec+1, -1), // crashed holder's lease 3 expired at 13 s
		leaseOp(5, 14*sec, 14*sec+1, -1),
	}}
	if res := CheckLeases(ok, limit); !res.OK {
		t.Fatalf("a legal lease history was rejected: %+v", res)
	}
	leaked := &History{Ops: append(ok.Ops, leaseOp(6, 11*sec, 12*sec, -1), leaseOp(7, 11*sec, 12*sec, -1))}
	if res := CheckLeases(leaked, limit); res.OK {
		t.Fatalf("three leases certainly held at 12 s with max_in_flight 2 not reported: %+v", res)
	}
	st := &History{Ops: ok.Ops, Status: []StatusSample{{At: 1, Bucket: "p", InFlight: 3, MaxInFlight: 2}}}
	if res := CheckLeases(st, limit); res.OK {
		t.Fatal("a Status sample above max_in_flight was not reported")
	}
}

func TestReclaim(t *testing.T) {
	bound := 8 * time.Second
	good := &History{Reclaim: []Reclaim{{Bucket: "p", HealAt: 100 * sec, ReclaimedAt: 104 * sec, Capacity: 4, Reacquired: 4, CrashedHeld: 3}}}
	if res := CheckReclaim(good, bound); !res.OK {
		t.Fatalf("%+v", res)
	}
	for _, bad := range []Reclaim{
		{Bucket: "p", HealAt: 100 * sec, ReclaimedAt: -1, Capacity: 4},                       // leaked for good
		{Bucket: "p", HealAt: 100 * sec, ReclaimedAt: 120 * sec, Capacity: 4, Reacquired: 4}, // too late
		{Bucket: "p", HealAt: 100 * sec, ReclaimedAt: 101 * sec, Capacity: 4, Reacquired: 3}, // capacity lost
	} {
		if res := CheckReclaim(&History{Reclaim: []Reclaim{bad}}, bound); res.OK {
			t.Errorf("leak %+v not reported", bad)
		}
	}
}

func TestReplaysCatchLostAck(t *testing.T) {
	ops := []Op{spend(0, 0, "b", 1, 0, 10, Admitted), spend(1, 0, "b", 1, 20, 30, Denied)}
	good := &History{Ops: ops, Replays: []Replay{
		{Op: 0, Phase: "restart", Outcome: Admitted},
		{Op: 1, Phase: "live", Outcome: Denied},
		{Op: 1, Phase: "restart", Outcome: Unknown}, // no answer: ignored
	}}
	if res := CheckReplays(good); !res.OK {
		t.Fatalf("%+v", res)
	}
	lost := &History{Ops: ops, Replays: []Replay{{Op: 0, Phase: "restart", Outcome: Denied}}}
	if res := CheckReplays(lost); res.OK {
		t.Fatal("an acknowledged admission answered differently after restart was not reported")
	}
	ops[0].Remaining = 7
	again := &History{Ops: ops, Replays: []Replay{{Op: 0, Phase: "restart", Outcome: Admitted, Remaining: 6}}}
	if res := CheckReplays(again); res.OK || !strings.Contains(res.Details[0], "decided again") {
		t.Fatalf("an old request ID admitted a second time (another balance) was not reported: %+v", res)
	}
	none := &History{Ops: ops, Replays: []Replay{{Op: 0, Phase: "live", Outcome: Admitted, Remaining: 7}}}
	if res := CheckReplays(none); res.OK {
		t.Fatal("a run without a restart replay passed")
	}
}

func TestReplicaHashes(t *testing.T) {
	good := &History{States: []StateSample{
		{Node: "n1", AppliedIndex: 10, Hash: 1}, {Node: "n2", AppliedIndex: 10, Hash: 1}, {Node: "n3", AppliedIndex: 11, Hash: 2},
	}}
	if res := CheckReplicaHashes(good); !res.OK {
		t.Fatalf("%+v", res)
	}
	bad := &History{States: append(good.States, StateSample{Node: "n3", AppliedIndex: 10, Hash: 7})}
	if res := CheckReplicaHashes(bad); res.OK {
		t.Fatal("hash mismatch at equal applied index not reported")
	}
	vacuous := &History{States: []StateSample{{Node: "n1", AppliedIndex: 10, Hash: 1}, {Node: "n2", AppliedIndex: 11, Hash: 1}}}
	if res := CheckReplicaHashes(vacuous); res.OK {
		t.Fatal("no comparable samples passed")
	}
}

func TestLogs(t *testing.T) {
	dir := t.TempDir()
	write := func(name, s string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("n1.log", "time=x level=INFO msg=\"quotad agent started\"\ntime=y level=WARN msg=\"no panic here, just a word\"\n")
	if res := CheckLogs(dir); !res.OK {
		t.Fatalf("%+v", res)
	}
	write("n2.log", "panic: runtime error: index out of range\n\ngoroutine 1 [running]:\n")
	if res := CheckLogs(dir); res.OK || res.Anomalies != 2 {
		t.Fatalf("panic not reported (twice): %+v", res)
	}
}

func TestThroughputFloor(t *testing.T) {
	var ops []Op
	for i := range 100 {
		ops = append(ops, spend(i, 0, "b", 1, int64(i)*sec/100, int64(i)*sec/100+1, Admitted))
	}
	h := &History{Ops: ops, LoadStart: 0, FirstFault: sec}
	if res, rate := CheckThroughput(h, 50); !res.OK || rate < 99 {
		t.Fatalf("rate %.0f: %+v", rate, res)
	}
	if res, _ := CheckThroughput(h, 500); res.OK {
		t.Fatal("a quiet run passed the floor")
	}
}

func TestUnknownStatsCountsCreatedResolvedAndAmbiguous(t *testing.T) {
	h := &History{Ops: []Op{
		{Outcome: Admitted},
		{Outcome: Admitted, Resolved: true, Cause: CauseLostReply},
		{Outcome: Denied, Resolved: true, Cause: CauseDeadline},
		{Outcome: Unknown, Cause: CauseDeadline},
		{Outcome: Unknown, Cause: CauseUnavailable, NotResent: true},
	}}
	st := unknownStats(h)
	if st.Created != 4 || st.Resolved != 2 || st.Ambiguous != 2 || st.NotResent != 1 {
		t.Fatalf("%+v: want created 4, resolved 2, ambiguous 2, not re-sent 1", st)
	}
	if st.Causes[CauseDeadline] != 2 || st.Causes[CauseLostReply] != 1 || st.Causes[CauseUnavailable] != 1 {
		t.Fatalf("causes %v", st.Causes)
	}
}

func TestCauseOfClassifiesLostRepliesAndDeadlines(t *testing.T) {
	lost := status.Error(codes.Unavailable, faults.DroppedMessage+" (connection broken)")
	for _, tc := range []struct {
		err  error
		want string
	}{
		{lost, CauseLostReply},
		{fmt.Errorf("quotad: no decision after 2 attempts (last error: %v): %w", lost, context.DeadlineExceeded), CauseLostReply},
		{status.Error(codes.DeadlineExceeded, "deadline"), CauseDeadline},
		{fmt.Errorf("no decision: %w", context.DeadlineExceeded), CauseDeadline},
		{status.Error(codes.Unavailable, "no leader"), CauseUnavailable},
	} {
		if got := causeOf(tc.err); got != tc.want {
			t.Errorf("causeOf(%v) = %q, want %q", tc.err, got, tc.want)
		}
	}
}

func TestForgeriesCatchAcceptedTrafficAndLeaderChange(t *testing.T) {
	clean := Forgery{Start: sec, End: 5 * sec, Leaders: []string{"node1"},
		VotersBefore: []string{"node1", "node2", "node3"}, VotersAfter: []string{"node1", "node2", "node3"},
		Vectors: map[string]ForgeVector{"raft-plain": {Attempts: 50, Refused: 50}, "gossip-nokey": {Attempts: 20, Refused: 20}}}
	if res := CheckForgeries(&History{Forgeries: []Forgery{clean}}); !res.OK || res.Checked != 70 {
		t.Fatalf("a refused attack was reported: %+v", res)
	}
	if res := CheckForgeries(&History{}); !res.OK {
		t.Fatalf("a run without a forge fault failed: %+v", res)
	}
	bad := func(f func(*Forgery)) Forgery {
		fg := clean
		fg.Vectors = map[string]ForgeVector{"raft-plain": {Attempts: 50, Refused: 50}}
		f(&fg)
		return fg
	}
	for name, fg := range map[string]Forgery{
		"accepted":       bad(func(fg *Forgery) { fg.Vectors["raft-tls-client"] = ForgeVector{Attempts: 9, Accepted: 3} }),
		"leader changed": bad(func(fg *Forgery) { fg.Leaders = []string{"node1", "node3"} }),
		"forged voter":   bad(func(fg *Forgery) { fg.VotersAfter = []string{"forged-nokey-1", "node1", "node2", "node3"} }),
		"crashed":        bad(func(fg *Forgery) { fg.Error = "forger: signal: killed" }),
		"no attempt":     bad(func(fg *Forgery) { fg.Vectors = map[string]ForgeVector{"raft-plain": {Skipped: "x"}} }),
	} {
		if res := CheckForgeries(&History{Forgeries: []Forgery{fg}}); res.OK {
			t.Errorf("%s: not reported: %+v", name, res)
		}
	}
}

// TestAmbiguousCapPerBucket: past MaxAmbiguousPerBucket a bucket's unknown spends are re-sent,
// and the cap is per bucket (porcupine partitions by bucket).
func TestAmbiguousCapPerBucket(t *testing.T) {
	w := &workload{cfg: WorkloadConfig{MaxAmbiguousPerBucket: 3}}
	left := 0
	for range 10 {
		if w.leaveAmbiguous("g1-0") {
			left++
		}
	}
	if left != 3 {
		t.Fatalf("bucket g1-0: %d unknowns left ambiguous, want the cap 3", left)
	}
	if !w.leaveAmbiguous("g1-1") {
		t.Fatal("bucket g1-1 has left none ambiguous, yet one more was refused: the cap must be per bucket")
	}
}
