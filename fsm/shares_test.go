package fsm

import (
	"bytes"
	"errors"
	"io"
	"math"
	"reflect"
	"testing"
	"time"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/quota"
)

var shareLimits = &quota.Limits{Domains: []quota.Domain{{
	Name:   "api",
	Rate:   &quota.Rate{Unit: time.Second, RequestsPerUnit: 100, Burst: 100},
	Shares: &quota.Shares{},
}}}

func shareOp(owner, holder string, seq, ack uint64) *fsmv1.Op {
	return &fsmv1.Op{Op: &fsmv1.Op_Share{Share: &fsmv1.Share{Owner: owner, Request: &quotadv1.ShareRequest{
		HolderId: holder, Incarnation: 1, Seq: seq, AckSeq: ack,
		Paths: []*quotadv1.SharePath{{Domain: "api", Demand: math.MaxUint64, MaxCost: 1}},
	}}}}
}

func TestShareOpsApplyReplayAndSnapshot(t *testing.T) {
	l := newLog(t)
	l.apply(0, setLimits(t, shareLimits))
	r := l.apply(time.Millisecond, shareOp("w", "h1", 1, 0)).Ops[0].Other
	if r.Err != nil || r.Share == nil {
		t.Fatalf("share: %+v", r)
	}
	resp := ShareResponse(r.Share)
	if p := resp.Paths[0]; p.Status != "lent" || len(p.Levels) != 1 || p.Levels[0].Rate != 90*quota.MicroPerUnit || !p.Levels[0].First || p.Levels[0].Initial != 90*quota.MicroPerUnit {
		t.Fatalf("answer %+v", resp)
	}
	// The same seq again: the stored answer, nothing changes.
	lb, hb := l.f.ShareStatus("")
	r = l.apply(2*time.Millisecond, shareOp("w", "h1", 1, 0)).Ops[0].Other
	if r.Err != nil || !r.Share.Duplicate {
		t.Fatalf("repeated seq: %+v", r)
	}
	if la, ha := l.f.ShareStatus(""); !reflect.DeepEqual(la, lb) || !reflect.DeepEqual(ha, hb) {
		t.Fatalf("a repeated seq changed the shares: %+v %+v -> %+v %+v", lb, hb, la, ha)
	}
	// Another identity's holder of the same ID is another holder: it gets what is left.
	r = l.apply(3*time.Millisecond, shareOp("x", "h1", 1, 0)).Ops[0].Other
	if r.Err != nil || r.Share.Paths[0].Status != quota.ShareTooSmall {
		t.Fatalf("other owner: %+v", r.Share)
	}
	l.apply(4*time.Millisecond, shareOp("w", "h1", 2, 1))
	// Snapshot, restore: same hash; a replayed old seq is refused on the restored replica.
	want := l.f.Hash()
	data := snapshotBytes(t, l.f)
	other := newLog(t)
	if err := other.f.Restore(io.NopCloser(bytes.NewReader(data))); err != nil {
		t.Fatal(err)
	}
	if got := other.f.Hash(); got.Hash != want.Hash {
		t.Fatalf("restored %+v, want %+v", got, want)
	}
	other.index = l.index
	if r := other.apply(5*time.Millisecond, shareOp("w", "h1", 1, 0)).Ops[0].Other; !errors.Is(r.Err, quota.ErrStaleShare) {
		t.Fatalf("old seq after restore: %+v", r)
	}
	// Release returns the tokens and ends the lend.
	rel := &fsmv1.Op{Op: &fsmv1.Op_ReleaseShare{ReleaseShare: &fsmv1.ReleaseShare{Owner: "w", Request: &quotadv1.ReleaseShareRequest{
		HolderId: "h1", Incarnation: 1, Seq: 3, Tokens: []*quotadv1.LevelTokens{{Key: "api", Tokens: 40 * quota.MicroPerUnit}}}}}}
	if r := other.apply(6*time.Millisecond, rel).Ops[0].Other; r.Err != nil || r.Returned != 40*quota.MicroPerUnit {
		t.Fatalf("release: %+v", r)
	}
	lends, _ := other.f.ShareStatus("api")
	for _, ls := range lends {
		if ls.LentRate > 0 && ls.Holders == 1 {
			continue // x's holder
		}
		if ls.LentRate > 0 {
			t.Fatalf("after release: %+v", lends)
		}
	}
}

// TestShareNeedsFirstByCommandVersion: a version 4 Share is allocated needs first (a quiet
// holder's unspent headroom goes to the busy one); a version 3 entry (an older leader's) is
// allocated in one filling, as that leader did, so replicas of both builds agree.
func TestShareNeedsFirstByCommandVersion(t *testing.T) {
	op := func(holder string, seq, ack, demand uint64) *fsmv1.Op {
		return &fsmv1.Op{Op: &fsmv1.Op_Share{Share: &fsmv1.Share{Owner: "w", Request: &quotadv1.ShareRequest{
			HolderId: holder, Incarnation: 1, Seq: seq, AckSeq: ack,
			Paths: []*quotadv1.SharePath{{Domain: "api", Demand: demand, MaxCost: 1}},
		}}}}
	}
	for _, tc := range []struct {
		version uint32
		busy    uint64 // µ/s of the 90/s lendable (the default 10 % reserve)
	}{{3, 52_500_000}, {4, 60 * quota.MicroPerUnit}} {
		l := newLog(t)
		l.version = tc.version
		l.apply(0, setLimits(t, shareLimits))
		// quiet: 30/s attempted (37.5 with the headroom); busy: 120/s (150).
		var busy *quota.ShareGrant
		for i := range uint64(3) {
			ts := time.Duration(i+1) * time.Second
			l.apply(ts, op("quiet", i+1, i, 37_500_000))
			busy = l.apply(ts+time.Millisecond, op("busy", i+1, i, 150*quota.MicroPerUnit)).Ops[0].Other.Share
		}
		if got := busy.Paths[0].Levels[0].Rate; got != tc.busy {
			t.Fatalf("version %d: busy holder lent %d µ/s, want %d", tc.version, got, tc.busy)
		}
	}
}
