package rpc_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/rpc"
)

// h2Caller speaks gRPC by hand over one HTTP/2 connection, so a test can send a call's
// headers without its message (what an attacker holding calls open does), send the message
// later, or reset the call.
type h2Caller struct {
	t    *testing.T
	c    *tls.Conn
	fr   *http2.Framer
	addr string
	next uint32
	// status and message of each answered stream.
	status, message map[uint32]string
}

func dialH2(t *testing.T, p *pki, addr string) *h2Caller {
	t.Helper()
	return dialH2From(t, p, "", addr)
}

// dialH2From is dialH2 from source IP local ("": any).
func dialH2From(t *testing.T, p *pki, local, addr string) *h2Caller {
	t.Helper()
	d := &net.Dialer{}
	if local != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(local)}
	}
	c, err := tls.DialWithDialer(d, "tcp", addr, &tls.Config{RootCAs: p.pool, NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := c.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(c, c)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	return &h2Caller{t: t, c: c, fr: fr, addr: addr, next: 1, status: map[uint32]string{}, message: map[uint32]string{}}
}

// open sends the HEADERS of a call to method with a bearer token ("" for none) and returns
// its stream ID.
func (h *h2Caller) open(method, token string) uint32 {
	h.t.Helper()
	var buf bytes.Buffer
	enc := hpack.NewEncoder(&buf)
	fields := []string{":method", "POST", ":scheme", "https", ":path", method, ":authority", h.addr,
		"content-type", "application/grpc", "te", "trailers"}
	if token != "" {
		fields = append(fields, "authorization", "Bearer "+token)
	}
	for i := 0; i+1 < len(fields); i += 2 {
		_ = enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
	}
	id := h.next
	h.next += 2
	if err := h.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: buf.Bytes(), EndHeaders: true}); err != nil {
		h.t.Fatal(err)
	}
	return id
}

// send sends m as the call's only message and ends the client's side.
func (h *h2Caller) send(id uint32, m proto.Message) {
	h.t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		h.t.Fatal(err)
	}
	frame := make([]byte, 5, 5+len(b))
	binary.BigEndian.PutUint32(frame[1:], uint32(len(b)))
	if err := h.fr.WriteData(id, true, append(frame, b...)); err != nil {
		h.t.Fatal(err)
	}
}

// reset cancels the call (RST_STREAM CANCEL), as a client that gives up does.
func (h *h2Caller) reset(id uint32) {
	h.t.Helper()
	if err := h.fr.WriteRSTStream(id, http2.ErrCodeCancel); err != nil {
		h.t.Fatal(err)
	}
}

// read collects the answers that arrive until quiet passes without a frame.
func (h *h2Caller) read(quiet time.Duration) {
	for {
		_ = h.c.SetReadDeadline(time.Now().Add(quiet))
		f, err := h.fr.ReadFrame()
		if err != nil {
			return
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				_ = h.fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				_ = h.fr.WritePing(true, f.Data)
			}
		case *http2.MetaHeadersFrame:
			for _, hf := range f.RegularFields() {
				switch hf.Name {
				case "grpc-status":
					h.status[f.StreamID] = hf.Value
				case "grpc-message":
					h.message[f.StreamID] = hf.Value
				}
			}
		}
	}
}

