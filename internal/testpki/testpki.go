// Package testpki makes throwaway certificate authorities and certificates for tests: server
// (peer) certificates with the server SAN, client certificates with a role URI, self-signed
// ones and ones from another CA. It is for tests only (short-lived P-256 keys, no revocation);
// the product's own certificate tooling is `quotad tls`.
package testpki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"github.com/quotad/quotad/auth"
)

// CA is a certificate authority held in memory.
type CA struct {
	Cert *x509.Certificate
	Key  *ecdsa.PrivateKey
	PEM  []byte // the CA certificate
}

// Pair is a certificate and its key, PEM-encoded.
type Pair struct {
	CertPEM, KeyPEM []byte
}

// NewCA returns a fresh CA valid for a day.
func NewCA(name string) (*CA, error) {
	tmpl := template(name)
	tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
	tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature
	p, key, err := issue(tmpl, nil, nil)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(mustDER(p.CertPEM))
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key, PEM: p.CertPEM}, nil
}

// Server issues a server (peer) certificate of cluster: DNS SAN auth.ServerName(cluster), IP
// SAN 127.0.0.1, serverAuth and clientAuth usages.
func (ca *CA) Server(cluster, cn string) (Pair, error) {
	tmpl := template(cn)
	tmpl.DNSNames = []string{auth.ServerName(cluster), "localhost"}
	tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1)}
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
	p, _, err := issue(tmpl, ca.Cert, ca.Key)
	return p, err
}

// Client issues a client certificate of cluster carrying id's role URI SAN (clientAuth only).
func (ca *CA) Client(cluster string, id auth.Identity) (Pair, error) {
	tmpl := template(id.Name)
	tmpl.URIs = []*url.URL{auth.ClientRoleURI(cluster, id)}
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	p, _, err := issue(tmpl, ca.Cert, ca.Key)
	return p, err
}

// ClientBothUsages issues a certificate with a client role URI but both serverAuth and
// clientAuth usages: a client certificate that would pass chain verification on either end.
func (ca *CA) ClientBothUsages(cluster string, id auth.Identity) (Pair, error) {
	tmpl := template(id.Name)
	tmpl.URIs = []*url.URL{auth.ClientRoleURI(cluster, id)}
	tmpl.DNSNames = []string{"localhost"}
	tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1)}
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
	p, _, err := issue(tmpl, ca.Cert, ca.Key)
	return p, err
}

// SelfSignedServer returns a self-signed certificate that claims the server SAN of cluster.
func SelfSignedServer(cluster, cn string) (Pair, error) {
	tmpl := template(cn)
	tmpl.DNSNames = []string{auth.ServerName(cluster)}
	tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1)}
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
	tmpl.BasicConstraintsValid = true
	p, _, err := issue(tmpl, nil, nil)
	return p, err
}

// Write writes p to dir/name.pem and dir/name.key and returns the two paths.
func (p Pair) Write(dir, name string) (certFile, keyFile string, err error) {
	certFile, keyFile = filepath.Join(dir, name+".pem"), filepath.Join(dir, name+".key")
	if err := os.WriteFile(certFile, p.CertPEM, 0o600); err != nil {
		return "", "", err
	}
	return certFile, keyFile, os.WriteFile(keyFile, p.KeyPEM, 0o600)
}

// WriteCA writes the CA certificate to dir/name.pem and returns the path.
func (ca *CA) WriteCA(dir, name string) (string, error) {
	f := filepath.Join(dir, name+".pem")
	return f, os.WriteFile(f, ca.PEM, 0o600)
}

func template(cn string) *x509.Certificate {
	serial, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	return &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
	}
}

func issue(tmpl, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (Pair, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return Pair{}, nil, err
	}
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		return Pair{}, nil, fmt.Errorf("testpki: %w", err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return Pair{}, nil, err
	}
	return Pair{
		CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		KeyPEM:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}),
	}, key, nil
}

func mustDER(p []byte) []byte {
	b, _ := pem.Decode(p)
	return b.Bytes
}

// WriteCAPair writes the CA certificate and its key (0600) to certFile and keyFile, as
// `quotad tls ca create` lays them out, so a harness can issue node certificates from it.
func (ca *CA) WriteCAPair(certFile, keyFile string) error {
	kb, err := x509.MarshalECPrivateKey(ca.Key)
	if err != nil {
		return err
	}
	if err := os.WriteFile(certFile, ca.PEM, 0o600); err != nil {
		return err
	}
	return os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600)
}
