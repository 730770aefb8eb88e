package auth

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func parseCert(t *testing.T, p []byte) *x509.Certificate {
	t.Helper()
	b, _ := pem.Decode(p)
	if b == nil {
		t.Fatalf("not PEM: %q", p)
	}
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func testCA(t *testing.T) (certPEM, keyPEM []byte, pool *x509.CertPool) {
	t.Helper()
	certPEM, keyPEM, err := CreateCA("prod", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	pool = x509.NewCertPool()
	if !pool.AppendCertsFromPEM(certPEM) {
		t.Fatal("CA PEM not accepted")
	}
	return certPEM, keyPEM, pool
}

func TestServerCertCarriesServerSANAndBothUsages(t *testing.T) {
	caPEM, caKey, pool := testCA(t)
	certPEM, keyPEM, err := CreateCert(caPEM, caKey, CertOptions{Server: true, Cluster: "prod", Name: "node1"})
	if err != nil {
		t.Fatal(err)
	}
	c := parseCert(t, certPEM)
	if !IsServerCert(c, "prod") || IsServerCert(c, "other") {
		t.Fatalf("DNS SANs %v: want %s only for cluster prod", c.DNSNames, ServerName("prod"))
	}
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
		if _, err := c.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
			t.Fatalf("usage %v: %v", usage, err)
		}
	}
	// Defaults: reachable as localhost and 127.0.0.1.
	for _, h := range []string{"localhost", "127.0.0.1", ServerName("prod")} {
		if err := c.VerifyHostname(h); err != nil {
			t.Errorf("%s: %v", h, err)
		}
	}
	id, err := IdentityFromCert(c, "prod")
	if err != nil || id.Role != RoleServer || id.Name != "server:node1" {
		t.Fatalf("identity %+v %v", id, err)
	}
	if _, err := tls.X509KeyPair(certPEM, keyPEM); err != nil {
		t.Fatalf("key pair: %v", err)
	}
	if c.NotAfter.After(time.Now().Add(time.Hour)) {
		t.Fatalf("leaf valid until %v, past its CA", c.NotAfter)
	}

	// Explicit names replace the defaults (the server SAN stays).
	certPEM, _, err = CreateCert(caPEM, caKey, CertOptions{Server: true, Cluster: "prod", Name: "n2",
		DNSNames: []string{"n2.example"}, IPs: []net.IP{net.ParseIP("10.0.0.2")}})
	if err != nil {
		t.Fatal(err)
	}
	c = parseCert(t, certPEM)
	if !slices.Equal(c.DNSNames, []string{ServerName("prod"), "n2.example"}) || c.VerifyHostname("10.0.0.2") != nil || c.VerifyHostname("127.0.0.1") == nil {
		t.Fatalf("DNS %v IPs %v", c.DNSNames, c.IPAddresses)
	}
}

func TestClientCertCarriesRoleAndClientUsageOnly(t *testing.T) {
	caPEM, caKey, pool := testCA(t)
	want := Identity{Role: RoleWorker, Domains: []string{"provider", "platform"}, Tenant: "acme"}
	certPEM, _, err := CreateCert(caPEM, caKey, CertOptions{Cluster: "prod", Name: "alice", Identity: want})
	if err != nil {
		t.Fatal(err)
	}
	c := parseCert(t, certPEM)
	if IsServerCert(c, "prod") || len(c.DNSNames) != 0 || len(c.IPAddresses) != 0 {
		t.Fatalf("a client certificate with host names: %v %v", c.DNSNames, c.IPAddresses)
	}
	if _, err := c.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err == nil {
		t.Fatal("a client certificate verifies for server authentication")
	}
	id, err := IdentityFromCert(c, "prod")
	if err != nil || id.Name != "cert:alice" || id.Role != RoleWorker || !slices.Equal(id.Domains, want.Domains) || id.Tenant != "acme" {
		t.Fatalf("identity %+v %v", id, err)
	}
	if _, err := IdentityFromCert(c, "other"); !errors.Is(err, ErrNoRole) {
		t.Fatalf("another cluster's role accepted: %v", err)
	}
}

func TestCreateCertRejectsBadInput(t *testing.T) {
	caPEM, caKey, _ := testCA(t)
	otherPEM, otherKey, _ := testCA(t)
	for name, tc := range map[string]struct {
		ca, key []byte
		opts    CertOptions
		want    string
	}{
		"no role":             {caPEM, caKey, CertOptions{Cluster: "prod", Name: "a"}, "role"},
		"server role":         {caPEM, caKey, CertOptions{Cluster: "prod", Name: "a", Identity: Identity{Role: RoleServer}}, "role"},
		"worker no domain":    {caPEM, caKey, CertOptions{Cluster: "prod", Name: "a", Identity: Identity{Role: RoleWorker}}, "domain"},
		"reader with domain":  {caPEM, caKey, CertOptions{Cluster: "prod", Name: "a", Identity: Identity{Role: RoleReader, Domains: []string{"provider"}}}, "scope workers only"},
		"admin with tenant":   {caPEM, caKey, CertOptions{Cluster: "prod", Name: "a", Identity: Identity{Role: RoleAdmin, Tenant: "acme"}}, "scope workers only"},
		"no name":             {caPEM, caKey, CertOptions{Server: true, Cluster: "prod"}, "--name"},
		"no cluster":          {caPEM, caKey, CertOptions{Server: true, Name: "n"}, "cluster"},
		"key of another CA":   {caPEM, otherKey, CertOptions{Server: true, Cluster: "prod", Name: "n"}, "does not belong"},
		"leaf as CA":          {mustLeaf(t, otherPEM, otherKey), otherKey, CertOptions{Server: true, Cluster: "prod", Name: "n"}, "not a CA"},
		"garbage certificate": {[]byte("x"), caKey, CertOptions{Server: true, Cluster: "prod", Name: "n"}, "PEM"},
	} {
		if _, _, err := CreateCert(tc.ca, tc.key, tc.opts); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error mentioning %q", name, err, tc.want)
		}
	}
}

