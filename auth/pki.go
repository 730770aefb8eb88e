package auth

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// A small PKI for a quotad cluster, what `quotad tls ca create` and `quotad tls cert create`
// write (modelled on `consul tls` and `cockroach cert`): one CA per cluster, server
// certificates that carry ServerName(cluster), client certificates that carry a role URI.
// Keys are ECDSA P-256, PEM-encoded PKCS#8.

// Default validities (a CA outlives the certificates it signs).
const (
	DefaultCAValidity   = 5 * 365 * 24 * time.Hour
	DefaultCertValidity = 365 * 24 * time.Hour
)

// clockSkew backdates NotBefore so a certificate made on one machine is valid at once on a
// machine whose clock is slightly behind.
const clockSkew = 5 * time.Minute

// CertOptions describes a certificate for CreateCert.
type CertOptions struct {
	// Server makes a server (node) certificate: DNS SAN ServerName(Cluster) plus DNSNames and
	// IPs, usable both to serve and to dial (nodes dial each other). Otherwise a client
	// certificate carrying ClientRoleURI(Cluster, Identity).
	Server bool
	// Cluster is the cluster name (--cluster-name; "quotad" by default). Required.
	Cluster string
	// Name is the certificate's common name: the node ID or the client's name. Required.
	Name string
	// DNSNames and IPs are the host names and addresses clients dial a server by. When both
	// are empty a server certificate gets "localhost" and 127.0.0.1. Ignored for clients.
	DNSNames []string
	IPs      []net.IP
	// Identity is a client's role, domains (workers) and tenant; Identity.Name is ignored (the
	// common name is Name). Ignored for servers.
	Identity Identity
	// Validity is how long the certificate is valid (0: DefaultCertValidity).
	Validity time.Duration
}

// CreateCA returns a new self-signed CA certificate and its key for cluster.
func CreateCA(cluster string, validity time.Duration) (certPEM, keyPEM []byte, err error) {
	if cluster == "" {
		return nil, nil, errors.New("auth: the cluster name is empty (--cluster-name)")
	}
	if validity == 0 {
		validity = DefaultCAValidity
	}
	if validity < 0 {
		return nil, nil, fmt.Errorf("auth: CA validity %v is negative", validity)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	serial, err := newSerial()
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "quotad CA " + cluster, Organization: []string{"quotad"}},
		NotBefore:             now.Add(-clockSkew),
		NotAfter:              now.Add(validity),
		IsCA:                  true,
		BasicConstraintsValid: true,
		MaxPathLenZero:        true, // signs leaves only
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, fmt.Errorf("auth: creating the CA certificate: %w", err)
	}
	return encodePair(der, key)
}

// CreateCert returns a new certificate and key described by opts, signed by the CA.
func CreateCert(caCertPEM, caKeyPEM []byte, opts CertOptions) (certPEM, keyPEM []byte, err error) {
	ca, caKey, err := parseCA(caCertPEM, caKeyPEM)
	if err != nil {
		return nil, nil, err
	}
	if opts.Cluster == "" {
		return nil, nil, errors.New("auth: the cluster name is empty (--cluster-name)")
	}
	if opts.Name == "" {
		return nil, nil, errors.New("auth: the certificate needs a name (--name)")
	}
	validity := opts.Validity
	if validity == 0 {
		validity = DefaultCertValidity
	}
	if validity < 0 {
		return nil, nil, fmt.Errorf("auth: certificate validity %v is negative", validity)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	serial, err := newSerial()
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	notAfter := now.Add(validity)
	if notAfter.After(ca.NotAfter) {
		notAfter = ca.NotAfter // a leaf valid past its CA would fail verification anyway
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: opts.Name, Organization: []string{"quotad"}},
		NotBefore:    now.Add(-clockSkew),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
	}
	if opts.Server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
		dns, ips := opts.DNSNames, opts.IPs
		if len(dns) == 0 && len(ips) == 0 {
			dns, ips = []string{"localhost"}, []net.IP{net.IPv4(127, 0, 0, 1)}
		}
		tmpl.DNSNames = append([]string{ServerName(opts.Cluster)}, dns...)
		tmpl.IPAddresses = ips
	} else {
		id := opts.Identity
		if _, err := ParseRole(string(id.Role)); err != nil {
			return nil, nil, fmt.Errorf("auth: client certificate %q: %w", opts.Name, err)
		}
		if id.Role == RoleWorker && len(id.Domains) == 0 {
			return nil, nil, fmt.Errorf("auth: client certificate %q: a worker needs at least one domain (--domain, or %q for all)", opts.Name, AnyDomain)
		}
		if id.Role != RoleWorker && (len(id.Domains) > 0 || id.Tenant != "") {
			// Only workers are scoped (MayUseDomain ignores the scope of readers and
			// admins): a scope in the SAN would be a promise nothing keeps.
			return nil, nil, fmt.Errorf("auth: client certificate %q: --domain and --tenant scope workers only; a certificate of role %s may not have them", opts.Name, id.Role)
		}
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
		tmpl.URIs = append(tmpl.URIs, ClientRoleURI(opts.Cluster, id))
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, nil, fmt.Errorf("auth: creating certificate %q: %w", opts.Name, err)
	}
	return encodePair(der, key)
}

