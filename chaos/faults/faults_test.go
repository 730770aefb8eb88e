package faults

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestWallOffsetSupported(t *testing.T) {
	if !WallOffsetSupported() {
		t.Fatal("time.Time layout changed: clock offsets would move the monotonic reading too; update goTime")
	}
}

func TestClockOffsetMovesWallOnly(t *testing.T) {
	c := NewClock()
	a := c.Now()
	c.SetOffset(5 * time.Hour)
	b := c.Now()
	if d := b.Sub(a); d < 0 || d > time.Second {
		t.Fatalf("monotonic Sub across a +5h offset = %v, want ~0", d)
	}
	if d := b.Round(0).Sub(a.Round(0)); d < 5*time.Hour || d > 5*time.Hour+time.Second {
		t.Fatalf("wall difference across a +5h offset = %v, want ~5h", d)
	}
	c.Jump(-7 * time.Hour) // now -2h
	cc := c.Now()
	if d := cc.Sub(b); d < 0 {
		t.Fatalf("monotonic reading went back by %v on a wall jump back", -d)
	}
	if w := time.Until(cc.Round(0)); w > -2*time.Hour+time.Second || w < -2*time.Hour-time.Second {
		t.Fatalf("wall reading is %v from real time, want ~-2h", w)
	}
}

func TestClockRate(t *testing.T) {
	c := NewClock()
	c.SetRate(3)
	a := c.Now()
	time.Sleep(50 * time.Millisecond)
	b := c.Now()
	if d := b.Sub(a); d < 140*time.Millisecond || d > 400*time.Millisecond {
		t.Fatalf("3x clock advanced %v over ~50ms of real time, want ~150ms", d)
	}
	c.Reset()
	cc := c.Now()
	if cc.Sub(b) < 0 {
		t.Fatalf("reset made the clock go back by %v", b.Sub(cc))
	}
	if s := c.State(); s.Rate != 1 || s.Offset != "0s" || s.DriftMs < 90 {
		t.Fatalf("state after reset = %+v, want rate 1, offset 0, drift >= ~100ms kept", s)
	}
}

// tcpStream is a minimal raft.StreamLayer for tests.
type tcpStream struct{ net.Listener }

func (s tcpStream) Dial(a raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	return net.DialTimeout("tcp", string(a), timeout)
}

func echoServer(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	return ln
}