func mustLeaf(t *testing.T, caPEM, caKey []byte) []byte {
	c, _, err := CreateCert(caPEM, caKey, CertOptions{Server: true, Cluster: "prod", Name: "leaf"})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestMutualTLSHandshake: a real TLS connection on loopback between a server certificate
// and a client certificate of the same CA, each verifying the other; a certificate of another
// CA is refused.
func TestMutualTLSHandshake(t *testing.T) {
	caPEM, caKey, pool := testCA(t)
	sc, sk, _ := CreateCert(caPEM, caKey, CertOptions{Server: true, Cluster: "prod", Name: "node1"})
	cc, ck, _ := CreateCert(caPEM, caKey, CertOptions{Cluster: "prod", Name: "admin", Identity: Identity{Role: RoleAdmin}})
	serverPair, err := tls.X509KeyPair(sc, sk)
	if err != nil {
		t.Fatal(err)
	}
	clientPair, err := tls.X509KeyPair(cc, ck)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{serverPair},
		ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	peers := make(chan string, 4)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			tc := conn.(*tls.Conn)
			if err := tc.Handshake(); err != nil {
				peers <- "refused"
			} else {
				peers <- tc.ConnectionState().PeerCertificates[0].Subject.CommonName
			}
			io.WriteString(tc, "x")
			tc.Close()
		}
	}()
	dial := func(cert tls.Certificate) error {
		conn, err := tls.Dial("tcp", ln.Addr().String(), &tls.Config{RootCAs: pool, ServerName: ServerName("prod"),
			Certificates: []tls.Certificate{cert}})
		if err != nil {
			return err
		}
		defer conn.Close()
		_, err = conn.Read(make([]byte, 1))
		return err
	}
	if err := dial(clientPair); err != nil {
		t.Fatal(err)
	}
	if got := <-peers; got != "admin" {
		t.Fatalf("server saw %q", got)
	}
	otherCA, otherKey, _ := testCA(t)
	oc, ok, _ := CreateCert(otherCA, otherKey, CertOptions{Cluster: "prod", Name: "mallory", Identity: Identity{Role: RoleAdmin}})
	otherPair, _ := tls.X509KeyPair(oc, ok)
	if err := dial(otherPair); err == nil {
		t.Fatal("a certificate of another CA was accepted")
	}
	if got := <-peers; got != "refused" {
		t.Fatalf("server saw %q, want refused", got)
	}
}

func TestWriteKeyPairModesAndNoOverwrite(t *testing.T) {
	dir := t.TempDir()
	caPEM, caKey, err := CreateCA("quotad", 0)
	if err != nil {
		t.Fatal(err)
	}
	cp, kp := filepath.Join(dir, "sub", "ca.pem"), filepath.Join(dir, "sub", "ca-key.pem")
	if err := WriteKeyPair(cp, caPEM, kp, caKey); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]os.FileMode{cp: 0o644, kp: 0o600} {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm()&^want != 0 {
			t.Errorf("%s: mode %v, want at most %v", p, st.Mode().Perm(), want)
		}
	}
	other, otherKey, _ := CreateCA("quotad", 0)
	if err := WriteKeyPair(cp, other, kp, otherKey); err == nil || !strings.Contains(err.Error(), "refusing to overwrite") {
		t.Fatalf("overwrite: %v", err)
	}
	if got, _ := os.ReadFile(kp); string(got) != string(caKey) {
		t.Fatal("the CA key was replaced")
	}
	// Only the key exists: still refused, and the certificate is not written either.
	os.Remove(cp)
	if err := WriteKeyPair(cp, other, kp, otherKey); err == nil {
		t.Fatal("overwrote an existing key")
	}
	if _, err := os.Stat(cp); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("wrote a certificate next to a key it does not belong to")
	}
}

func TestGossipKey(t *testing.T) {
	k, err := NewGossipKey()
	if err != nil {
		t.Fatal(err)
	}
	b, err := DecodeGossipKey(" " + k + "\n")
	if err != nil || len(b) != 32 {
		t.Fatalf("%d bytes, %v", len(b), err)
	}
	if k2, _ := NewGossipKey(); k2 == k {
		t.Fatal("two equal keys")
	}
	if _, err := DecodeGossipKey("not base64!"); err == nil || strings.Contains(err.Error(), "not base64!") {
		t.Fatalf("bad key: %v (must not echo it)", err)
	}
	if _, err := DecodeGossipKey("AAAA"); err == nil || !strings.Contains(err.Error(), "3 bytes") {
		t.Fatalf("short key: %v", err)
	}
}
