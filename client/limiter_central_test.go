package client

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
)

// blackhole is a dialer whose connections, once cut, drop every byte both ways while staying
// open: a peer that stopped answering (SIGSTOP, a silent network drop), not one that refuses.
type blackhole struct{ cut atomic.Bool }

func (b *blackhole) option() grpc.DialOption {
	return grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		return &holedConn{Conn: c, b: b}, nil
	})
}

type holedConn struct {
	net.Conn
	b *blackhole
}

func (c *holedConn) Write(p []byte) (int, error) {
	if c.b.cut.Load() {
		return len(p), nil
	}
	return c.Conn.Write(p)
}

func (c *holedConn) Read(p []byte) (int, error) {
	for {
		n, err := c.Conn.Read(p)
		if err != nil || !c.b.cut.Load() {
			return n, err
		}
	}
}

// Limiter.Allow makes no RPC on a path decided locally — it admits from its grant while the
// cluster does not answer at all — but on a path decided centrally (here: a level that does
// not lend) it is Client.Allow: it waits for the cluster up to CentralTimeout and then says
// no. AllowLocalN never asks the cluster. What README and the Limiter's doc say.
func TestLimiterAllowBlocksOnlyOnTheCentralPath(t *testing.T) {
	tc := &testCluster{startShareCluster(t)}
	var hole blackhole
	c := newTestClient(t, tc.addrs(), func(cfg *Config) { cfg.DialOptions = append(cfg.DialOptions, hole.option()) })
	const central = 300 * time.Millisecond
	lent := c.Limiter(Request{Domain: "shared"}, LimiterOptions{CentralTimeout: central})
	defer lent.Close()
	plain := c.Limiter(Request{Domain: "plain"}, LimiterOptions{CentralTimeout: central})
	defer plain.Close()
	waitLocal(t, lent)
	deadline := time.Now().Add(10 * time.Second)
	for plain.Share().Status != "central" && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if s := plain.Share(); s.Status != "central" || !plain.Allow() {
		t.Fatalf("plain: share %+v, want central and a full bucket's admission", s)
	}

	hole.cut.Store(true) // the cluster stops answering this client
	if !lent.Allow() {
		t.Fatal("lent path: Allow refused with a live grant while the cluster does not answer (it must not need the cluster)")
	}
	if ok, undo := plain.AllowLocalN(1); ok || undo != nil {
		t.Fatal("AllowLocalN admitted on a central path")
	}
	done := make(chan time.Duration, 1)
	go func() {
		start := time.Now()
		if plain.Allow() {
			t.Error("central path: Allow admitted while the cluster does not answer")
		}
		done <- time.Since(start)
	}()
	select {
	case took := <-done:
		// It asked the cluster and gave up at CentralTimeout (a context deadline: never before).
		if took < central {
			t.Fatalf("central Allow returned after %v, before its CentralTimeout %v: it did not ask the cluster", took, central)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("central Allow still blocked after 30s with CentralTimeout %v", central)
	}
}
