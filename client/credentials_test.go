package client

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/rpc/rpctest"
)

func TestCredentialsValidate(t *testing.T) {
	for name, tc := range map[string]struct {
		cfg  Config
		want string // "" = valid
	}{
		"token without TLS":           {Config{Addrs: []string{"a:1"}, Token: "t"}, "only sent over TLS"},
		"token file without TLS":      {Config{Addrs: []string{"a:1"}, TokenFile: "f"}, "QUOTAD_CACERT"},
		"token over plaintext, said":  {Config{Addrs: []string{"a:1"}, Token: "t", Insecure: true}, ""},
		"token with a CA":             {Config{Addrs: []string{"a:1"}, Token: "t", TLSFiles: TLSFiles{CAFile: "ca.pem"}}, ""},
		"token with a tls.Config":     {Config{Addrs: []string{"a:1"}, Token: "t", TLS: &tls.Config{}}, ""},
		"both TLS and TLSFiles":       {Config{Addrs: []string{"a:1"}, TLS: &tls.Config{}, TLSFiles: TLSFiles{CAFile: "x"}}, "both TLS and TLSFiles"},
		"both Token and TokenFile":    {Config{Addrs: []string{"a:1"}, Token: "t", TokenFile: "f", Insecure: true}, "both Token and TokenFile"},
		"plaintext without a token":   {Config{Addrs: []string{"a:1"}}, ""},
		"client certificate, no key?": {Config{Addrs: []string{"a:1"}, TLSFiles: TLSFiles{CertFile: "c.pem"}}, ""}, // caught at load
	} {
		err := tc.cfg.Validate()
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%s: %v, want %q", name, err, tc.want)
		}
	}
	if _, err := New(Config{Addrs: []string{"a:1"}, TLSFiles: TLSFiles{CertFile: "c.pem"}}); err == nil || !strings.Contains(err.Error(), "both a certificate") {
		t.Errorf("a certificate without a key: %v", err)
	}
	if _, err := New(Config{Addrs: []string{"a:1"}, TokenFile: filepath.Join(t.TempDir(), "none"), Insecure: true}); err == nil || !strings.Contains(err.Error(), "token file") {
		t.Errorf("a missing token file: %v", err)
	}
}

func TestLoadEnvFillsOnlyWhatIsEmpty(t *testing.T) {
	t.Setenv(EnvAddr, "10.0.0.1:7101, 10.0.0.2:7101")
	t.Setenv(EnvToken, "qd_env")
	t.Setenv(EnvCACert, "/env/ca.pem")
	t.Setenv(EnvClientCert, "/env/c.pem")
	t.Setenv(EnvClientKey, "/env/k.pem")
	var cfg Config
	cfg.LoadEnv()
	if !slices.Equal(cfg.Addrs, []string{"10.0.0.1:7101", "10.0.0.2:7101"}) || cfg.Token != "qd_env" ||
		cfg.TLSFiles != (TLSFiles{CAFile: "/env/ca.pem", CertFile: "/env/c.pem", KeyFile: "/env/k.pem"}) {
		t.Fatalf("from env: %+v", cfg)
	}
	// Flags first: -addrs and -token-file win over the environment.
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	conn := Flags(fs, "127.0.0.1:7101")
	if err := fs.Parse([]string{"-addrs", "h:1", "-token-file", "/flag/token", "-cacert", "/flag/ca.pem"}); err != nil {
		t.Fatal(err)
	}
	cfg = conn()
	if !slices.Equal(cfg.Addrs, []string{"h:1"}) || cfg.TokenFile != "/flag/token" || cfg.Token != "" ||
		cfg.TLSFiles.CAFile != "/flag/ca.pem" || cfg.TLSFiles.CertFile != "/env/c.pem" {
		t.Fatalf("flags over env: %+v", cfg)
	}
	os.Unsetenv(EnvAddr)
	fs = flag.NewFlagSet("y", flag.ContinueOnError)
	conn = Flags(fs, "127.0.0.1:7101")
	_ = fs.Parse(nil)
	if got := conn().Addrs; !slices.Equal(got, []string{"127.0.0.1:7101"}) {
		t.Fatalf("default addrs: %v", got)
	}
}

