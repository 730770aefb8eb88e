package client

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/rpc/rpctest"
)

// TestLimiterRevokedCertFailsClosed: as with a revoked token, a Limiter whose client
// certificate is revoked (quotad tls cert revoke) on its open connection decides on the
// grant in hand until it ends, then admits nothing: its renewals are refused UNAUTHENTICATED.
func TestLimiterRevokedCertFailsClosed(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "creds")
	creds, err := pkifiles.EnsureLocal(dir, "quotad")
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile, err := pkifiles.CreateCert(dir, creds.CAFile, filepath.Join(dir, pkifiles.CAKeyFile), auth.CertOptions{Cluster: "quotad", Name: "worker",
		Identity: auth.Identity{Role: auth.RoleWorker, Domains: []string{"api"}}})
	if err != nil {
		t.Fatal(err)
	}
	c := rpctest.Start(t, 3, revokeShareLimits, rpctest.Secure(t, creds))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	adminCfg := Config{Addrs: c.Addrs(), TLSFiles: TLSFiles{CAFile: creds.CAFile}, TokenFile: creds.TokenFile}
	opts, err := adminCfg.DialCredentials()
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(c.Addrs()[0], opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()

	qc := newTestClient(t, c.Addrs(), func(cfg *Config) {
		cfg.TLSFiles = TLSFiles{CAFile: creds.CAFile, CertFile: certFile, KeyFile: keyFile}
	})
	lim := qc.Limiter(Request{Domain: "api"}, LimiterOptions{})
	defer lim.Close()
	for deadline := time.Now().Add(10 * time.Second); !lim.Share().Local; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no local share: %+v", lim.Share())
		}
		lim.Allow()
	}
	pem, err := os.ReadFile(certFile)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := quotadv1.NewAdminClient(cc).RevokeCert(ctx, &quotadv1.RevokeCertRequest{CertPem: pem}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(6 * time.Second)
	for lim.Share().Local && time.Now().Before(deadline) {
		lim.Allow()
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	admitted := 0
	for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		if lim.Allow() {
			admitted++
		}
	}
	if s := lim.Share(); admitted > 0 || s.Local || !strings.Contains(s.Message, "refused its renewal") || !strings.Contains(s.Message, "revoked") {
		t.Fatalf("after the revoke and the grant's end: admitted %d in 1 s, share %+v; want 0 and a message saying the renewal was refused (revoked)", admitted, s)
	}
}
