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
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// pki is a test CA and the certificates it issued, as PEM files in dir.
type pki struct {
	t     *testing.T
	dir   string
	ca    *x509.Certificate
	caKey *ecdsa.PrivateKey
	pool  *x509.CertPool
}

func newPKI(t *testing.T) *pki {
	p := &pki{t: t, dir: t.TempDir()}
	p.ca, p.caKey = p.issue("ca", nil, nil, false)
	p.pool = x509.NewCertPool()
	p.pool.AddCert(p.ca)
	return p
}

// issue writes name.pem and name.key: the CA when p has none yet, else a leaf for 127.0.0.1
// with the given DNS and URI SANs signed by the CA (self-signed with selfSigned).
func (p *pki) issue(name string, dns []string, uris []*url.URL, selfSigned bool) (*x509.Certificate, *ecdsa.PrivateKey) {
	t := p.t
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
		DNSNames:    dns, URIs: uris,
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	parent, priv := tmpl, key
	if p.ca == nil || selfSigned {
		tmpl.IsCA, tmpl.BasicConstraintsValid = true, true // the CA, or a self-signed leaf
	} else {
		parent, priv = p.ca, p.caKey
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, priv)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(key)
	os.WriteFile(filepath.Join(p.dir, name+".pem"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600)
	os.WriteFile(filepath.Join(p.dir, name+".key"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600)
	cert, _ := x509.ParseCertificate(der)
	return cert, key
}

// client issues a client certificate with id's role for the default cluster.
func (p *pki) client(id auth.Identity) {
	p.issue(id.Name, nil, []*url.URL{auth.ClientRoleURI(rpc.DefaultClusterName, id)}, false)
}

func (p *pki) files(name string) rpc.TLSFiles {
	return rpc.TLSFiles{CertFile: filepath.Join(p.dir, name+".pem"), KeyFile: filepath.Join(p.dir, name+".key"), CAFile: filepath.Join(p.dir, "ca.pem")}
}

// dialAs connects to addr over TLS, presenting certificate name ("" for none).
func (p *pki) dialAs(addr, name string, opts ...grpc.DialOption) *grpc.ClientConn {
	t := p.t
	t.Helper()
	cfg := &tls.Config{RootCAs: p.pool}
	if name != "" {
		f := p.files(name)
		cert, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	conn, err := grpc.NewClient(addr, append([]grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(cfg))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// authCluster issues the nodes' server certificate and starts a TLS cluster without --insecure.
func authCluster(t *testing.T, limits string, opts ...rpctest.Option) (*rpctest.Cluster, *pki) {
	p := newPKI(t)
	p.issue("node", []string{auth.ServerName(rpc.DefaultClusterName)}, nil, false)
	all := append([]rpctest.Option{func(_ int, cfg *rpc.AgentConfig) {
		cfg.Insecure = false
		cfg.TLS = p.files("node")
		cfg.Cluster.GossipSecretKey = []byte("0123456789abcdef0123456789abcdef")
	}}, opts...)
	return rpctest.Start(t, 3, limits, all...), p
}

func wantCode(t *testing.T, err error, code codes.Code, words ...string) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("got %v, want %v", err, code)
	}
	for _, w := range words {
		if !strings.Contains(status.Convert(err).Message(), w) {
			t.Fatalf("error %q does not say %q", status.Convert(err).Message(), w)
		}
	}
}

// TestCertificateIdentities: client certificates carry roles; a call without a credential,
// with a role-less certificate or a self-signed one is refused; a worker's identity survives
// forwarding (its lease is its own on the leader); a principal header from anything but a
// server certificate is ignored, so a worker cannot pass itself off as an admin.
func TestCertificateIdentities(t *testing.T) {
	c, p := authCluster(t, testLimits)
	p.client(auth.Identity{Name: "w1", Role: auth.RoleWorker, Domains: []string{"provider"}})
	p.client(auth.Identity{Name: "w2", Role: auth.RoleWorker, Domains: []string{"provider"}})
	p.client(auth.Identity{Name: "reader", Role: auth.RoleReader})
	p.issue("norole", nil, nil, false)
	p.issue("selfsigned", nil, []*url.URL{auth.ClientRoleURI(rpc.DefaultClusterName, auth.Identity{Role: auth.RoleAdmin})}, true)
	leader := c.Leader()
	follower := c.Addrs()[(leader+1)%3]
	ctx := context.Background()
	adm := func(id uint64) *quotadv1.Admission { return admission(id, 1, "tenant=acme") }

	_, err := acquireOne(ctx, quotadv1.NewQuotaClient(p.dialAs(follower, "")), "c", adm(1))
	wantCode(t, err, codes.Unauthenticated, "authorization: Bearer", "client certificate")
	// A self-signed certificate claiming the admin role fails the handshake.
	if _, err := quotadv1.NewAdminClient(p.dialAs(follower, "selfsigned")).GetLimits(ctx, &quotadv1.GetLimitsRequest{}); err == nil {
		t.Fatal("a self-signed certificate was served")
	}
	_, err = acquireOne(ctx, quotadv1.NewQuotaClient(p.dialAs(follower, "norole")), "c", adm(1))
	wantCode(t, err, codes.Unauthenticated, "no quotad role")
	_, err = acquireOne(ctx, quotadv1.NewQuotaClient(p.dialAs(follower, "reader")), "c", adm(1))
	wantCode(t, err, codes.PermissionDenied, "worker", "cert:reader")
	// The nodes' own certificate is no caller's credential.
	_, err = acquireOne(ctx, quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[leader], "node")), "c", adm(1))
	wantCode(t, err, codes.PermissionDenied, "server:node")

	// w1 through a follower: the lease is w1's on the leader, so w2 cannot release it.
	d, err := acquireOne(ctx, quotadv1.NewQuotaClient(p.dialAs(follower, "w1")), "c", adm(2))
	if err != nil || !d.Admitted || d.LeaseId == 0 {
		t.Fatalf("w1 acquire through a follower: %+v %v", d, err)
	}
	w2 := quotadv1.NewQuotaClient(p.dialAs(follower, "w2"))
	_, err = w2.Release(ctx, &quotadv1.ReleaseRequest{LeaseId: d.LeaseId})
	wantCode(t, err, codes.PermissionDenied, fmt.Sprintf("lease %d belongs to another caller", d.LeaseId), "cert:w2")
	r, err := quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[leader], "w1")).Release(ctx, &quotadv1.ReleaseRequest{LeaseId: d.LeaseId})
	if err != nil || !r.Released {
		t.Fatalf("w1 releases its own lease at the leader: %v %v (it should still have been held)", r, err)
	}

	// A worker claiming to be an admin, to the leader and through a follower.
	spoof := metadata.AppendToOutgoingContext(ctx, auth.PrincipalHeader,
		auth.EncodePrincipal(auth.Identity{Name: "bootstrap", Role: auth.RoleAdmin}))
	for _, addr := range []string{c.Addrs()[leader], follower} {
		_, err = quotadv1.NewAdminClient(p.dialAs(addr, "w1")).ApplyLimits(spoof, &quotadv1.ApplyLimitsRequest{Yaml: testLimits})
		wantCode(t, err, codes.PermissionDenied, "admin", "cert:w1")
	}
	if _, err := quotadv1.NewAdminClient(p.dialAs(follower, "reader")).Members(ctx, &quotadv1.MembersRequest{}); err != nil {
		t.Fatalf("reader lists members: %v", err)
	}
	// Health checks stay open.
	if _, err := healthpb.NewHealthClient(p.dialAs(follower, "")).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("health check without a credential: %v", err)
	}
}

