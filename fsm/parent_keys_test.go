package fsm

import (
	"errors"
	"strings"
	"testing"
	"time"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/quota"
)

// TestMaxKeysPerParentByCommandVersion: limits with max_keys_per_parent in a version 5 entry
// (which no version 5 leader could write, and a version 5 node would apply without the cap)
// are refused and change nothing; in a version 6 entry they are installed and decide.
func TestMaxKeysPerParentByCommandVersion(t *testing.T) {
	lim := &quota.Limits{Domains: []quota.Domain{{Name: "t7", Descriptors: []quota.Node{{Key: "tenant",
		Children: []quota.Node{{Key: "consumer", MaxKeysPerParent: 1, Rate: &quota.Rate{Unit: time.Second, RequestsPerUnit: 10}}}}}}}}
	consumer := func(id uint64, v string) *fsmv1.Op {
		return &fsmv1.Op{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{ClientId: "c", Admission: &quotadv1.Admission{
			RequestId: id, Domain: "t7", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}, {Key: "consumer", Value: v}}}}}}
	}
	l := newLog(t)
	l.version = 5
	before := l.f.Limits().Version
	err := l.apply(time.Second, setLimits(t, lim)).Ops[0].Other.Err
	if !errors.Is(err, ErrInvalidLimits) || !strings.Contains(err.Error(), "max_keys_per_parent in a version 5 entry; it needs command version 6") {
		t.Fatalf("version 5 SetLimits with max_keys_per_parent: %v", err)
	}
	if l.f.Limits().Version != before {
		t.Fatal("refused limits were installed")
	}
	l.version = 6
	if err := l.apply(time.Second, setLimits(t, lim)).Ops[0].Other.Err; err != nil {
		t.Fatal(err)
	}
	if d := l.apply(time.Second, consumer(1, "a")).Ops[0].Decision; !d.Admitted {
		t.Fatalf("first consumer: %+v", d)
	}
	if d := l.apply(time.Second, consumer(2, "b")).Ops[0].Decision; d.Reason != quota.ReasonTooManyKeys || d.Limit != 1 {
		t.Fatalf("second consumer of acme with max_keys_per_parent 1: %+v", d)
	}
}

// TestKeyCapsByCommandVersion: in a version 7 entry, a shadow level's new bucket in a full
// domain (max_keys) is skipped and reported instead of refusing the admission, and a Share
// does not lend a path whose buckets the domain has no room for; version 6 entries (an older
// leader's) are decided as that leader decided them, so replicas of both builds agree.
func TestKeyCapsByCommandVersion(t *testing.T) {
	lim := &quota.Limits{Domains: []quota.Domain{{Name: "t8", MaxKeys: 2, Descriptors: []quota.Node{
		{Key: "tenant", Rate: &quota.Rate{Unit: time.Second, RequestsPerUnit: 100},
			Children: []quota.Node{{Key: "consumer", ShadowMode: true, Rate: &quota.Rate{Unit: time.Second, RequestsPerUnit: 10}}}},
		{Key: "gw", Rate: &quota.Rate{Unit: time.Second, RequestsPerUnit: 100}, Shares: &quota.Shares{}},
	}}}}
	consumer := func(id uint64, v string) *fsmv1.Op {
		return &fsmv1.Op{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{ClientId: "c", Admission: &quotadv1.Admission{
			RequestId: id, Domain: "t8", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}, {Key: "consumer", Value: v}}}}}}
	}
	share := &fsmv1.Op{Op: &fsmv1.Op_Share{Share: &fsmv1.Share{Owner: "w", Request: &quotadv1.ShareRequest{
		HolderId: "h", Incarnation: 1, Seq: 1,
		Paths: []*quotadv1.SharePath{{Domain: "t8", Descriptors: []*quotadv1.Entry{{Key: "gw", Value: "eu"}}, Demand: 1 << 40, MaxCost: 1}},
	}}}}
	for _, tc := range []struct {
		version     uint32
		admitted    bool
		shareStatus quota.ShareStatus
	}{{6, false, quota.ShareLent}, {7, true, quota.ShareCentral}} {
		l := newLog(t)
		l.version = tc.version
		if err := l.apply(time.Second, setLimits(t, lim)).Ops[0].Other.Err; err != nil {
			t.Fatal(err)
		}
		if d := l.apply(time.Second, consumer(1, "a")).Ops[0].Decision; !d.Admitted {
			t.Fatalf("version %d, first consumer: %+v", tc.version, d)
		}
		d := l.apply(time.Second, consumer(2, "b")).Ops[0].Decision
		if d.Admitted != tc.admitted || (!d.Admitted && d.Reason != quota.ReasonTooManyKeys) || (d.Admitted && d.Reason != quota.ReasonOK) {
			t.Fatalf("version %d, a new shadow bucket in a full domain: %+v, want admitted %v", tc.version, d, tc.admitted)
		}
		g := l.apply(time.Second, share).Ops[0].Other.Share
		if g == nil || g.Paths[0].Status != tc.shareStatus {
			t.Fatalf("version %d, a lend in a full domain: %+v, want %s", tc.version, g, tc.shareStatus)
		}
	}
}