// bootstrapTokenFile writes a new bootstrap token to a file and returns both.
func bootstrapTokenFile(t *testing.T) (token, file string) {
	t.Helper()
	file = filepath.Join(t.TempDir(), "bootstrap")
	token, _, err := auth.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return token, file
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestCallsPerIdentityCapped: a caller with a valid token that opens calls and never sends
// their messages holds at most --max-calls-per-identity of them on a node; one more is
// refused ResourceExhausted at its headers, naming the cap and the flag, and counted in
// quotad_calls_refused_total. Other identities are not affected. Every way a call ends gives
// its slot back: reset by the client before its message, the connection closed, a normal
// unary answer, an unknown method, a stream the client cancels.
func TestCallsPerIdentityCapped(t *testing.T) {
	const capCalls = 20
	bootstrap, file := bootstrapTokenFile(t)
	c, p := authCluster(t, tokenLimits, func(_ int, cfg *rpc.AgentConfig) {
		cfg.BootstrapTokenFile = file
		cfg.MaxCallsPerIdentity = capCalls
	})
	leader := c.Leader()
	addr := c.Addrs()[leader]
	agent := c.Agent(leader)
	ctx := context.Background()
	as := func(tok string) context.Context {
		return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	conn := p.dialAs(addr, "")
	created, err := quotadv1.NewAdminClient(conn).CreateToken(as(bootstrap), &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"provider"}})
	if err != nil {
		t.Fatal(err)
	}
	worker := created.Token
	const acquire = "/quotad.v1.Quota/Acquire"

	h := dialH2(t, p, addr)
	var held []uint32
	for range capCalls {
		held = append(held, h.open(acquire, worker))
	}
	over := h.open(acquire, worker)
	h.read(500 * time.Millisecond)
	for _, id := range held {
		if s, ok := h.status[id]; ok {
			t.Fatalf("call %d of %d (headers only) was answered %s %q; want it held until its message", id, capCalls, s, h.message[id])
		}
	}
	if s := h.status[over]; s != "8" || !strings.Contains(h.message[over], "--max-calls-per-identity 20") {
		t.Fatalf("call %d over the cap: grpc-status %q %q, want 8 (ResourceExhausted) naming --max-calls-per-identity 20", capCalls+1, s, h.message[over])
	}
	if n := rpc.CallsInFlight(agent); n != capCalls {
		t.Fatalf("calls in flight %d, want %d", n, capCalls)
	}
	if !strings.Contains(rpc.MetricsText(agent), "quotad_calls_refused_total 1") {
		t.Fatalf("quotad_calls_refused_total is not 1:\n%s", grepLines(rpc.MetricsText(agent), "quotad_calls"))
	}
	// Another identity is served meanwhile.
	q := quotadv1.NewQuotaClient(conn)
	if d, err := acquireOne(as(bootstrap), q, "c", admission(1, 1, "tenant=acme")); err != nil || !d.Admitted {
		t.Fatalf("the bootstrap identity while the worker is at its cap: %v %v", d, err)
	}

	// Reset before their message (the interceptor never runs): their slots come back.
	for _, id := range held[:10] {
		h.reset(id)
	}
	waitFor(t, "reset calls to give their slots back", func() bool { return rpc.CallsInFlight(agent) == capCalls-10 })
	for range 10 {
		held = append(held, h.open(acquire, worker))
	}
	over = h.open(acquire, worker)
	h.read(300 * time.Millisecond)
	if s := h.status[over]; s != "8" {
		t.Fatalf("over the cap again after resets: grpc-status %q, want 8", s)
	}
	// The connection closed: every slot comes back.
	h.c.Close()
	waitFor(t, "a closed connection's calls to give their slots back", func() bool { return rpc.CallsInFlight(agent) == 0 })

	// Calls that end normally, more than the cap one after another; unknown methods.
	for i := range 2 * capCalls {
		if _, err := acquireOne(as(worker), q, "c", admission(uint64(100+i), 1, "endpoint=search")); err != nil {
			t.Fatalf("sequential call %d: %v", i, err)
		}
	}
	h = dialH2(t, p, addr)
	for range 2 * capCalls {
		id := h.open("/no.such.Service/Method", worker)
		h.send(id, &quotadv1.StatusRequest{})
		h.read(100 * time.Millisecond)
		if s := h.status[id]; s != "12" {
			t.Fatalf("unknown method: grpc-status %q %q, want 12 (Unimplemented)", s, h.message[id])
		}
	}
	waitFor(t, "answered calls to give their slots back", func() bool { return rpc.CallsInFlight(agent) == 0 })

	// Streams: held while open, refused over the cap, given back when canceled.
	hc := healthpb.NewHealthClient(conn)
	sctx, cancel := context.WithCancel(as(worker))
	for i := range capCalls {
		w, err := hc.Watch(sctx, &healthpb.HealthCheckRequest{})
		if err == nil {
			_, err = w.Recv()
		}
		if err != nil {
			t.Fatalf("watch %d: %v", i, err)
		}
	}
	w, err := hc.Watch(as(worker), &healthpb.HealthCheckRequest{})
	if err == nil {
		_, err = w.Recv()
	}
	wantCode(t, err, codes.ResourceExhausted, "--max-calls-per-identity")
	cancel()
	waitFor(t, "canceled streams to give their slots back", func() bool { return rpc.CallsInFlight(agent) == 0 })
	if !strings.Contains(rpc.MetricsText(agent), "quotad_calls_refused_total 3") {
		t.Fatalf("quotad_calls_refused_total is not 3:\n%s", grepLines(rpc.MetricsText(agent), "quotad_calls"))
	}
}