func TestPartitionRefusesDialsAndCutsConnections(t *testing.T) {
	peer := echoServer(t)
	local, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	n := NewNetwork()
	s := n.WrapStreamLayer(tcpStream{local})
	addr := raft.ServerAddress(peer.Addr().String())

	c, err := s.Dial(addr, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	n.Block([]string{string(addr)})
	buf := make([]byte, 1)
	_ = c.SetReadDeadline(time.Now().Add(time.Second))
	if _, err := c.Read(buf); err == nil {
		t.Fatal("read on a connection to a blocked peer succeeded")
	}
	if _, err := s.Dial(addr, time.Second); !errors.Is(err, ErrBlocked) {
		t.Fatalf("dial to a blocked peer: err = %v, want ErrBlocked", err)
	}
	if st := n.State(); st.DialsRefused != 1 || st.ConnsCut != 1 {
		t.Fatalf("state = %+v, want 1 dial refused and 1 connection cut", st)
	}
	n.Heal()
	c2, err := s.Dial(addr, time.Second)
	if err != nil {
		t.Fatalf("dial after heal: %v", err)
	}
	c2.Close()
}

type memLogs struct {
	raft.LogStore
	stored int
}

func (m *memLogs) StoreLogs(ls []*raft.Log) error { m.stored += len(ls); return nil }

func TestDiskDelay(t *testing.T) {
	var d Disk
	m := &memLogs{}
	s := d.WrapLogStore(m)
	d.SetDelay(30 * time.Millisecond)
	start := time.Now()
	if err := s.StoreLogs([]*raft.Log{{Index: 1}}); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el < 30*time.Millisecond {
		t.Fatalf("delayed append took %v, want >= 30ms", el)
	}
	if m.stored != 1 || d.State().Delayed != 1 {
		t.Fatalf("stored %d, delayed %d; want 1, 1", m.stored, d.State().Delayed)
	}
}

func TestHandler(t *testing.T) {
	f := New()
	srv := httptest.NewServer(f.Handler())
	defer srv.Close()
	post := func(path string) (int, State) {
		resp, err := http.Post(srv.URL+path, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var st State
		if resp.StatusCode == 200 {
			if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
				t.Fatal(err)
			}
		}
		return resp.StatusCode, st
	}
	if code, st := post("/chaos/clock?offset=-3h&rate=1.5"); code != 200 || st.Clock.Rate != 1.5 || st.Clock.Offset != "-3h0m0s" {
		t.Fatalf("clock: %d %+v", code, st.Clock)
	}
	if code, st := post("/chaos/partition?block=127.0.0.1:1,127.0.0.1:2"); code != 200 || len(st.Network.Blocked) != 2 {
		t.Fatalf("partition: %d %+v", code, st.Network)
	}
	if code, st := post("/chaos/disk?delay=20ms"); code != 200 || st.Disk.Delay != "20ms" {
		t.Fatalf("disk: %d %+v", code, st.Disk)
	}
	if code, st := post("/chaos/replies?drop=0.25"); code != 200 || st.Replies.Drop != 0.25 {
		t.Fatalf("replies: %d %+v", code, st.Replies)
	}
	for _, bad := range []string{"/chaos/clock?rate=-1", "/chaos/clock?offset=3", "/chaos/partition?block=nohost", "/chaos/disk?delay=x", "/chaos/heal?what=moon", "/chaos/replies?drop=2", "/chaos/replies"} {
		if code, _ := post(bad); code != 400 {
			t.Errorf("POST %s = %d, want 400", bad, code)
		}
	}
	if st := f.State(); st.Clock.Rate != 1.5 || len(st.Network.Blocked) != 2 || st.Replies.Drop != 0.25 {
		t.Fatalf("a bad request changed state: %+v", st)
	}
	if code, st := post("/chaos/heal"); code != 200 || st.Clock.Rate != 1 || len(st.Network.Blocked) != 0 || st.Disk.Delay != "0s" || st.Replies.Drop != 0 {
		t.Fatalf("heal: %d %+v", code, st)
	}
	resp, err := http.Get(srv.URL + "/chaos/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"wall_offset_supported":true`) {
		t.Fatalf("GET /chaos/ = %d %s", resp.StatusCode, body)
	}
}

func TestRepliesLosesOnlyDecidedAcquireReplies(t *testing.T) {
	var r Replies
	decided := 0
	handler := func(ctx context.Context, req any) (any, error) { decided++; return "decision", nil }
	failing := func(ctx context.Context, req any) (any, error) { decided++; return nil, errors.New("not committed") }
	acquire := &grpc.UnaryServerInfo{FullMethod: AcquireMethod}
	call := func(info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		defer cancel()
		return r.UnaryInterceptor(ctx, nil, info, h)
	}
	if resp, err := call(acquire, handler); err != nil || resp != "decision" {
		t.Fatalf("drop 0: %v %v", resp, err)
	}
	r.SetDrop(1)
	for range 20 {
		resp, err := call(acquire, handler)
		if resp != nil || err == nil || !strings.Contains(err.Error(), DroppedMessage) {
			t.Fatalf("drop 1: got %v %v, want the dropped-reply error", resp, err)
		}
		if c := status.Code(err); c != codes.Unavailable && c != codes.DeadlineExceeded {
			t.Fatalf("dropped reply has code %v, want Unavailable or DeadlineExceeded (retryable)", c)
		}
	}
	if decided != 21 {
		t.Fatalf("handler ran %d times, want 21: the decision must be made before the reply is lost", decided)
	}
	if st := r.State(); st.Dropped+st.Hung != 20 || st.Dropped == 0 || st.Hung == 0 {
		t.Fatalf("state %+v: want 20 lost replies of both kinds", st)
	}
	// Failed calls and other methods pass untouched.
	if _, err := call(acquire, failing); err == nil || strings.Contains(err.Error(), DroppedMessage) {
		t.Fatalf("a failed call must keep its own error, got %v", err)
	}
	if resp, err := call(&grpc.UnaryServerInfo{FullMethod: "/quotad.v1.Quota/Status"}, handler); err != nil || resp != "decision" {
		t.Fatalf("other method: %v %v", resp, err)
	}
	r.SetDrop(0.5)
	if d := r.Drop(); d != 0.5 {
		t.Fatalf("Drop() = %v after SetDrop(0.5)", d)
	}
}
