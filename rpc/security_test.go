package rpc_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

func TestAdminTokenGuardsChangesEvenWhenForwarded(t *testing.T) {
	c := rpctest.Start(t, 3, testLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.AdminToken = "s3cret" })
	follower := (c.Leader() + 1) % 3
	admin := quotadv1.NewAdminClient(dial(t, c.Addrs()[follower]))
	req := &quotadv1.ApplyLimitsRequest{Yaml: testLimits}
	_, err := admin.ApplyLimits(context.Background(), req)
	if status.Code(err) != codes.Unauthenticated {
		t.Fatalf("apply without token: %v, want Unauthenticated", err)
	}
	bad := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer nope")
	if _, err := admin.ApplyLimits(bad, req); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("apply with a wrong token: %v", err)
	}
	good := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer s3cret")
	resp, err := admin.ApplyLimits(good, req)
	if err != nil || resp.Version != 2 {
		t.Fatalf("apply with the token through a follower: %v %v", resp, err)
	}
	// Reads stay open.
	if _, err := admin.GetLimits(context.Background(), &quotadv1.GetLimitsRequest{}); err != nil {
		t.Fatalf("get limits: %v", err)
	}
}

// writeCert writes a certificate for 127.0.0.1 signed by ca (self-signed if ca is nil).
func writeCert(t *testing.T, dir, name string, ca *x509.Certificate, caKey *ecdsa.PrivateKey) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	parent, signer := tmpl, key
	if ca == nil {
		tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
	} else {
		parent, signer = ca, caKey
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, signer)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(key)
	os.WriteFile(filepath.Join(dir, name+".pem"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600)
	os.WriteFile(filepath.Join(dir, name+".key"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600)
	cert, _ := x509.ParseCertificate(der)
	return cert, key
}

func TestMutualTLS(t *testing.T) {
	dir := t.TempDir()
	ca, caKey := writeCert(t, dir, "ca", nil, nil)
	writeCert(t, dir, "node", ca, caKey)
	writeCert(t, dir, "client", ca, caKey)
	files := rpc.TLSFiles{CertFile: filepath.Join(dir, "node.pem"), KeyFile: filepath.Join(dir, "node.key"), CAFile: filepath.Join(dir, "ca.pem")}
	c := rpctest.Start(t, 3, testLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.TLS = files })
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	follower := c.Addrs()[(c.Leader()+1)%3]

	// Without a client certificate the handshake is refused.
	noCert, err := grpc.NewClient(follower, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool})))
	if err != nil {
		t.Fatal(err)
	}
	defer noCert.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if _, err := acquireOne(ctx, quotadv1.NewQuotaClient(noCert), "t", admission(1, 1, "endpoint=search")); err == nil {
		t.Fatal("a client without a certificate was served")
	}
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, "client.pem"), filepath.Join(dir, "client.key"))
	if err != nil {
		t.Fatal(err)
	}
	withCert, err := grpc.NewClient(follower, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}})))
	if err != nil {
		t.Fatal(err)
	}
	defer withCert.Close()
	// Through a follower: the forwarded hop to the leader is mutual TLS too.
	d, err := acquireOne(context.Background(), quotadv1.NewQuotaClient(withCert), "t", admission(2, 1, "endpoint=search"))
	if err != nil || !d.Admitted {
		t.Fatalf("mTLS acquire through a follower: %+v %v", d, err)
	}
}
