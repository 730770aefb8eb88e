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