// TestClientAgainstSecureCluster: the client verifies the nodes with the CA, presents a
// client certificate and sends its token; without the CA it gets no decision.
func TestClientAgainstSecureCluster(t *testing.T) {
	creds, err := pkifiles.EnsureLocal(filepath.Join(t.TempDir(), "creds"), "quotad")
	if err != nil {
		t.Fatal(err)
	}
	c := rpctest.Start(t, 3, testLimits, rpctest.Secure(t, creds))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	tokenFile := creds.TokenFile
	qc := newTestClient(t, c.Addrs(), func(cfg *Config) {
		cfg.TLSFiles = TLSFiles{CAFile: creds.CAFile, CertFile: creds.AdminCertFile, KeyFile: creds.AdminKeyFile}
		cfg.TokenFile = tokenFile
	})
	if _, err := qc.Allow(ctx, Request{Domain: "fixed"}); err != nil {
		t.Fatalf("allow over mutual TLS: %v", err)
	}

	// The token really travels: the admin call that needs it passes with DialCredentials.
	cfg := Config{Addrs: c.Addrs(), TLSFiles: TLSFiles{CAFile: creds.CAFile}, TokenFile: tokenFile}
	opts, err := cfg.DialCredentials()
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(c.Addrs()[0], opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	limits, err := quotadv1.NewAdminClient(cc).GetLimits(ctx, &quotadv1.GetLimitsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := quotadv1.NewAdminClient(cc).ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: limits.Yaml}); err != nil {
		t.Fatalf("apply limits with the bootstrap token: %v", err)
	}
	noToken, _ := Config{TLSFiles: TLSFiles{CAFile: creds.CAFile}}.DialCredentials()
	cc2, err := grpc.NewClient(c.Addrs()[0], noToken...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc2.Close()
	if _, err := quotadv1.NewAdminClient(cc2).ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: limits.Yaml}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("apply limits without a token: %v, want Unauthenticated", err)
	}

	// Plaintext against TLS: no decision, and the error says why (user trial: the batched
	// path said only "no decision after 1 attempts: context deadline exceeded").
	for _, disabled := range []bool{false, true} {
		plain := newTestClient(t, c.Addrs(), func(cfg *Config) { cfg.Batch.Disabled = disabled })
		sctx, scancel := context.WithTimeout(ctx, time.Second)
		_, err := plain.Allow(sctx, Request{Domain: "fixed"})
		scancel()
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("batching disabled=%v: plaintext client against a secure cluster: %v", disabled, err)
		}
		for _, want := range []string{"server preface", "answered a TLS handshake", "speaks TLS", EnvCACert} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("batching disabled=%v: %q does not say %q", disabled, err, want)
			}
		}
	}

	// A node's HTTP port given as its gRPC address: TLS answers, gRPC does not, and the
	// error says which port to use (user trial: only "missing selected ALPN property").
	viaHTTP := newTestClient(t, []string{c.Agent(0).HTTPAddr()}, func(cfg *Config) {
		cfg.TLSFiles = TLSFiles{CAFile: creds.CAFile}
		cfg.TokenFile = tokenFile
	})
	hctx, hcancel := context.WithTimeout(ctx, time.Second)
	_, err = viaHTTP.Allow(hctx, Request{Domain: "fixed"})
	hcancel()
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "HTTP port") || !strings.Contains(err.Error(), "--grpc-addr") {
		t.Errorf("a client dialing the HTTP port: %v; want a hint naming the HTTP and gRPC ports", err)
	}
}

