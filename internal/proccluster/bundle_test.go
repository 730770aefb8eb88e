package proccluster

import (
	"context"
	"crypto/tls"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"

	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/internal/testpki"
)

// stateServer serves /debug/state of a leader over TLS with a server certificate of ca, to
// callers with the bearer token.
func stateServer(t *testing.T, ca *testpki.CA, token string) string {
	t.Helper()
	p, err := ca.Server(ClusterName, "node1")
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.X509KeyPair(p.CertPEM, p.KeyPEM)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/debug/state" || r.Header.Get("Authorization") != "Bearer "+token {
			http.Error(w, "no", http.StatusUnauthorized)
			return
		}
		_, _ = w.Write([]byte(`{"id":"node1","is_leader":true}`))
	}))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

// TestHTTPClientTrustsTheWholeCABundle: during a CA rotation (docs/security.md "Rotating the CA
// without downtime") the harness's own HTTP client — State, Leader — is given the old+new CA
// bundle and the token alone (Config.HTTPCredentials) and reaches nodes serving a certificate
// of either CA, while the agents keep the credentials they were started with. It used the
// cluster's credentials only: a node with a new-CA certificate was unknown authority to it.
func TestHTTPClientTrustsTheWholeCABundle(t *testing.T) {
	dir := t.TempDir()
	// The cluster's credentials on CA1 (the agents' --tls-ca), and the CA2 that replaces it.
	ca1, err := testpki.NewCA("ca1")
	if err != nil {
		t.Fatal(err)
	}
	ca2, err := testpki.NewCA("ca2")
	if err != nil {
		t.Fatal(err)
	}
	credDir := filepath.Join(dir, "ca1")
	if err := os.MkdirAll(credDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := ca1.WriteCAPair(filepath.Join(credDir, pkifiles.CAFile), filepath.Join(credDir, pkifiles.CAKeyFile)); err != nil {
		t.Fatal(err)
	}
	creds, err := pkifiles.EnsureLocal(credDir, ClusterName)
	if err != nil {
		t.Fatal(err)
	}
	bundle := filepath.Join(dir, "bundle.pem")
	if err := os.WriteFile(bundle, append(append([]byte(nil), ca1.PEM...), ca2.PEM...), 0o600); err != nil {
		t.Fatal(err)
	}

	probe := *creds
	probe.CAFile, probe.AdminCertFile, probe.AdminKeyFile = bundle, "", ""
	c, err := Start(Config{Binary: fakeAgent(t), Dir: filepath.Join(dir, "cluster"), Nodes: 1, Credentials: creds, HTTPCredentials: &probe})
	if err != nil {
		t.Fatal(err)
	}
	defer c.KillAll()
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		ca   *testpki.CA
	}{{"old CA", ca1}, {"new CA", ca2}} {
		c.Nodes[0].HTTPAddr = stateServer(t, tc.ca, creds.Token)
		if s, err := c.State(ctx, 0); err != nil || !s.IsLeader {
			t.Fatalf("%s: State: %+v, %v", tc.name, s, err)
		}
		if got := c.Leader(ctx); got != 0 {
			t.Fatalf("%s: Leader %d, want 0", tc.name, got)
		}
	}
}