// TestTokenHashedOncePerCall: the tap hands the identity it found to the interceptor, so a
// call's token is hashed once (it was twice: tap and interceptor). A token revoked between
// a call's headers and its message is still refused: the interceptor looks the token up
// again when the token table changed since the tap.
func TestTokenHashedOncePerCall(t *testing.T) {
	bootstrap, file := bootstrapTokenFile(t)
	c, p := authCluster(t, tokenLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.BootstrapTokenFile = file })
	leader := c.Leader()
	addr := c.Addrs()[leader]
	ctx := context.Background()
	as := func(tok string) context.Context {
		return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	conn := p.dialAs(addr, "")
	admin := quotadv1.NewAdminClient(conn)
	created, err := admin.CreateToken(as(bootstrap), &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"provider"}})
	if err != nil {
		t.Fatal(err)
	}
	q := quotadv1.NewQuotaClient(conn)
	if _, err := acquireOne(as(created.Token), q, "c", admission(1, 1, "endpoint=search")); err != nil {
		t.Fatal(err) // the connection is up
	}
	var hashes atomic.Int64
	rpc.SetTokenHashHook(func() { hashes.Add(1) })
	defer rpc.SetTokenHashHook(nil)
	const calls = 10
	for i := range calls {
		if _, err := acquireOne(as(created.Token), q, "c", admission(uint64(10+i), 1, "endpoint=search")); err != nil {
			t.Fatal(err)
		}
	}
	if n := hashes.Load(); n != calls {
		t.Fatalf("%d calls on the leader hashed the token %d times, want once per call", calls, n)
	}
	rpc.SetTokenHashHook(nil)

	// Headers pass the tap, the token is revoked, then the message arrives.
	h := dialH2(t, p, addr)
	id := h.open("/quotad.v1.Quota/Acquire", created.Token)
	h.read(200 * time.Millisecond)
	if s, ok := h.status[id]; ok {
		t.Fatalf("headers with a valid token answered %s %q", s, h.message[id])
	}
	if _, err := admin.RevokeToken(as(bootstrap), &quotadv1.RevokeTokenRequest{Accessor: created.Accessor}); err != nil {
		t.Fatal(err)
	}
	h.send(id, &quotadv1.AcquireRequest{ClientId: "c", Admissions: []*quotadv1.Admission{admission(100, 1, "endpoint=search")}})
	h.read(time.Second)
	if s := h.status[id]; s != "16" || !strings.Contains(h.message[id], "not known") {
		t.Fatalf("message after the revoke: grpc-status %q %q, want 16 (Unauthenticated): the token is revoked", s, h.message[id])
	}
	_, err = acquireOne(as(created.Token), q, "c", admission(101, 1, "endpoint=search"))
	wantCode(t, err, codes.Unauthenticated, "not known")
}