// tokenLimits refill slowly, so that a refund a few milliseconds after the debit returns it.
const tokenLimits = `
domain: provider
rate_limit: {unit: hour, requests_per_unit: 1000}
descriptors:
  - key: endpoint
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: tenant
    concurrency: {max_in_flight: 2, lease_ttl: 30s}
`

// TestTokens: the bootstrap token creates tokens; each role and scope is enforced, through
// followers too; leases and refunds belong to their token; a revoked token is refused on the
// leader and, once the revoke is applied there, on a follower; tokens survive snapshots and a
// restart of the whole cluster.
func TestTokens(t *testing.T) {
	bootstrapFile := filepath.Join(t.TempDir(), "bootstrap")
	bootstrap, _, err := auth.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bootstrapFile, []byte(bootstrap+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, p := authCluster(t, tokenLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.BootstrapTokenFile = bootstrapFile })
	ctx := context.Background()
	as := func(tok string) context.Context {
		return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	leader := c.Leader()
	fconn := p.dialAs(c.Addrs()[(leader+1)%3], "")
	admin := quotadv1.NewAdminClient(fconn)
	q := quotadv1.NewQuotaClient(fconn)

	_, err = admin.CreateToken(ctx, &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"provider"}})
	wantCode(t, err, codes.Unauthenticated)
	_, err = admin.CreateToken(as("qd_aaaaaaaaaaaaaaaa_"+strings.Repeat("b", 43)), &quotadv1.CreateTokenRequest{Role: "reader"})
	wantCode(t, err, codes.Unauthenticated, "accessor aaaaaaaaaaaaaaaa", "not known")
	_, err = admin.CreateToken(as(bootstrap), &quotadv1.CreateTokenRequest{Role: "worker"})
	wantCode(t, err, codes.InvalidArgument, "--domain")
	create := func(req *quotadv1.CreateTokenRequest) string {
		t.Helper()
		resp, err := admin.CreateToken(as(bootstrap), req)
		if err != nil || !strings.HasPrefix(resp.Token, "qd_"+resp.Accessor+"_") {
			t.Fatalf("create %v: %v %v", req, resp, err)
		}
		return resp.Token
	}
	worker := create(&quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"provider"}, Description: "w"})
	other := create(&quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"provider"}})
	acme := create(&quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"provider"}, Tenant: "acme"})
	elsewhere := create(&quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"billing"}})
	reader := create(&quotadv1.CreateTokenRequest{Role: "reader"})
	wacc, _ := auth.TokenAccessor(worker)
	// A domain the limits lack is created anyway (limits may come later) but named, so the
	// CLI can warn about a typo (user trial: --domain provdier succeeded silently).
	typo, err := admin.CreateToken(as(bootstrap), &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"provider", "provdier", auth.AnyDomain}})
	if err != nil || !slices.Equal(typo.UnknownDomains, []string{"provdier"}) {
		t.Fatalf("token for provider, provdier and *: unknown domains %v (%v), want [provdier]", typo.GetUnknownDomains(), err)
	}
	if _, err := admin.RevokeToken(as(bootstrap), &quotadv1.RevokeTokenRequest{Accessor: typo.Accessor}); err != nil {
		t.Fatal(err)
	}

	// Roles and scopes.
	_, err = acquireOne(as(reader), q, "c", admission(1, 1, "endpoint=search"))
	wantCode(t, err, codes.PermissionDenied, "needs the worker or admin role", "(reader)")
	_, err = acquireOne(as(elsewhere), q, "c", admission(1, 1, "endpoint=search"))
	wantCode(t, err, codes.PermissionDenied, `may not use domain "provider"`)
	_, err = acquireOne(as(acme), q, "c", admission(1, 1, "tenant=globex"))
	wantCode(t, err, codes.PermissionDenied, "tenant=acme", "globex")
	_, err = acquireOne(as(acme), q, "c", admission(1, 1, "endpoint=search"))
	wantCode(t, err, codes.PermissionDenied, "must name its tenant")
	if d, err := acquireOne(as(acme), q, "c", admission(1, 1, "tenant=acme")); err != nil || !d.Admitted {
		t.Fatalf("acme acquires as acme: %+v %v", d, err)
	}
	_, err = q.Feedback(as(elsewhere), &quotadv1.FeedbackRequest{Domain: "provider", StatusCode: 429, RetryAfterMs: 1000, Reason: "x"})
	wantCode(t, err, codes.PermissionDenied, "provider")
	_, err = q.Feedback(as(reader), &quotadv1.FeedbackRequest{Domain: "provider", StatusCode: 429, RetryAfterMs: 1000, Reason: "x"})
	wantCode(t, err, codes.PermissionDenied, "worker")
	_, err = admin.ApplyLimits(as(worker), &quotadv1.ApplyLimitsRequest{Yaml: testLimits})
	wantCode(t, err, codes.PermissionDenied, "admin role", "token:"+wacc)
	if _, err := q.Status(as(reader), &quotadv1.StatusRequest{Domain: "provider"}); err != nil {
		t.Fatalf("reader status: %v", err)
	}
	// GetLimits (through the follower): a worker sees only its domains (a regional leader
	// follows the global cluster's limits with its worker credential), a reader all.
	if g, err := admin.GetLimits(as(worker), &quotadv1.GetLimitsRequest{}); err != nil || !strings.Contains(g.Yaml, "domain: provider") {
		t.Fatalf("worker of provider reads the limits: %v %v", g, err)
	}
	if g, err := admin.GetLimits(as(elsewhere), &quotadv1.GetLimitsRequest{}); err != nil || strings.Contains(g.Yaml, "provider") {
		t.Fatalf("worker of billing reads the limits: %v %v; want no provider domain", g, err)
	}
	if g, err := admin.GetLimits(as(reader), &quotadv1.GetLimitsRequest{}); err != nil || !strings.Contains(g.Yaml, "domain: provider") {
		t.Fatalf("reader reads the limits: %v %v", g, err)
	}

	// The Go client sends its Config.Token.
	cfg := client.DefaultConfig(c.Addrs()...)
	cfg.TLS, cfg.Token = &tls.Config{RootCAs: p.pool}, acme
	cl, err := client.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if d, err := cl.Allow(ctx, client.Request{Domain: "provider", Descriptors: []client.Entry{{Key: "tenant", Value: "acme"}}}); err != nil || !d.Admitted {
		t.Fatalf("client with a token: %+v %v", d, err)
	}
	if _, err := cl.Allow(ctx, client.Request{Domain: "provider", Descriptors: []client.Entry{{Key: "tenant", Value: "globex"}}}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("client acting for another tenant: %v", err)
	}

	// Ownership: leases and refunds (through the follower).
	d, err := acquireOne(as(worker), q, "c", admission(2, 1, "tenant=initech"))
	if err != nil || !d.Admitted || d.LeaseId == 0 {
		t.Fatalf("worker acquire: %+v %v", d, err)
	}
	_, err = q.Release(as(other), &quotadv1.ReleaseRequest{LeaseId: d.LeaseId})
	wantCode(t, err, codes.PermissionDenied, "belongs to another caller")
	_, err = q.Renew(as(other), &quotadv1.RenewRequest{LeaseId: d.LeaseId})
	wantCode(t, err, codes.PermissionDenied, "belongs to another caller")
	if r, err := q.Refund(as(other), &quotadv1.RefundRequest{ClientId: "c", RequestId: 2}); err != nil || r.Refunded != 0 || r.Outcome != "not_found" {
		t.Fatalf("another token refunded the worker's request: %v %v", r, err)
	}
	if r, err := q.Refund(as(worker), &quotadv1.RefundRequest{ClientId: "c", RequestId: 2}); err != nil || r.Refunded != 1 || r.Outcome != "refunded" {
		t.Fatalf("the worker refunds its own request: %v %v", r, err)
	}
	if r, err := q.Release(as(worker), &quotadv1.ReleaseRequest{LeaseId: d.LeaseId}); err != nil || !r.Released {
		t.Fatalf("the worker releases its lease (still held): %v %v", r, err)
	}
	// The same request ID of another identity is a new request, not the worker's decision.
	if d2, err := acquireOne(as(other), q, "c", admission(2, 1, "tenant=initech")); err != nil || !d2.Admitted || d2.LeaseId == d.LeaseId {
		t.Fatalf("another token reusing the IDs got %+v %v", d2, err)
	}

	// Listing shows no secret.
	list, err := admin.ListTokens(as(bootstrap), &quotadv1.ListTokensRequest{})
	if err != nil || len(list.Tokens) != 5 {
		t.Fatalf("list: %v %v", list, err)
	}
	// The secret is everything after the second "_": base64url, so it may hold "_" itself (a
	// plain Split took a fragment of it, a few characters that the list may well contain).
	if s := list.String(); strings.Contains(s, strings.SplitN(worker, "_", 3)[2]) {
		t.Fatal("the list shows a secret")
	}

	// Tokens survive a snapshot on every node and a restart of the whole cluster.
	for i := range 3 {
		if err := c.Agent(i).Node().Raft().Snapshot().Error(); err != nil {
			t.Fatalf("snapshot node%d: %v", i, err)
		}
	}
	for i := range 3 {
		c.Stop(i)
	}
	for i := range 3 {
		c.Restart(i)
	}
	leader = c.WaitLeader(10 * time.Second)
	lconn := p.dialAs(c.Addrs()[leader], "")
	follower := (leader + 1) % 3
	fconn = p.dialAs(c.Addrs()[follower], "")
	clustertest.Eventually(t, 10*time.Second, func() error {
		_, err := acquireOne(as(worker), quotadv1.NewQuotaClient(fconn), "c", admission(3, 1, "endpoint=search"))
		return err
	})

	// Revoke: refused at the leader at once, and at a follower once it applied the revoke.
	if _, err := quotadv1.NewAdminClient(lconn).RevokeToken(as(bootstrap), &quotadv1.RevokeTokenRequest{Accessor: wacc}); err != nil {
		t.Fatal(err)
	}
	_, err = acquireOne(as(worker), quotadv1.NewQuotaClient(lconn), "c", admission(4, 1, "endpoint=search"))
	wantCode(t, err, codes.Unauthenticated, wacc)
	applied := c.Agent(leader).FSM().AppliedIndex()
	clustertest.Eventually(t, 5*time.Second, func() error {
		if got := c.Agent(follower).FSM().AppliedIndex(); got < applied {
			return fmt.Errorf("follower at %d, revoke at %d", got, applied)
		}
		return nil
	})
	_, err = quotadv1.NewAdminClient(fconn).Members(as(worker), &quotadv1.MembersRequest{}) // answered locally
	wantCode(t, err, codes.Unauthenticated, wacc)
	_, err = quotadv1.NewAdminClient(fconn).RevokeToken(as(bootstrap), &quotadv1.RevokeTokenRequest{Accessor: wacc})
	wantCode(t, err, codes.NotFound)
}

