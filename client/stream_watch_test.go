package client

import (
	"context"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// beatingLeader is a real gRPC Quota server whose AcquireStream announces heartbeats in its
// header (the value it is given, as a leader of another build or a hostile one may) and admits
// every admission at once.
type beatingLeader struct {
	quotadv1.UnimplementedQuotaServer
	beatMS string
}

func (l *beatingLeader) AcquireStream(ss quotadv1.Quota_AcquireStreamServer) error {
	if err := ss.SendHeader(metadata.Pairs(streamHeartbeatHeader, l.beatMS)); err != nil {
		return err
	}
	for {
		m, err := ss.Recv()
		if err != nil {
			return nil
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

// TestStreamHeartbeatHeaderOutOfRange: a heartbeat period the client cannot use (one that
// overflows a time.Duration, zero, negative, not a number) is ignored — the stream works, only
// without the stall watch. An overflowing one made time.NewTicker panic in the watch
// goroutine, crashing the client's whole process on one header from the server.
func TestStreamHeartbeatHeaderOutOfRange(t *testing.T) {
	for _, beat := range []string{"9223372036854775807", "10000000000000", "3074457345618259", "0", "-5", "soon"} {
		t.Run(beat, func(t *testing.T) {
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			srv := grpc.NewServer()
			quotadv1.RegisterQuotaServer(srv, &beatingLeader{beatMS: beat})
			go func() { _ = srv.Serve(lis) }()
			defer srv.Stop()
			c := newTestClient(t, []string{lis.Addr().String()}, nil)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			for round := range 3 {
				if _, err := c.Wait(ctx, Request{Domain: "d"}); err != nil {
					t.Fatalf("round %d: %v", round, err)
				}
				time.Sleep(50 * time.Millisecond) // the watch goroutine runs
			}
			if st := c.Stats(); st.Streams != 1 || st.RPCs != 0 || st.StreamStalls != 0 {
				t.Fatalf("client %+v: want every wait on one stream", st)
			}
		})
	}
}
