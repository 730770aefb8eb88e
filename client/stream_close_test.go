package client

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"runtime/pprof"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/cluster/clustertest"
)

// silentLeader is a real gRPC Quota server whose AcquireStream admits every admission and,
// after the client half-closes, never ends the stream (a paused or partitioned leader, or a
// hostile one): its handler returns only when the client cancels the call.
type silentLeader struct {
	quotadv1.UnimplementedQuotaServer
	open atomic.Int64 // AcquireStream handlers running
}

func (l *silentLeader) AcquireStream(ss quotadv1.Quota_AcquireStreamServer) error {
	l.open.Add(1)
	defer l.open.Add(-1)
	for {
		m, err := ss.Recv()
		if err != nil {
			<-ss.Context().Done() // half-closed (or broken): never end it ourselves
			return ss.Context().Err()
		}
		resp := &quotadv1.AcquireStreamResponse{}
		for _, a := range m.Admissions {
			resp.Decisions = append(resp.Decisions, &quotadv1.StreamDecision{RequestId: a.RequestId, Decision: &quotadv1.Decision{Admitted: true}})
		}
		if err := ss.Send(resp); err != nil {
			return err
		}
	}
}

// recvGoroutines counts the client's stream receivers running.
func recvGoroutines(t *testing.T) int {
	t.Helper()
	var b bytes.Buffer
	if err := pprof.Lookup("goroutine").WriteTo(&b, 1); err != nil {
		t.Fatal(err)
	}
	return strings.Count(b.String(), "client.(*wstream).recv")
}

// TestStreamIdleCloseBounded: after the idle half-close, a leader that never ends the stream
// does not keep it: the client cancels it after the grace, so neither its receiver goroutine
// nor the call (on either side) outlives it. Without the cancel every idle cycle left one
// receiver and one open call behind for the Client's lifetime.
func TestStreamIdleCloseBounded(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	leader := &silentLeader{}
	quotadv1.RegisterQuotaServer(srv, leader)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	c := newTestClient(t, []string{lis.Addr().String()}, nil)
	c.stream.idle = 100 * time.Millisecond
	c.stream.closeGrace = 300 * time.Millisecond
	base := recvGoroutines(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const rounds = 4
	for round := range rounds {
		if _, err := c.Wait(ctx, Request{Domain: "d"}); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		// The idle close, then the grace: the stream is gone on both sides.
		clustertest.Eventually(t, 5*time.Second, func() error {
			if n := leader.open.Load(); n != 0 {
				return fmt.Errorf("%d AcquireStream calls still open on the server after the idle close", n)
			}
			if n := recvGoroutines(t) - base; n != 0 {
				return fmt.Errorf("%d stream receivers still running in the client", n)
			}
			return nil
		})
	}
	if st := c.Stats(); st.Streams != rounds || st.RPCs != 0 {
		t.Fatalf("client %+v: want a stream per round, no unary call", st)
	}
}