// WriteKeyPair writes a certificate (mode 0644) and its key (mode 0600), refusing to replace
// either file if it exists: an operator who overwrote a CA key would lose every certificate
// it signed.
func WriteKeyPair(certPath string, certPEM []byte, keyPath string, keyPEM []byte) error {
	for _, p := range []string{certPath, keyPath} {
		if _, err := os.Lstat(p); err == nil {
			return fmt.Errorf("%s exists; refusing to overwrite it (remove it first or choose another --dir/--name)", p)
		} else if !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	if err := WriteSecretFile(keyPath, keyPEM); err != nil {
		return err
	}
	if err := writeNew(certPath, certPEM, 0o644); err != nil {
		os.Remove(keyPath)
		return err
	}
	return nil
}

// WriteSecretFile writes data to a new file readable only by its owner (0600); it fails if
// path exists.
func WriteSecretFile(path string, data []byte) error { return writeNew(path, data, 0o600) }

func writeNew(path string, data []byte, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		if errors.Is(err, os.ErrExist) {
			return fmt.Errorf("%s exists; refusing to overwrite it", path)
		}
		return err
	}
	_, err = f.Write(data)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
	}
	return err
}

// GossipKeySize is the size of the keys NewGossipKey makes (AES-256).
const GossipKeySize = 32

// NewGossipKey returns a fresh base64-encoded 32-byte gossip encryption key (`quotad keygen`).
func NewGossipKey() (string, error) {
	var k [GossipKeySize]byte
	if _, err := rand.Read(k[:]); err != nil {
		return "", err
	}
	return base64.StdEncoding.EncodeToString(k[:]), nil
}

// DecodeGossipKey reads a base64 gossip key (surrounding white space ignored) and checks its
// size (16, 24 or 32 bytes: AES-128/192/256). It never echoes the key in an error.
func DecodeGossipKey(s string) ([]byte, error) {
	k, err := base64.StdEncoding.DecodeString(strings.TrimSpace(s))
	if err != nil {
		return nil, errors.New("the gossip key is not base64; make one with `quotad keygen`")
	}
	if n := len(k); n != 16 && n != 24 && n != 32 {
		return nil, fmt.Errorf("the gossip key is %d bytes; it must be 16, 24 or 32 (make one with `quotad keygen`)", n)
	}
	return k, nil
}

func newSerial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
}

func encodePair(der []byte, key *ecdsa.PrivateKey) (certPEM, keyPEM []byte, err error) {
	kb, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kb}), nil
}

func parseCA(certPEM, keyPEM []byte) (*x509.Certificate, any, error) {
	cb, _ := pem.Decode(certPEM)
	if cb == nil || cb.Type != "CERTIFICATE" {
		return nil, nil, errors.New("auth: the CA certificate is not a PEM CERTIFICATE")
	}
	ca, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("auth: parsing the CA certificate: %w", err)
	}
	if !ca.IsCA {
		return nil, nil, fmt.Errorf("auth: %q is not a CA certificate", ca.Subject.CommonName)
	}
	kb, _ := pem.Decode(keyPEM)
	if kb == nil {
		return nil, nil, errors.New("auth: the CA key is not PEM")
	}
	var key any
	switch kb.Type {
	case "PRIVATE KEY":
		key, err = x509.ParsePKCS8PrivateKey(kb.Bytes)
	case "EC PRIVATE KEY":
		key, err = x509.ParseECPrivateKey(kb.Bytes)
	default:
		err = fmt.Errorf("unsupported PEM block %q", kb.Type)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("auth: parsing the CA key: %w", err)
	}
	ek, ok := key.(*ecdsa.PrivateKey)
	if !ok || !ek.PublicKey.Equal(ca.PublicKey) {
		return nil, nil, errors.New("auth: the CA key does not belong to the CA certificate")
	}
	return ca, ek, nil
}
