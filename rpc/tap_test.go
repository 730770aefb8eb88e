package rpc_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/rpc"
)

// headersOnlyStatus opens an HTTP/2 connection to addr over TLS (no client certificate), sends
// the HEADERS of a call to method (with the extra header fields) and never its message, and
// returns the grpc-status the node answers with, or "" if it answers nothing within wait.
func headersOnlyStatus(t *testing.T, p *pki, addr, method string, extra ...string) string {
	t.Helper()
	c, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: p.pool, NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(c, c)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	enc := hpack.NewEncoder(&buf)
	fields := append([]string{":method", "POST", ":scheme", "https", ":path", method, ":authority", addr,
		"content-type", "application/grpc", "te", "trailers"}, extra...)
	for i := 0; i+1 < len(fields); i += 2 {
		_ = enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
	}
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: buf.Bytes(), EndHeaders: true}); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return "" // nothing but settings and pings: the node waits for the message
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				_ = fr.WriteSettingsAck()
			}
		case *http2.MetaHeadersFrame:
			if f.StreamID == 1 {
				if v := f.PseudoValue("status"); v != "" && v != "200" {
					return "http " + v
				}
				for _, hf := range f.RegularFields() {
					if hf.Name == "grpc-status" {
						return hf.Value
					}
				}
			}
		}
	}
}

// TestCallsWithoutCredentialRefusedAtHeaders: a call without a credential (or with a token the
// cluster does not know) to a method that needs one is refused Unauthenticated as soon as its
// headers arrive, before any message. Before, the node started the call and waited for the
// message for as long as the connection lived: 30,000 such streams held 30,000 goroutines and
// 350 MB on a make-run node, without a credential. Health/Watch (a stream a caller keeps as
// long as it likes) needs a credential too; Health/Check stays open.
func TestCallsWithoutCredentialRefusedAtHeaders(t *testing.T) {
	bootstrapFile := filepath.Join(t.TempDir(), "bootstrap")
	bootstrap, _, err := auth.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bootstrapFile, []byte(bootstrap+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, p := authCluster(t, tokenLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.BootstrapTokenFile = bootstrapFile })
	addr := c.Addrs()[c.Leader()]
	unauthenticated := "16"
	for _, m := range []string{"/quotad.v1.Admin/ApplyLimits", "/quotad.v1.Quota/Acquire", "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit", "/quotad.v1.Peer/ForwardRateLimit", "/no.such.Service/Method"} {
		if got := headersOnlyStatus(t, p, addr, m); got != unauthenticated {
			t.Errorf("%s without a credential: grpc-status %q, want %s (Unauthenticated) before the message", m, got, unauthenticated)
		}
	}
	if got := headersOnlyStatus(t, p, addr, "/quotad.v1.Quota/Acquire", "authorization", "Bearer qd_aaaaaaaaaaaaaaaa_"+string(bytes.Repeat([]byte("b"), 43))); got != unauthenticated {
		t.Errorf("Acquire with an unknown token: grpc-status %q, want %s", got, unauthenticated)
	}
	// A known token passes the headers: the node waits for the message.
	if got := headersOnlyStatus(t, p, addr, "/quotad.v1.Quota/Acquire", "authorization", "Bearer "+bootstrap); got != "" {
		t.Errorf("Acquire with the bootstrap token was answered %q before its message", got)
	}

	conn := p.dialAs(addr, "")
	h := healthpb.NewHealthClient(conn)
	if r, err := h.Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Health/Check without a credential: %v %v", r, err)
	}
	w, err := h.Watch(context.Background(), &healthpb.HealthCheckRequest{})
	if err == nil {
		_, err = w.Recv()
	}
	wantCode(t, err, codes.Unauthenticated)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+bootstrap)
	w, err = h.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err == nil {
		_, err = w.Recv()
	}
	if err != nil {
		t.Fatalf("Health/Watch with the bootstrap token: %v", err)
	}
}
