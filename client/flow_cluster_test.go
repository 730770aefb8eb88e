package client

import (
	"context"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// frameCounter counts the HTTP/2 frames of one plaintext connection by direction and type,
// reading the frame headers out of the bytes as they pass.
type frameCounter struct {
	mu   sync.Mutex
	sent map[frameKind]int // client → server
	recv map[frameKind]int // server → client
}

type frameKind struct {
	typ byte
	ack bool // PING and SETTINGS: the ACK flag
}

const (
	frameWindowUpdate = 0x8
	framePing         = 0x6
)

func (fc *frameCounter) count(dir map[frameKind]int, typ, flags byte) {
	fc.mu.Lock()
	dir[frameKind{typ, (typ == framePing || typ == 0x4) && flags&1 != 0}]++
	fc.mu.Unlock()
}

func (fc *frameCounter) snapshot() (sent, recv map[frameKind]int) {
	fc.mu.Lock()
	defer fc.mu.Unlock()
	sent, recv = map[frameKind]int{}, map[frameKind]int{}
	for k, v := range fc.sent {
		sent[k] = v
	}
	for k, v := range fc.recv {
		recv[k] = v
	}
	return sent, recv
}

// frameParser follows one direction of a connection: skip bytes of the client preface, then
// 9-byte frame headers and their payloads.
type frameParser struct {
	skip   int
	hdr    []byte
	onSeen func(typ, flags byte)
}

func (p *frameParser) feed(b []byte) {
	for len(b) > 0 {
		if p.skip > 0 {
			n := min(p.skip, len(b))
			p.skip -= n
			b = b[n:]
			continue
		}
		need := 9 - len(p.hdr)
		n := min(need, len(b))
		p.hdr = append(p.hdr, b[:n]...)
		b = b[n:]
		if len(p.hdr) == 9 {
			p.onSeen(p.hdr[3], p.hdr[4])
			p.skip = int(p.hdr[0])<<16 | int(p.hdr[1])<<8 | int(p.hdr[2])
			p.hdr = p.hdr[:0]
		}
	}
}

// countingConn feeds what passes through it to a parser per direction (Read and Write may
// run concurrently; each parser has its own lock).
type countingConn struct {
	net.Conn
	out, in  *frameParser
	wmu, rmu sync.Mutex
}

func (c *countingConn) Write(b []byte) (int, error) {
	c.wmu.Lock()
	c.out.feed(b)
	c.wmu.Unlock()
	return c.Conn.Write(b)
}

func (c *countingConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.rmu.Lock()
	c.in.feed(b[:n])
	c.rmu.Unlock()
	return n, err
}

// Serial calls cost no flow-control traffic: with static windows (internal/grpcflow) neither
// side sends a bandwidth-delay-product PING or a connection WINDOW_UPDATE per call. With
// grpc-go's dynamic windows each call made the client send a WINDOW_UPDATE and a PING (and the
// server one of each for the request), and the other side answer every PING.
func TestSerialCallsSendNoFlowControlFrames(t *testing.T) {
	tc := startCluster(t)
	fc := &frameCounter{sent: map[frameKind]int{}, recv: map[frameKind]int{}}
	dial := func(ctx context.Context, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		return &countingConn{Conn: c,
			out: &frameParser{skip: 24, onSeen: func(typ, flags byte) { fc.count(fc.sent, typ, flags) }}, // client preface
			in:  &frameParser{onSeen: func(typ, flags byte) { fc.count(fc.recv, typ, flags) }},
		}, nil
	}
	c := newTestClient(t, tc.addrs(), func(cfg *Config) {
		cfg.DialOptions = append(cfg.DialOptions, grpc.WithContextDialer(dial))
	})
	ctx := context.Background()
	// Learn the leader and open the connection; settle its setup frames.
	for range 3 {
		if _, err := c.Allow(ctx, Request{Domain: "bench"}); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(100 * time.Millisecond)
	sent0, recv0 := fc.snapshot()
	const calls = 50
	for range calls {
		if _, err := c.Allow(ctx, Request{Domain: "bench"}); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(100 * time.Millisecond) // answers to the last call's frames
	sent, recv := fc.snapshot()
	delta := func(a, b map[frameKind]int, k frameKind) int { return a[k] - b[k] }
	if d := delta(sent, sent0, frameKind{0x1, false}); d < calls {
		t.Fatalf("the client sent %d HEADERS frames for %d calls: the counter does not see the calls", d, calls)
	}
	for _, k := range []struct {
		name string
		kind frameKind
	}{{"PING", frameKind{framePing, false}}, {"PING ack", frameKind{framePing, true}}, {"WINDOW_UPDATE", frameKind{frameWindowUpdate, false}}} {
		if d := delta(sent, sent0, k.kind); d != 0 {
			t.Errorf("the client sent %d %s frames during %d serial calls, want 0", d, k.name, calls)
		}
		if d := delta(recv, recv0, k.kind); d != 0 {
			t.Errorf("the server sent %d %s frames during %d serial calls, want 0", d, k.name, calls)
		}
	}
}

// Serial calls run on the server's long-lived stream workers (rpc's grpc.NumStreamWorkers, 64
// per server), not on a new goroutine each. grpc-go hands a call to the worker that has
// waited longest, so the workers take turns: more calls than workers must repeat goroutines.
func TestSerialCallsReuseServerGoroutines(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]int{}
	record := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if strings.HasSuffix(info.FullMethod, "/Acquire") {
			buf := make([]byte, 64)
			id, _, _ := strings.Cut(strings.TrimPrefix(string(buf[:runtime.Stack(buf, false)]), "goroutine "), " ")
			mu.Lock()
			seen[id]++
			mu.Unlock()
		}
		return h(ctx, req)
	}
	tc := rpctest.Start(t, 3, testLimits, func(_ int, cfg *rpc.AgentConfig) {
		cfg.UnaryInterceptors = append(cfg.UnaryInterceptors, record)
	})
	c := newTestClient(t, tc.Addrs(), nil)
	const calls, workers = 200, 64
	for range calls {
		if _, err := c.Allow(context.Background(), Request{Domain: "bench"}); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	n := 0
	for _, k := range seen {
		n += k
	}
	if n < calls {
		t.Fatalf("the interceptor saw %d Acquire calls, want at least %d", n, calls)
	}
	// The first call may reach a follower (which forwards it) before the client learns the
	// leader: a worker or two of another server.
	if len(seen) > workers+2 {
		t.Fatalf("%d Acquire calls ran on %d different goroutines, want at most the leader's %d workers and two more", n, len(seen), workers)
	}
}