// TestPrefaceErrorWithoutTLSNoHint: a plaintext node that drops connections before its HTTP/2
// preface (killed or restarting after accepting) gives the same "error reading server
// preface" a TLS node gives a plaintext client; the error must not then say "set TLSFiles"
// (it did: user report). The listener is a real socket that accepts and closes, which is all
// the client sees of such a node.
func TestPrefaceErrorWithoutTLSNoHint(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			// Take what the client sends (its preface and settings), then close without a
			// word, as a process dying after the accept would.
			go func() {
				conn.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
				io.Copy(io.Discard, conn)
				conn.Close()
			}()
		}
	}()
	for _, disabled := range []bool{false, true} {
		c := newTestClient(t, []string{ln.Addr().String()}, func(cfg *Config) { cfg.Batch.Disabled = disabled })
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := c.Allow(ctx, Request{Domain: "fixed"})
		cancel()
		if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "server preface") {
			t.Fatalf("batching disabled=%v: %v, want ErrUnavailable from a connection closed before the preface", disabled, err)
		}
		if strings.Contains(err.Error(), "TLS") {
			t.Errorf("batching disabled=%v: a dropped plaintext connection is explained as TLS: %v", disabled, err)
		}
	}
}

// $QUOTAD_CONFIGURED_ADDRS_ONLY sets Config.ConfiguredAddrsOnly (LoadEnv, Flags), the flag
// wins over it either way, and a value that is not a boolean stops New naming it.
func TestConfiguredAddrsOnlyFromEnvAndFlag(t *testing.T) {
	t.Setenv(EnvConfiguredAddrsOnly, "true")
	cfg := Config{Addrs: []string{"127.0.0.1:7101"}}
	cfg.LoadEnv()
	if !cfg.ConfiguredAddrsOnly {
		t.Fatalf("$%s=true: ConfiguredAddrsOnly false", EnvConfiguredAddrsOnly)
	}
	for _, tc := range []struct {
		env  string
		args []string
		want bool
	}{
		{"1", nil, true},
		{"false", nil, false},
		{"", []string{"-configured-addrs-only"}, true},
		{"true", []string{"-configured-addrs-only=false"}, false},
		{"bogus", []string{"-configured-addrs-only"}, true}, // the flag decides; the env is not read
	} {
		t.Setenv(EnvConfiguredAddrsOnly, tc.env)
		fs := flag.NewFlagSet("x", flag.ContinueOnError)
		conn := Flags(fs, "127.0.0.1:7101")
		if err := fs.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		cfg := conn()
		if cfg.ConfiguredAddrsOnly != tc.want || cfg.Validate() != nil {
			t.Errorf("$%s=%q %v: ConfiguredAddrsOnly %v (validate: %v), want %v", EnvConfiguredAddrsOnly, tc.env, tc.args, cfg.ConfiguredAddrsOnly, cfg.Validate(), tc.want)
		}
	}
	t.Setenv(EnvConfiguredAddrsOnly, "yes please")
	cfg = Config{Addrs: []string{"127.0.0.1:7101"}}
	cfg.LoadEnv()
	if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), `$QUOTAD_CONFIGURED_ADDRS_ONLY is "yes please"`) ||
		!strings.Contains(err.Error(), "true or false") {
		t.Fatalf("New with $%s=%q: %v, want an error naming the value", EnvConfiguredAddrsOnly, "yes please", err)
	}
}

// TestTLSProbeDoesNotDelayTheCall: the TLS probe a plaintext client sends after "error reading
// server preface" runs beside the call, not in it. A node that dropped one connection and
// then accepts without answering (a process whose listener is open before it serves: quotad
// opens it before it replays its log) held the call's failover to the next node for the
// probe's whole timeout, 1 s (review s11-review).
func TestTLSProbeDoesNotDelayTheCall(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan struct{})
	defer close(done)
	go func() {
		for first := true; ; first = false {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func(first bool) {
				defer conn.Close()
				if first { // take the preface, then close without a word
					conn.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
					io.Copy(io.Discard, conn)
					return
				}
				<-done // accepted, never answered
			}(first)
		}
	}()
	tc := rpctest.Start(t, 1, testLimits)
	bad := ln.Addr().String()
	c := newTestClient(t, []string{bad, tc.Addrs()[0]}, func(cfg *Config) { cfg.Batch.Disabled = true })
	c.nodes.mu.Lock()
	c.nodes.cur = slices.Index(c.nodes.order, bad)
	c.nodes.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	if _, err := c.Allow(ctx, Request{Domain: "fixed"}); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > 500*time.Millisecond {
		t.Fatalf("Allow took %v with the first node dropping its connection; want the next node asked at once, not after the TLS probe", took)
	}
}
