package fsm

import (
	"reflect"
	"testing"
	"time"
	"unsafe"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/quota"
)

// TestDecisionMirrorsQuota: Decision has quota.Decision's fields but the ones left out on
// purpose, and setAnswer copies every one. A field added to quota.Decision fails here until it
// is either carried to callers or added to the left-out list.
func TestDecisionMirrorsQuota(t *testing.T) {
	leftOut := map[string]bool{"Charges": true, "Cost": true, "DebitSeq": true, "ShadowDenials": true}
	qt, ft := reflect.TypeFor[quota.Decision](), reflect.TypeFor[Decision]()
	var q quota.Decision
	qv := reflect.ValueOf(&q).Elem()
	for i := range qt.NumField() {
		qf := qt.Field(i)
		ff, ok := ft.FieldByName(qf.Name)
		switch {
		case leftOut[qf.Name]:
			if ok {
				t.Errorf("Decision.%s is meant to be left out", qf.Name)
			}
			continue
		case !ok:
			t.Errorf("quota.Decision.%s is not in fsm.Decision: carry it or leave it out on purpose", qf.Name)
			continue
		case ff.Type != qf.Type:
			t.Errorf("Decision.%s is %v, quota.Decision's is %v", qf.Name, ff.Type, qf.Type)
			continue
		}
		// A distinct non-zero value per field, to catch a field copied into another.
		switch f := qv.Field(i); f.Kind() {
		case reflect.Bool:
			f.SetBool(true)
		case reflect.String:
			f.SetString(qf.Name)
		case reflect.Uint64:
			f.SetUint(uint64(i + 1))
		case reflect.Int64:
			f.SetInt(int64(i+1) * 1000)
		default:
			t.Fatalf("quota.Decision.%s: kind %v not handled by this test", qf.Name, f.Kind())
		}
	}
	if ft.NumField() != qt.NumField()-len(leftOut) {
		t.Errorf("Decision has %d fields, want %d", ft.NumField(), qt.NumField()-len(leftOut))
	}
	var a Decision
	setAnswer(&a, &q)
	got := reflect.ValueOf(a)
	for i := range ft.NumField() {
		name := ft.Field(i).Name
		if want := qv.FieldByName(name); !reflect.DeepEqual(got.Field(i).Interface(), want.Interface()) {
			t.Errorf("setAnswer: %s = %v, want %v", name, got.Field(i), want)
		}
	}
}

// TestOpResultShape: an Acquire is answered in Decision with Other nil; every other op kind
// in Other, never nil (callers dereference it).
func TestOpResultShape(t *testing.T) {
	l := newLog(t)
	if r := l.apply(0, setLimits(t, testLimits)).Ops[0]; r.Other == nil || r.Other.Err != nil || r.Other.LimitsVersion != 2 { // newLog applied version 1
		t.Fatalf("SetLimits: %+v", r)
	}
	ops := []*fsmv1.Op{
		acquire("c", 1, "acme", 1),
		{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{ClientId: "c"}}}, // no admission
		{Op: &fsmv1.Op_Release{Release: &fsmv1.Release{LeaseId: 12345}}},
		{Op: &fsmv1.Op_Renew{Renew: &fsmv1.Renew{LeaseId: 12345}}},
		{Op: &fsmv1.Op_Refund{Refund: &fsmv1.Refund{ClientId: "c", RequestId: 99}}},
		{Op: &fsmv1.Op_Pause{Pause: &fsmv1.Pause{Domain: "nope", DurationNs: int64(time.Second)}}},
		{Op: &fsmv1.Op_Pause{Pause: &fsmv1.Pause{Domain: "provider", DurationNs: int64(time.Second)}}},
		{Op: &fsmv1.Op_Feedback{Feedback: &fsmv1.Feedback{Domain: "provider", StatusCode: 429,
			Prefix: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}}}},
	}
	res := l.apply(time.Millisecond, ops...).Ops
	if r := res[0]; r.Other != nil || !r.Decision.Admitted || r.Decision.Scope == "" {
		t.Errorf("Acquire: %+v", r)
	}
	if r := res[1]; r.Other != nil || r.Decision.Reason != quota.ReasonInvalid || r.Decision.Message == "" {
		t.Errorf("Acquire without an admission: %+v", r)
	}
	for i, r := range res[2:] {
		if r.Other == nil || r.Duplicate || r.Decision != (Decision{}) {
			t.Errorf("op %d (%T): %+v, want only Other set", i+2, ops[i+2].Op, r)
		}
	}
	if res[3].Other.Err == nil || res[5].Other.Err == nil {
		t.Errorf("renew of an unknown lease or pause of an unknown domain: no error (%v, %v)", res[3].Other.Err, res[5].Other.Err)
	}
	if res[6].Other.PausedFor != time.Second || res[6].Other.Scope == "" {
		t.Errorf("Pause: %+v", res[6].Other)
	}
	// The point of the split: the per-admission result stays small.
	if n := unsafe.Sizeof(OpResult{}); n > 128 {
		t.Errorf("OpResult is %d bytes, want at most 128", n)
	}
}
