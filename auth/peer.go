package auth

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
)

// ErrNotServer: a peer on the Raft port presented a certificate that chains to the cluster's
// CA but does not carry the server role (a client certificate, or another cluster's server).
var ErrNotServer = errors.New("auth: peer certificate does not carry the server role")

// PeerTLSConfig builds the one TLS configuration a node uses to both accept and dial Raft
// connections (peers are symmetric: every node is server and client there). It presents
// the node certificate (certFile, keyFile), requires and verifies the other side's
// certificate against the CA in caFile in both directions, verifies the dialed peer's name
// as ServerName(cluster), and refuses any peer whose verified leaf lacks the server SAN: a
// client certificate from the same CA, a self-signed certificate, or no certificate never
// completes the handshake.
//
// Server certificates therefore need both the serverAuth and the clientAuth extended key
// usage and the DNS SAN ServerName(cluster) (`quotad tls cert create --server`). The node's
// own certificate is checked against the CA and for the SAN here, so a wrong file is a
// startup error naming it rather than a cluster whose nodes refuse each other.
func PeerTLSConfig(certFile, keyFile, caFile, cluster string) (*tls.Config, error) {
	if certFile == "" || keyFile == "" || caFile == "" {
		return nil, fmt.Errorf("auth: peer TLS needs a server certificate (--tls-cert %q), its key (--tls-key %q) and the cluster CA (--tls-ca %q); make them with `quotad tls ca create` and `quotad tls cert create --server`",
			certFile, keyFile, caFile)
	}
	certPEM, err := os.ReadFile(certFile)
	if err != nil {
		return nil, fmt.Errorf("auth: reading the server certificate: %w", err)
	}
	keyPEM, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, fmt.Errorf("auth: reading the server key: %w", err)
	}
	caPEM, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("auth: reading the CA: %w", err)
	}
	cfg, err := PeerTLSConfigFromPEM(certPEM, keyPEM, caPEM, cluster)
	if err != nil {
		return nil, fmt.Errorf("%w (certificate %q, key %q, CA %q)", err, certFile, keyFile, caFile)
	}
	return cfg, nil
}

// PeerTLSConfigFromPEM is PeerTLSConfig from PEM bytes already in memory.
func PeerTLSConfigFromPEM(certPEM, keyPEM, caPEM []byte, cluster string) (*tls.Config, error) {
	if cluster == "" {
		return nil, errors.New("auth: peer TLS needs a cluster name (--cluster-name)")
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("auth: the server certificate and key do not load: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, errors.New("auth: the CA file holds no PEM certificate")
	}
	leaf, err := x509.ParseCertificate(cert.Certificate[0])
	if err != nil {
		return nil, fmt.Errorf("auth: parsing the server certificate: %w", err)
	}
	name := ServerName(cluster)
	if !IsServerCert(leaf, cluster) {
		return nil, fmt.Errorf("auth: the certificate (subject %q) does not carry the server SAN %q of cluster %q; make one with `quotad tls cert create --server --cluster-name %s`",
			leaf.Subject.CommonName, name, cluster, cluster)
	}
	intermediates := x509.NewCertPool()
	for _, der := range cert.Certificate[1:] {
		if c, err := x509.ParseCertificate(der); err == nil {
			intermediates.AddCert(c)
		}
	}
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, Intermediates: intermediates, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
			return nil, fmt.Errorf("auth: the server certificate (subject %q) does not verify against the CA for %s (peers both dial and accept with it): %w",
				leaf.Subject.CommonName, usageName(usage), err)
		}
	}
	return &tls.Config{
		Certificates: []tls.Certificate{cert},
		MinVersion:   tls.VersionTLS13,
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    pool,
		RootCAs:      pool,
		ServerName:   name,
		// Runs after chain verification on both ends (and, dialing, after the name check).
		VerifyConnection: func(cs tls.ConnectionState) error { return verifyPeer(cs, cluster) },
	}, nil
}

// verifyPeer refuses a handshake unless the peer's verified leaf carries the server SAN.
func verifyPeer(cs tls.ConnectionState, cluster string) error {
	if len(cs.VerifiedChains) == 0 || len(cs.PeerCertificates) == 0 {
		return fmt.Errorf("%w: no verified certificate", ErrNotServer)
	}
	leaf := cs.PeerCertificates[0]
	if !IsServerCert(leaf, cluster) {
		return fmt.Errorf("%w: subject %q has no DNS SAN %q", ErrNotServer, leaf.Subject.CommonName, ServerName(cluster))
	}
	return nil
}

func usageName(u x509.ExtKeyUsage) string {
	if u == x509.ExtKeyUsageServerAuth {
		return "serverAuth"
	}
	return "clientAuth"
}
