package fsm

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// FuzzDecodeCommand feeds arbitrary bytes to the command decoder and to Apply.
//
// Properties: CheckCommand never panics; an entry it accepts applies without panicking and
// identically on two replicas (same state hash); an entry it refuses makes Apply stop with
// the fail-stop message naming the entry's index (never another panic, never a silent skip).
func FuzzDecodeCommand(f *testing.F) {
	tb := &testing.T{}
	ops := []*fsmv1.Op{
		acquire("c1", 1, "acme", 1),
		{Op: &fsmv1.Op_Release{Release: &fsmv1.Release{LeaseId: 1}}},
		{Op: &fsmv1.Op_Renew{Renew: &fsmv1.Renew{LeaseId: 1, TtlNs: int64(time.Second)}}},
		{Op: &fsmv1.Op_Refund{Refund: &fsmv1.Refund{ClientId: "c1", RequestId: 1}}},
		setLimits(tb, testLimits),
		{Op: &fsmv1.Op_Pause{Pause: &fsmv1.Pause{Domain: "provider", DurationNs: int64(time.Second),
			Prefix: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}}}},
		{Op: &fsmv1.Op_Feedback{Feedback: &fsmv1.Feedback{Domain: "provider", StatusCode: 429, RetryAfterNs: int64(time.Second)}}},
	}
	for i, op := range ops {
		data, err := Encode(&fsmv1.Command{Ts: int64(i+1) * int64(time.Millisecond), Ops: []*fsmv1.Op{op}})
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	all, _ := Encode(&fsmv1.Command{Ts: 5, Ops: ops})
	f.Add(all)
	f.Add((&FSM{}).EncodeTick(42, 0))
	f.Add([]byte{})
	f.Add([]byte{0x08, 0x02}) // version 2
	f.Add([]byte{0x1a, 0x00}) // an empty op
	f.Add([]byte("\xff\xff\xff\xff"))

	f.Fuzz(func(t *testing.T, data []byte) {
		checkErr := CheckCommand(data)
		a, b := fuzzReplica(t), fuzzReplica(t)
		panicA := applyRecover(a, data)
		if checkErr == nil {
			if panicA != "" {
				t.Fatalf("an entry that decodes made Apply panic: %s", panicA)
			}
			if panicB := applyRecover(b, data); panicB != "" {
				t.Fatalf("second replica panicked: %s", panicB)
			}
			if ha, hb := a.Hash(), b.Hash(); ha != hb {
				t.Fatalf("replicas diverged: %+v vs %+v", ha, hb)
			}
			return
		}
		if panicA == "" {
			t.Fatalf("Apply accepted an entry CheckCommand refuses (%v)", checkErr)
		}
		if !strings.HasPrefix(panicA, "fsm: ") || !strings.Contains(panicA, "entry 3") {
			t.Fatalf("Apply stopped with an unclear message %q (decode error %v)", panicA, checkErr)
		}
	})
}

// fuzzReplica is an FSM with limits (entry 1) and one admission (entry 2).
func fuzzReplica(t *testing.T) *FSM {
	l := newLog(t)
	l.apply(time.Millisecond, acquire("c1", 1, "acme", 1))
	return l.f
}

// applyRecover applies data as entry 3 and returns the panic message, "" if none.
func applyRecover(f *FSM, data []byte) (msg string) {
	defer func() {
		if r := recover(); r != nil {
			msg = fmt.Sprint(r)
		}
	}()
	f.Apply(&raft.Log{Index: 3, Term: 1, Type: raft.LogCommand, Data: data})
	return ""
}
