package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/cluster/clustertest"
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

// pacedLeader is a real gRPC Quota server that, like a quotad leader, announces a heartbeat
// (beat) and sends a message without decisions every beat while admissions are undecided; it
// decides them (admitted) only when release is closed.
type pacedLeader struct {
	quotadv1.UnimplementedQuotaServer
	beat     time.Duration
	release  chan struct{}
	streams  atomic.Int64 // AcquireStreams opened
	received atomic.Int64 // admissions received
}

func (l *pacedLeader) AcquireStream(ss quotadv1.Quota_AcquireStreamServer) error {
	l.streams.Add(1)
	if err := ss.SendHeader(metadata.Pairs(streamHeartbeatHeader, strconv.FormatInt(l.beat.Milliseconds(), 10))); err != nil {
		return err
	}
	msgs := make(chan *quotadv1.AcquireStreamRequest)
	go func() {
		defer close(msgs)
		for {
			m, err := ss.Recv()
			if err != nil {
				return
			}
			msgs <- m
		}
	}()
	tick := time.NewTicker(l.beat)
	defer tick.Stop()
	release := l.release
	var undecided []uint64
	for {
		resp := &quotadv1.AcquireStreamResponse{}
		select {
		case m, ok := <-msgs:
			if !ok {
				return nil
			}
			for _, a := range m.Admissions {
				l.received.Add(1)
				undecided = append(undecided, a.RequestId)
			}
			if release != nil {
				continue
			}
		case <-release:
			release = nil
		case <-tick.C:
			if len(undecided) == 0 {
				continue
			}
		}
		if release == nil {
			for _, id := range undecided {
				resp.Decisions = append(resp.Decisions, &quotadv1.StreamDecision{RequestId: id, Decision: &quotadv1.Decision{Admitted: true}})
			}
			undecided = nil
		}
		if err := ss.Send(resp); err != nil {
			return err
		}
	}
}

// streamClientEnv names the leader the helper process TestStreamClientProcess waits on.
const streamClientEnv = "QUOTAD_TEST_STREAM_CLIENT_ADDR"

// TestStreamClientProcess is not a test: TestStreamWatchIgnoresClientPause runs it as its
// client process. It waits once over a stream and prints the client's Stats as JSON.
func TestStreamClientProcess(t *testing.T) {
	addr := os.Getenv(streamClientEnv)
	if addr == "" {
		t.Skip("helper process only")
	}
	c := newTestClient(t, []string{addr}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := c.Wait(ctx, Request{Domain: "d", MaxWait: 30 * time.Second}); err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(c.Stats())
	if err != nil {
		t.Fatal(err)
	}
	fmt.Printf("stats %s\n", b)
}

// TestStreamWatchIgnoresClientPause: a client process that was not running (stopped, its VM
// suspended) for longer than the stall limit does not take the leader for stalled when it
// resumes: the heartbeats the leader sent meanwhile are in its socket, unread. The watch's tick
// came first and failed a healthy stream (its waits canceled on the leader, losing their
// place in the queues, and the leader marked failed).
func TestStreamWatchIgnoresClientPause(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	leader := &pacedLeader{beat: 100 * time.Millisecond, release: make(chan struct{})}
	quotadv1.RegisterQuotaServer(srv, leader)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	cmd := exec.Command(os.Args[0], "-test.run=^TestStreamClientProcess$", "-test.v=false")
	// One P: on resume the scheduler runs the goroutines its timers woke (the watch) before it
	// polls the network (the receiver), as a loaded client would.
	cmd.Env = append(os.Environ(), streamClientEnv+"="+lis.Addr().String(), "GOMAXPROCS=1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill() }()
	clustertest.Eventually(t, 10*time.Second, func() error {
		if leader.received.Load() == 0 {
			return errors.New("the client's admission has not reached the leader")
		}
		return nil
	})
	time.Sleep(300 * time.Millisecond) // a few heartbeats read
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	time.Sleep(streamStallMin + 1500*time.Millisecond)
	if err := cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second) // resumed: a stall would be seen by now
	close(leader.release)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("client process: %v\n%s%s", err, stdout.String(), stderr.String())
	}
	var st Stats
	_, js, _ := strings.Cut(stdout.String(), "stats ")
	if err := json.Unmarshal([]byte(strings.TrimSpace(strings.SplitN(js, "\n", 2)[0])), &st); err != nil {
		t.Fatalf("client process printed %q: %v", stdout.String(), err)
	}
	if st.StreamStalls != 0 || leader.streams.Load() != 1 {
		t.Fatalf("client %+v, %d streams opened: the healthy leader was taken for stalled after the client's own pause", st, leader.streams.Load())
	}
}
