package rpc_test

import (
	"context"
	"testing"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/rpc"
)

// TestStreamHeartbeatsWhileWaiting: the leader's header announces heartbeats, and while the
// stream has admissions undecided it sends a message without decisions every second — also
// while the client keeps sending admissions more often than that (each message used to
// restart the re-check ticker, so a busy stream never got one and a client would take its
// silence for a stalled leader).
func TestStreamHeartbeatsWhileWaiting(t *testing.T) {
	c, p, _ := streamCluster(t)
	p.client(auth.Identity{Name: "h", Role: auth.RoleWorker, Domains: []string{"held"}})
	leader := c.Leader()
	q := quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[leader], "h"))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// held refills one unit a minute: take it, so every waiter below waits.
	if d, err := acquireOne(ctx, q, "drain", &quotadv1.Admission{RequestId: 1, Domain: "held"}); err != nil || !d.Admitted {
		t.Fatalf("draining held: %v %v", d, err)
	}
	s, err := q.AcquireStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	id := uint64(100)
	send := func() {
		id++
		if err := s.Send(&quotadv1.AcquireStreamRequest{ClientId: "hb", Admissions: []*quotadv1.Admission{waiting(id, "held", 90*time.Second)}}); err != nil {
			t.Error(err)
		}
	}
	send()
	hdr, err := s.Header()
	if err != nil {
		t.Fatal(err)
	}
	if v := hdr.Get(rpc.StreamHeartbeatHeader); len(v) != 1 || v[0] != "1000" {
		t.Fatalf("header %s = %v, want [1000]", rpc.StreamHeartbeatHeader, v)
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { // an admission every 200 ms: more often than the heartbeat
		defer close(done)
		tk := time.NewTicker(200 * time.Millisecond)
		defer tk.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tk.C:
				send()
			}
		}
	}()
	start := time.Now()
	beats := 0
	for beats < 3 {
		m, err := recvWithin(t, s, 3*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if len(m.Decisions) != 0 {
			t.Fatalf("a decision while every admission waits for a unit a minute away: %v", m.Decisions)
		}
		beats++
	}
	close(stop)
	<-done
	if took := time.Since(start); took > 6*time.Second {
		t.Fatalf("3 heartbeats took %v, want about 3 s", took)
	}
}
