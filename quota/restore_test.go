package quota

import (
	"bytes"
	"encoding/json"
	"os"
	"testing"
	"time"
)

// TestRenumberSnapshot: the limits version is set, the lease counter only raised, and every
// other part of the state decodes as it was (re-encoding gives the renumbered bytes back).
func TestRenumberSnapshot(t *testing.T) {
	e := mustEngine(t, oneBucket(10, time.Second, 0))
	e.Acquire(Time(time.Second), Request{Domain: "d", Cost: 3})
	e.leaseSeq = 7
	data, err := e.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ version, minSeq, wantSeq uint64 }{{9, 12, 12}, {9, 3, 7}, {0, 0, 7}} {
		out, err := RenumberSnapshot(data, tc.version, tc.minSeq)
		if err != nil {
			t.Fatal(err)
		}
		var got Engine
		if err := got.UnmarshalBinary(out); err != nil {
			t.Fatal(err)
		}
		if got.Limits().Version != tc.version || got.LeaseSeq() != tc.wantSeq || got.Stats().Buckets != e.Stats().Buckets {
			t.Fatalf("%+v: version %d, lease counter %d, %+v", tc, got.Limits().Version, got.LeaseSeq(), got.Stats())
		}
		again, _ := got.MarshalBinary()
		if !bytes.Equal(again, out) {
			t.Fatalf("%+v: the renumbered state does not re-encode to itself", tc)
		}
		if tc.wantSeq == e.leaseSeq {
			if back, err := RenumberSnapshot(out, e.Limits().Version, 0); err != nil || !bytes.Equal(back, data) {
				t.Fatalf("%+v: numbered back, the state is not the original (%v)", tc, err)
			}
		}
	}
	if _, err := RenumberSnapshot(data[:3], 1, 1); err == nil {
		t.Fatal("a truncated state was renumbered")
	}
}

// The golden states (every section: adaptive rates, retry budgets, owners, shares) keep every
// byte but the renumbered ones.
func TestRenumberGoldenSnapshots(t *testing.T) {
	for _, name := range []string{"testdata/golden/workload_snapshot.bin", "testdata/golden/bulk_snapshot.bin"} {
		data, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		var e Engine
		if err := e.UnmarshalBinary(data); err != nil {
			t.Fatal(err)
		}
		out, err := RenumberSnapshot(data, e.Limits().Version+5, e.LeaseSeq()+3)
		if err != nil {
			t.Fatal(err)
		}
		var got Engine
		if err := got.UnmarshalBinary(out); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		again, _ := got.MarshalBinary()
		if got.Limits().Version != e.Limits().Version+5 || got.LeaseSeq() != e.LeaseSeq()+3 || !bytes.Equal(again, out) {
			t.Fatalf("%s: version %d, lease counter %d, re-encodes equal: %v", name, got.Limits().Version, got.LeaseSeq(), bytes.Equal(again, out))
		}
		// Only the version and the lease counter moved: the rest of the limits and state are
		// the original's.
		gl, el := got.Limits(), e.Limits()
		gl.Version = el.Version
		ga, _ := json.Marshal(gl)
		ea, _ := json.Marshal(el)
		if !bytes.Equal(ga, ea) || got.Stats() != (Stats{Buckets: e.Stats().Buckets, Leases: e.Stats().Leases, Pauses: e.Stats().Pauses,
			Adapted: e.Stats().Adapted, RetryBudgets: e.Stats().RetryBudgets, LimitsVersion: got.Limits().Version}) {
			t.Fatalf("%s: the state changed beyond the version and lease counter", name)
		}
	}
}