const pauseLimits = `
domain: provider
rate_limit: {unit: second, requests_per_unit: 1000}
max_pause: 10s
descriptors:
  - key: endpoint
    rate_limit: {unit: second, requests_per_unit: 100}
---
domain: other
rate_limit: {unit: second, requests_per_unit: 1000}
`

// TestPauseCappedAndLifted: a Retry-After longer than the domain's max_pause pauses for
// max_pause (default 5m), and LiftPause ends a pause at once.
func TestPauseCappedAndLifted(t *testing.T) {
	c := rpctest.Start(t, 3, pauseLimits)
	ctx := context.Background()
	conn := dial(t, c.Addrs()[(c.Leader()+1)%3])
	q, admin := quotadv1.NewQuotaClient(conn), quotadv1.NewAdminClient(conn)
	search := []*quotadv1.Entry{{Key: "endpoint", Value: "search"}}
	resp, err := q.Feedback(ctx, &quotadv1.FeedbackRequest{Domain: "provider", Descriptors: search, StatusCode: 429, RetryAfterMs: 3_600_000})
	if err != nil || resp.PausedForMs != 10_000 {
		t.Fatalf("an hour's Retry-After: %+v %v, want a 10s pause (max_pause)", resp, err)
	}
	resp, err = q.Feedback(ctx, &quotadv1.FeedbackRequest{Domain: "other", StatusCode: 503, RetryAfterMs: 1 << 50, Reason: "down"})
	if err != nil || resp.PausedForMs != (5*time.Minute).Milliseconds() {
		t.Fatalf("a huge Retry-After in a domain without max_pause: %+v %v, want the 5m default", resp, err)
	}
	a := admission(1, 1, "endpoint=search")
	if d, err := acquireOne(ctx, q, "c", a); err != nil || d.Reason != "paused" {
		t.Fatalf("paused endpoint: %+v %v", d, err)
	}
	lr, err := admin.LiftPause(ctx, &quotadv1.LiftPauseRequest{Domain: "provider", Descriptors: search})
	if err != nil || !lr.Lifted || lr.Scope != "endpoint" {
		t.Fatalf("lift: %+v %v", lr, err)
	}
	if d, err := acquireOne(ctx, q, "c", admission(2, 1, "endpoint=search")); err != nil || !d.Admitted {
		t.Fatalf("after lift: %+v %v", d, err)
	}
	if lr, err := admin.LiftPause(ctx, &quotadv1.LiftPauseRequest{Domain: "provider", Descriptors: search}); err != nil || lr.Lifted {
		t.Fatalf("lifting again: %+v %v", lr, err)
	}
	_, err = admin.LiftPause(ctx, &quotadv1.LiftPauseRequest{Domain: "nope"})
	wantCode(t, err, codes.NotFound)
}

// TestBootstrapTokenFromEnvironment: AgentConfig.BootstrapToken (from $QUOTAD_BOOTSTRAP_TOKEN)
// guards admin calls, also when a follower forwards them.
func TestBootstrapTokenFromEnvironment(t *testing.T) {
	tok, _, err := auth.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	c, p := authCluster(t, testLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.BootstrapToken = tok })
	admin := quotadv1.NewAdminClient(p.dialAs(c.Addrs()[(c.Leader()+1)%3], ""))
	req := &quotadv1.ApplyLimitsRequest{Yaml: testLimits}
	_, err = admin.ApplyLimits(context.Background(), req)
	wantCode(t, err, codes.Unauthenticated)
	bad := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer nope")
	_, err = admin.ApplyLimits(bad, req)
	wantCode(t, err, codes.Unauthenticated)
	good := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+tok)
	if resp, err := admin.ApplyLimits(good, req); err != nil || resp.Version != 2 {
		t.Fatalf("apply with the token through a follower: %v %v", resp, err)
	}
}