// TestOpenCallsBoundedWithoutLockout: health Check needs no credential, so the calls waiting
// for their request are bounded by source address (rpc.MaxOpenCallsPerAddress) and in total
// (rpc.MaxOpenCalls): one beyond a bound ends the oldest waiting one (Canceled) instead of
// being refused, so a host holding its address's slots with headers-only calls does not lock
// out the health checkers sharing its address (a NAT, a load balancer): before, every check
// from that address was refused ResourceExhausted for as long as the flooder's connection
// lived. The node still holds at most the bounds, and the slots come back when the
// connection closes (before any bound, 30,000 such calls took a node from 25 to 359 MB).
func TestOpenCallsBoundedWithoutLockout(t *testing.T) {
	c, p := authCluster(t, tokenLimits)
	leader := c.Leader()
	addr := c.Addrs()[leader]
	agent := c.Agent(leader)
	const check = "/grpc.health.v1.Health/Check"
	h := dialH2(t, p, addr)
	var held []uint32
	for range rpc.MaxOpenCallsPerAddress {
		held = append(held, h.open(check, ""))
	}
	newest := h.open(check, "")
	h.read(500 * time.Millisecond)
	if s := h.status[held[0]]; s != "1" {
		t.Fatalf("the oldest headers-only health check of the address after %d more: grpc-status %q %q, want 1 (Canceled)", rpc.MaxOpenCallsPerAddress, s, h.message[held[0]])
	}
	for _, id := range append(held[1:], newest) {
		if s, ok := h.status[id]; ok {
			t.Fatalf("health check %d (headers only) answered %s %q; want it held until its message", id, s, h.message[id])
		}
	}
	if n := rpc.CallsInFlight(agent); n != rpc.MaxOpenCallsPerAddress {
		t.Fatalf("%d open calls held, want the per-address bound %d", n, rpc.MaxOpenCallsPerAddress)
	}
	// The same address's honest checks are answered while the flooder holds its 64.
	hc := healthpb.NewHealthClient(p.dialAs(addr, ""))
	for i := range 2 * rpc.MaxOpenCallsPerAddress {
		if r, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("health check %d from the flooder's address: %v %v", i, r, err)
		}
	}
	// The node-wide bound: another address's calls end the node's oldest.
	const total = rpc.MaxOpenCallsPerAddress + 16
	defer rpc.SetMaxOpenCalls(total)()
	other := dialH2From(t, p, "127.0.0.2", addr)
	for range 32 {
		other.open(check, "")
	}
	h.read(500 * time.Millisecond)
	for i, id := range held[1:] {
		if s, ended := h.status[id]; ended != (i < 32-16) || (ended && s != "1") {
			t.Fatalf("held call %d after 32 from another address over a node-wide bound of %d: answered %v %q, want the 16 oldest ended Canceled", i+1, total, ended, s)
		}
	}
	if n := rpc.CallsInFlight(agent); n != total {
		t.Fatalf("%d open calls held, want the node-wide bound %d", n, total)
	}
	h.c.Close()
	other.c.Close()
	waitFor(t, "the closed connections' health checks to give their slots back", func() bool { return rpc.CallsInFlight(agent) == 0 })
}

// TestWaitingUnaryCallsNotCapped: a unary call leaves its identity's in-flight count once its
// request has arrived, so an identity may have more waiting unary Acquires than
// --max-calls-per-identity (they are bounded by the waiter caps); headers-only calls are
// still refused beyond it (TestCallsPerIdentityCapped).
func TestWaitingUnaryCallsNotCapped(t *testing.T) {
	const capCalls = 5
	bootstrap, file := bootstrapTokenFile(t)
	c, p := authCluster(t, tokenLimits, func(_ int, cfg *rpc.AgentConfig) {
		cfg.BootstrapTokenFile = file
		cfg.MaxCallsPerIdentity = capCalls
	})
	addr := c.Addrs()[c.Leader()]
	as := func(ctx context.Context, tok string) context.Context {
		return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	conn := p.dialAs(addr, "")
	created, err := quotadv1.NewAdminClient(conn).CreateToken(as(context.Background(), bootstrap), &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"provider"}})
	if err != nil {
		t.Fatal(err)
	}
	q := quotadv1.NewQuotaClient(conn)
	ctx, cancel := context.WithTimeout(as(context.Background(), created.Token), 20*time.Second)
	defer cancel()
	// Tenant w's two permits held: every waiter below waits for one.
	for i := range 2 {
		if d, err := acquireOne(ctx, q, "holder", admission(uint64(1+i), 1, "tenant=w")); err != nil || !d.Admitted {
			t.Fatalf("permit %d: %v %v", i, d, err)
		}
	}
	wctx, wcancel := context.WithCancel(ctx)
	errs := make(chan error, 4*capCalls)
	// One after another (a burst of headers can still meet the cap before the messages
	// follow): each queued before the next is sent.
	for i := range 4 * capCalls {
		go func() {
			a := admission(uint64(100+i), 1, "tenant=w")
			a.MaxWaitMs = 15000
			d, err := acquireOne(wctx, q, fmt.Sprint("waiter", i), a)
			if err == nil {
				err = fmt.Errorf("decided before the cancel: %v", d)
			}
			errs <- err
		}()
		waitFor(t, "the waiter queued on the leader", func() bool {
			if len(errs) > 0 {
				t.Fatalf("waiter %d returned before the cancel: %v", i, <-errs)
			}
			return c.Agent(c.Leader()).FairView().Waiting == i+1
		})
	}
	wcancel()
	for range 4 * capCalls {
		if err := <-errs; status.Code(err) == codes.ResourceExhausted {
			t.Fatalf("a waiting unary Acquire was refused at the call cap %d: %v", capCalls, err)
		}
	}
}
