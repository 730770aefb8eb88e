package auth_test

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/internal/testpki"
)

const cluster = "quotad"

type pkiFixture struct {
	ca, otherCA *testpki.CA
	dir, caFile string
}

func newFixture(t *testing.T) *pkiFixture {
	t.Helper()
	ca, err := testpki.NewCA("test CA")
	if err != nil {
		t.Fatal(err)
	}
	other, err := testpki.NewCA("other CA")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	caFile, err := ca.WriteCA(dir, "ca")
	if err != nil {
		t.Fatal(err)
	}
	return &pkiFixture{ca: ca, otherCA: other, dir: dir, caFile: caFile}
}

// peerConfig is PeerTLSConfig for a fresh server certificate of the fixture's CA.
func (f *pkiFixture) peerConfig(t *testing.T, name string) *tls.Config {
	t.Helper()
	p, err := f.ca.Server(cluster, name)
	if err != nil {
		t.Fatal(err)
	}
	cert, key, err := p.Write(f.dir, name)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := auth.PeerTLSConfig(cert, key, f.caFile, cluster)
	if err != nil {
		t.Fatalf("PeerTLSConfig(%s): %v", name, err)
	}
	return cfg
}

// plainConfig presents p (if any) and trusts the fixture's CA, with no quotad rules.
func (f *pkiFixture) plainConfig(t *testing.T, p *testpki.Pair) *tls.Config {
	t.Helper()
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(f.ca.PEM)
	cfg := &tls.Config{RootCAs: pool, ClientCAs: pool, ClientAuth: tls.RequestClientCert, InsecureSkipVerify: true}
	if p != nil {
		c, err := tls.X509KeyPair(p.CertPEM, p.KeyPEM)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Certificates = []tls.Certificate{c}
		// Send it whatever CAs the listener asks for (an attacker would).
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &c, nil }
	}
	return cfg
}

// handshake runs a TLS handshake between a server and a client config over a pipe and returns
// both sides' errors.
func handshake(server, client *tls.Config) (serverErr, clientErr error) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	deadline := time.Now().Add(5 * time.Second)
	a.SetDeadline(deadline)
	b.SetDeadline(deadline)
	s, c := tls.Server(a, server), tls.Client(b, client)
	done := make(chan error, 1)
	go func() {
		err := s.Handshake()
		if err != nil {
			a.Close() // unblock the client
		}
		done <- err
	}()
	clientErr = c.Handshake()
	if clientErr == nil {
		// TLS 1.3: the client finishes before the server checked its certificate; a read
		// surfaces the server's verdict.
		b.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		var ne net.Error
		if err != nil && !(errors.As(err, &ne) && ne.Timeout()) {
			clientErr = err
		}
	} else {
		b.Close()
	}
	serverErr = <-done
	return serverErr, clientErr
}

func TestPeerTLSAcceptsOnlyServerCertificates(t *testing.T) {
	f := newFixture(t)
	node := f.peerConfig(t, "node1")
	peer := f.peerConfig(t, "node2")

	if sErr, cErr := handshake(node, peer); sErr != nil || cErr != nil {
		t.Fatalf("two server certificates of one CA: server %v, client %v", sErr, cErr)
	}

	worker, err := f.ca.Client(cluster, auth.Identity{Name: "w", Role: auth.RoleWorker, Domains: []string{"d"}})
	if err != nil {
		t.Fatal(err)
	}
	admin, err := f.ca.ClientBothUsages(cluster, auth.Identity{Name: "root", Role: auth.RoleAdmin})
	if err != nil {
		t.Fatal(err)
	}
	selfSigned, err := testpki.SelfSignedServer(cluster, "intruder")
	if err != nil {
		t.Fatal(err)
	}
	foreign, err := f.otherCA.Server(cluster, "foreign")
	if err != nil {
		t.Fatal(err)
	}
	otherCluster, err := f.ca.Server("staging", "staging-node")
	if err != nil {
		t.Fatal(err)
	}
	dialers := []struct {
		name string
		cert *testpki.Pair
	}{
		{"no certificate", nil},
		{"worker client certificate of the same CA", &worker},
		{"admin client certificate with serverAuth usage", &admin},
		{"self-signed certificate with the server SAN", &selfSigned},
		{"server certificate of another CA", &foreign},
		{"server certificate of another cluster", &otherCluster},
	}
	for _, d := range dialers {
		t.Run("accept/"+d.name, func(t *testing.T) {
			sErr, _ := handshake(node, f.plainConfig(t, d.cert))
			t.Logf("refused: %v", sErr)
			if sErr == nil {
				t.Fatal("the Raft listener completed a handshake")
			}
		})
	}
	// Dialing: a listener presenting anything but a server certificate of this cluster's CA
	// is refused by the dialing node.
	for _, d := range dialers[1:] {
		t.Run("dial/"+d.name, func(t *testing.T) {
			_, cErr := handshake(f.plainConfig(t, d.cert), peer)
			t.Logf("refused: %v", cErr)
			if cErr == nil {
				t.Fatal("a node dialed a peer that is not a server of its cluster")
			}
		})
	}
}

func TestPeerTLSConfigErrorsNameTheProblem(t *testing.T) {
	f := newFixture(t)
	worker, _ := f.ca.Client(cluster, auth.Identity{Name: "w", Role: auth.RoleWorker, Domains: []string{"d"}})
	wCert, wKey, _ := worker.Write(f.dir, "worker")
	foreign, _ := f.otherCA.Server(cluster, "foreign")
	fCert, fKey, _ := foreign.Write(f.dir, "foreign")
	good, _ := f.ca.Server(cluster, "node")
	gCert, gKey, _ := good.Write(f.dir, "node")
	missing := filepath.Join(f.dir, "nope.pem")

	cases := []struct {
		name                  string
		cert, key, ca, clustr string
		want                  []string
	}{
		{"no files", "", "", "", cluster, []string{"--tls-cert", "quotad tls ca create", "quotad tls cert create --server"}},
		{"missing cert", missing, gKey, f.caFile, cluster, []string{"nope.pem"}},
		{"client cert as node cert", wCert, wKey, f.caFile, cluster, []string{"server SAN", "server.quotad.quotad", "worker.pem"}},
		{"cert of another CA", fCert, fKey, f.caFile, cluster, []string{"does not verify against the CA", "foreign.pem", "ca.pem"}},
		{"no cluster name", gCert, gKey, f.caFile, "", []string{"--cluster-name"}},
		{"wrong cluster", gCert, gKey, f.caFile, "prod", []string{"server.prod.quotad"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := auth.PeerTLSConfig(c.cert, c.key, c.ca, c.clustr)
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}
