package rpc_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// TestHTTPClosesIdleConnections: a keep-alive connection to the HTTP port that sends nothing
// after its request is closed by the agent after HTTPIdleTimeout (user trial: only
// ReadHeaderTimeout was set, and Go then keeps an idle connection open forever), while a
// connection in use keeps serving.
func TestHTTPClosesIdleConnections(t *testing.T) {
	c := rpctest.Start(t, 1, testLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.HTTPIdleTimeout = 300 * time.Millisecond })
	conn, err := net.Dial("tcp", c.Agent(0).HTTPAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	br := bufio.NewReader(conn)
	get := func() {
		t.Helper()
		if _, err := io.WriteString(conn, "GET /healthz HTTP/1.1\r\nHost: quotad\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.Close {
			t.Fatal("the agent closed a connection in use")
		}
	}
	get()
	get() // kept alive between requests
	// Now idle: the agent must close it (EOF), long before this deadline.
	_ = conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := br.ReadByte(); !errors.Is(err, io.EOF) {
		t.Fatalf("idle keep-alive connection: read %v, want EOF (closed by the agent)", err)
	}
}

// TestHTTPManyIdleConnections: 1100 idle keep-alive connections to the HTTP port (the port
// takes callers without a client certificate) do not stop a fresh GET /healthz. With a
// connection cap of 1024 the new connection waited in the accept backlog until an idle one
// timed out.
func TestHTTPManyIdleConnections(t *testing.T) {
	c := rpctest.Start(t, 1, testLimits)
	addr := c.Agent(0).HTTPAddr()
	for i := range 1100 {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		defer conn.Close()
		if _, err := io.WriteString(conn, "GET /healthz HTTP/1.1\r\nHost: quotad\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	// Every one is now idle and kept alive (2 min); a new caller is still served.
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Get("http://" + addr + "/healthz")
	if err != nil {
		t.Fatalf("GET /healthz beside 1100 idle connections: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /healthz beside 1100 idle connections: %s", resp.Status)
	}
}

// TestGRPCClosesSilentConnections: a connection to the gRPC port that never completes its
// handshake is closed after GRPCHandshakeTimeout (grpc-go's default kept it 120 s), and one
// that sends only part of a TLS ClientHello too; a real client still connects.
func TestGRPCClosesSilentConnections(t *testing.T) {
	c := rpctest.Start(t, 1, testLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.GRPCHandshakeTimeout = 300 * time.Millisecond })
	addr := c.Addrs()[0]
	for _, hello := range [][]byte{nil, {0x16, 0x03, 0x01, 0x02, 0x00, 0x01}} {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if _, err := conn.Write(hello); err != nil {
			t.Fatal(err)
		}
		// The agent must close it (EOF), long before this deadline (grpc-go's default: 120 s).
		_ = conn.SetReadDeadline(time.Now().Add(20 * time.Second))
		if _, err := io.Copy(io.Discard, conn); err != nil {
			t.Fatalf("silent connection (sent %x): %v, want EOF (closed by the agent)", hello, err)
		}
	}
	q := quotadv1.NewQuotaClient(dial(t, addr))
	if _, err := acquireOne(context.Background(), q, "c", admission(1, 1, "endpoint=search")); err != nil {
		t.Fatal(err)
	}
}
