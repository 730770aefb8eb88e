package rpc_test

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/backup"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// certOf reads the certificate p issued as name.
func (p *pki) certOf(name string) *x509.Certificate {
	p.t.Helper()
	b, err := os.ReadFile(p.files(name).CertFile)
	if err != nil {
		p.t.Fatal(err)
	}
	c, err := auth.ParseCertPEM(b)
	if err != nil {
		p.t.Fatal(err)
	}
	return c
}

func (p *pki) pemOf(name string) []byte {
	p.t.Helper()
	b, err := os.ReadFile(p.files(name).CertFile)
	if err != nil {
		p.t.Fatal(err)
	}
	return b
}

// freeCall spends one unit of domain free over conn: the cheapest call a worker makes.
func freeCall(ctx context.Context, conn *grpc.ClientConn, id uint64) error {
	d, err := acquireOne(ctx, quotadv1.NewQuotaClient(conn), "certs", &quotadv1.Admission{RequestId: id, Domain: "free"})
	if err == nil && !d.Admitted {
		err = fmt.Errorf("not admitted: %s %s", d.Reason, d.Message)
	}
	return err
}

// TestRevokeCertRefusedOnEveryNode: a worker certificate revoked by its file (through a
// follower) is refused on every node, on the connections it opened before the revoke, while
// another certificate of the same CA keeps working; a revoke by fingerprint again changes
// nothing and says so, one by serial refuses that serial; bad input and a worker's revoke are
// refused without a change; a certificate reissued to the same name works; a server certificate may not forward a revoked certificate's
// caller as a principal, nor a certificate caller without its fingerprint, and a revoked
// server certificate forwards no one.
func TestRevokeCertRefusedOnEveryNode(t *testing.T) {
	c, p, _ := streamCluster(t)
	// "wnew": a certificate reissued to the same name (the same identity, cert:w), which the
	// revoke of w's must not touch.
	p.client(auth.Identity{Name: "w", Role: auth.RoleWorker, Domains: []string{"free"}})
	for _, ext := range []string{".pem", ".key"} {
		if err := os.Rename(filepath.Join(p.dir, "w"+ext), filepath.Join(p.dir, "wnew"+ext)); err != nil {
			t.Fatal(err)
		}
	}
	p.client(auth.Identity{Name: "w", Role: auth.RoleWorker, Domains: []string{"free"}})
	p.client(auth.Identity{Name: "w2", Role: auth.RoleWorker, Domains: []string{"free"}})
	p.client(auth.Identity{Name: "w3", Role: auth.RoleWorker, Domains: []string{"free"}})
	p.client(auth.Identity{Name: "admin", Role: auth.RoleAdmin})
	p.issue("node2", []string{auth.ServerName(rpc.DefaultClusterName)}, nil, false)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	leader := c.Leader()
	follower := (leader + 1) % 3
	var wConn, w2Conn []*grpc.ClientConn
	id := uint64(0)
	next := func() uint64 { id++; return id }
	for i, addr := range c.Addrs() {
		wConn, w2Conn = append(wConn, p.dialAs(addr, "w")), append(w2Conn, p.dialAs(addr, "w2"))
		for _, conn := range []*grpc.ClientConn{wConn[i], w2Conn[i]} {
			if err := freeCall(ctx, conn, next()); err != nil {
				t.Fatalf("node %d before the revoke: %v", i, err)
			}
		}
	}
	w3 := p.dialAs(c.Addrs()[leader], "w3")
	if err := freeCall(ctx, w3, next()); err != nil {
		t.Fatal(err)
	}
	admin := quotadv1.NewAdminClient(p.dialAs(c.Addrs()[follower], "admin"))

	_, err := quotadv1.NewAdminClient(wConn[leader]).RevokeCert(ctx, &quotadv1.RevokeCertRequest{CertPem: p.pemOf("w2")})
	wantCode(t, err, codes.PermissionDenied, "admin")
	for name, tc := range map[string]struct {
		req  *quotadv1.RevokeCertRequest
		says string
	}{
		"nothing":         {&quotadv1.RevokeCertRequest{}, "exactly one of --cert"},
		"two names":       {&quotadv1.RevokeCertRequest{Serial: "1f", CertPem: p.pemOf("w")}, "exactly one of --cert"},
		"bad fingerprint": {&quotadv1.RevokeCertRequest{Sha256: "3f:9a"}, "64 hex digits"},
		"bad serial":      {&quotadv1.RevokeCertRequest{Serial: "12-34"}, "positive hex number"},
		"decimal serial?": {&quotadv1.RevokeCertRequest{Serial: "4096"}, "only decimal digits"},
		"not a PEM":       {&quotadv1.RevokeCertRequest{CertPem: []byte("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")}, "no PEM CERTIFICATE block"},
	} {
		_, err := admin.RevokeCert(ctx, tc.req)
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), tc.says) {
			t.Errorf("%s: %v, want InvalidArgument saying %q", name, err, tc.says)
		}
	}
	if l, err := admin.ListRevokedCerts(ctx, &quotadv1.ListRevokedCertsRequest{}); err != nil || len(l.Certs) != 0 {
		t.Fatalf("after refused revokes: %v %v", l, err)
	}

	w := p.certOf("w")
	fp := sha256.Sum256(w.Raw)
	resp, err := admin.RevokeCert(ctx, &quotadv1.RevokeCertRequest{CertPem: p.pemOf("w"), Reason: "leaked"})
	if err != nil {
		t.Fatal(err)
	}
	if e := resp.Cert; resp.AlreadyRevoked || e.Sha256 != hex.EncodeToString(fp[:]) || e.Subject != "w" || e.RevokedBy != "cert:admin" ||
		e.Reason != "leaked" || e.SerialInfo != auth.SerialHex(w.SerialNumber) || e.NotAfterUnixMs != w.NotAfter.UnixMilli() {
		t.Fatalf("revoke answered %+v", resp)
	}
	// Refused on every node, on the connections opened before the revoke (the follower that
	// forwarded it answers after it applied it; the third node may apply it a moment later).
	clustertest.Eventually(t, 5*time.Second, func() error {
		for i := range wConn {
			err := freeCall(ctx, wConn[i], next())
			if status.Code(err) != codes.Unauthenticated || !strings.Contains(err.Error(), "revoked") {
				return fmt.Errorf("node %d: the revoked certificate's call answered %v", i, err)
			}
		}
		return nil
	})
	for i := range w2Conn {
		if err := freeCall(ctx, w2Conn[i], next()); err != nil {
			t.Fatalf("node %d: another certificate of the same CA refused: %v", i, err)
		}
	}
	wantCode(t, freeCall(ctx, p.dialAs(c.Addrs()[follower], "w"), next()), codes.Unauthenticated, "revoked", "serial "+auth.SerialHex(w.SerialNumber))
	if err := freeCall(ctx, p.dialAs(c.Addrs()[follower], "wnew"), next()); err != nil {
		t.Fatalf("a certificate reissued to the same name refused: %v", err)
	}

	// Idempotent: by fingerprint as openssl prints it (upper case, colons).
	var colons []string
	for _, b := range fp {
		colons = append(colons, fmt.Sprintf("%02X", b))
	}
	again, err := admin.RevokeCert(ctx, &quotadv1.RevokeCertRequest{Sha256: "SHA256 Fingerprint=" + strings.Join(colons, ":")})
	if err != nil || !again.AlreadyRevoked || again.Cert.RevokedBy != "cert:admin" || again.Cert.Reason != "leaked" {
		t.Fatalf("revoking it again: %+v %v, want already revoked (the first revoke's entry)", again, err)
	}
	// By serial, as openssl x509 -serial prints it.
	w3cert := p.certOf("w3")
	if _, err := admin.RevokeCert(ctx, &quotadv1.RevokeCertRequest{Serial: "serial=" + strings.ToUpper(w3cert.SerialNumber.Text(16))}); err != nil {
		t.Fatal(err)
	}
	wantCode(t, freeCall(ctx, w3, next()), codes.Unauthenticated, "revoked")
	l, err := admin.ListRevokedCerts(ctx, &quotadv1.ListRevokedCertsRequest{})
	if err != nil || len(l.Certs) != 2 || l.Certs[0].Serial != auth.SerialHex(w3cert.SerialNumber) || l.Certs[1].Subject != "w" {
		t.Fatalf("list: %v %v, want w3's serial and w's fingerprint", l, err)
	}

	// Principals: only a server certificate may forward one, and not a revoked caller's.
	node := quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[leader], "node"))
	as := func(id auth.Identity) context.Context {
		return metadata.AppendToOutgoingContext(ctx, auth.PrincipalHeader, auth.EncodePrincipal(id))
	}
	worker := func(name string, k auth.CertKey) auth.Identity {
		return auth.Identity{Name: "cert:" + name, Role: auth.RoleWorker, Domains: []string{"free"}, Cert: k}
	}
	free := func(ctx context.Context, q quotadv1.QuotaClient) error {
		_, err := acquireOne(ctx, q, "fwd", &quotadv1.Admission{RequestId: next(), Domain: "free"})
		return err
	}
	wantCode(t, free(as(worker("w", auth.KeyOf(w))), node), codes.Unauthenticated, "revoked")
	wantCode(t, free(as(worker("w", auth.CertKey{})), node), codes.Unauthenticated, "without its certificate's fingerprint")
	if err := free(as(worker("w2", auth.KeyOf(p.certOf("w2")))), node); err != nil {
		t.Fatalf("a principal of a valid certificate from a server certificate: %v", err)
	}
	node2 := quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[leader], "node2"))
	if err := free(as(worker("w2", auth.KeyOf(p.certOf("w2")))), node2); err != nil {
		t.Fatal(err)
	}
	// A node certificate is revoked only with force: named by its file (the server SAN), or
	// by the fingerprint of one the leader has seen (node2 connected to it above).
	k2 := auth.KeyOf(p.certOf("node2"))
	for _, req := range []*quotadv1.RevokeCertRequest{
		{CertPem: p.pemOf("node2")},
		{Sha256: hex.EncodeToString(k2.SHA256[:])},
	} {
		_, err := admin.RevokeCert(ctx, req)
		wantCode(t, err, codes.FailedPrecondition, "node (server) certificate")
	}
	if err := free(as(worker("w2", auth.KeyOf(p.certOf("w2")))), node2); err != nil {
		t.Fatalf("node2 forwarding after refused revokes of its certificate: %v (they changed state)", err)
	}
	if _, err := admin.RevokeCert(ctx, &quotadv1.RevokeCertRequest{CertPem: p.pemOf("node2"), Force: true}); err != nil {
		t.Fatal(err)
	}
	clustertest.Eventually(t, 5*time.Second, func() error {
		if err := free(as(worker("w2", auth.KeyOf(p.certOf("w2")))), node2); status.Code(err) != codes.Unauthenticated {
			return fmt.Errorf("a revoked server certificate forwarding a valid caller: %v", err)
		}
		return nil
	})
}

// TestRevokedCertEndsWaitersAndStream: as a token revoke does, a certificate revoke answers
// the certificate's admissions waiting on the leader UNAUTHENTICATED (one waiting through
// an AcquireStream on the leader, one unary through a follower, which forwarded the caller
// as a principal), ends its stream, and leaves another certificate's waiter waiting.
func TestRevokedCertEndsWaitersAndStream(t *testing.T) {
	c, p, bootstrap := streamCluster(t)
	p.client(auth.Identity{Name: "w2", Role: auth.RoleWorker, Domains: []string{"held"}})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	leader := c.Leader()
	follower := (leader + 1) % 3
	bconn := p.dialAs(c.Addrs()[leader], "")
	boot := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+bootstrap)
	// held (one unit a minute) is the domain to wait on.
	p.client(auth.Identity{Name: "w", Role: auth.RoleWorker, Domains: []string{"held", "free"}})
	lq := quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[leader], "w"))
	fq := quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[follower], "w"))
	if d, err := acquireOne(ctx, lq, "drain", &quotadv1.Admission{RequestId: 1, Domain: "held"}); err != nil || !d.Admitted {
		t.Fatalf("held's one unit: %v %v", d, err)
	}
	s, err := lq.AcquireStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&quotadv1.AcquireStreamRequest{ClientId: "st", Admissions: []*quotadv1.Admission{waiting(2, "free", time.Second)}}); err != nil {
		t.Fatal(err)
	}
	if m, err := recvWithin(t, s, 10*time.Second); err != nil || !m.Decisions[0].GetDecision().GetAdmitted() {
		t.Fatalf("stream before the revoke: %v %v", m, err)
	}
	if err := s.Send(&quotadv1.AcquireStreamRequest{Admissions: []*quotadv1.Admission{waiting(3, "held", 90*time.Second)}}); err != nil {
		t.Fatal(err)
	}
	type result struct {
		who string
		err error
	}
	results := make(chan result, 2)
	go func() {
		_, err := acquireOne(ctx, fq, "unary", waiting(4, "held", 90*time.Second))
		results <- result{"w", err}
	}()
	w2ctx, w2cancel := context.WithCancel(ctx)
	defer w2cancel()
	go func() {
		_, err := acquireOne(w2ctx, quotadv1.NewQuotaClient(p.dialAs(c.Addrs()[leader], "w2")), "w2", waiting(5, "held", 90*time.Second))
		results <- result{"w2", err}
	}()
	clustertest.Eventually(t, 10*time.Second, func() error {
		if n := rpc.Waiting(c.Agent(leader)); n != 3 {
			return fmt.Errorf("%d admissions waiting on the leader, want 3", n)
		}
		return nil
	})
	if _, err := quotadv1.NewAdminClient(bconn).RevokeCert(boot, &quotadv1.RevokeCertRequest{CertPem: p.pemOf("w")}); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-results:
		if r.who != "w" {
			t.Fatalf("w2's waiter answered first: %v", r.err)
		}
		wantCode(t, r.err, codes.Unauthenticated, "cert:w", "revoked while this admission waited")
	case <-time.After(10 * time.Second):
		t.Fatal("the revoked certificate's unary waiter (forwarded by a follower) still waits 10 s after the revoke")
	}
	// The stream: its waiter answered UNAUTHENTICATED and the next message refused, or the
	// stream's own re-check ends it first.
	m, err := recvWithin(t, s, 10*time.Second)
	if err == nil {
		if len(m.Decisions) != 1 || m.Decisions[0].RequestId != 3 || codes.Code(m.Decisions[0].Code) != codes.Unauthenticated {
			t.Fatalf("stream after the revoke: %v, want request 3 answered UNAUTHENTICATED or the stream ended", m)
		}
		if err = s.Send(&quotadv1.AcquireStreamRequest{Admissions: []*quotadv1.Admission{waiting(6, "free", time.Second)}}); err == nil {
			_, err = recvWithin(t, s, 10*time.Second)
		} else if errors.Is(err, io.EOF) {
			_, err = s.Recv()
		}
	}
	wantCode(t, err, codes.Unauthenticated, "revoked")
	clustertest.Eventually(t, 5*time.Second, func() error {
		if n := rpc.Waiting(c.Agent(leader)); n != 1 {
			return fmt.Errorf("%d admissions waiting after the revoke, want 1 (w2's)", n)
		}
		return nil
	})
}

// TestRevokedCertSurvivesRestoreAndFailover: a snapshot saved before the revoke and restored
// after it (even with --restore-tokens) keeps the certificate revoked, and so do a new leader
// after the old one is stopped and the old leader once it restarts.
func TestRevokedCertSurvivesRestoreAndFailover(t *testing.T) {
	c, p, bootstrap := streamCluster(t)
	p.client(auth.Identity{Name: "w2", Role: auth.RoleWorker, Domains: []string{"free"}})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	boot := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+bootstrap)
	leader := c.Leader()
	bconn := p.dialAs(c.Addrs()[leader], "")
	file := filepath.Join(t.TempDir(), "s.snap")
	if _, err := backup.Save(boot, quotadv1.NewSnapshotClient(bconn), file); err != nil {
		t.Fatal(err)
	}
	w := p.certOf("w")
	fp := sha256.Sum256(w.Raw)
	if _, err := quotadv1.NewAdminClient(bconn).RevokeCert(boot, &quotadv1.RevokeCertRequest{Sha256: hex.EncodeToString(fp[:])}); err != nil {
		t.Fatal(err)
	}
	id := uint64(100)
	refusedEverywhere := func(when string) {
		t.Helper()
		clustertest.Eventually(t, 10*time.Second, func() error {
			for i, addr := range c.Addrs() {
				if c.Agent(i) == nil {
					continue
				}
				id++
				if err := freeCall(ctx, p.dialAs(addr, "w"), id); status.Code(err) != codes.Unauthenticated {
					return fmt.Errorf("%s: node %d answered the revoked certificate %v", when, i, err)
				}
				id++
				if err := freeCall(ctx, p.dialAs(addr, "w2"), id); err != nil {
					return fmt.Errorf("%s: node %d refused w2: %v", when, i, err)
				}
			}
			return nil
		})
	}
	refusedEverywhere("after the revoke")
	for _, restoreTokens := range []bool{false, true} {
		if _, err := backup.Restore(boot, quotadv1.NewSnapshotClient(bconn), file, restoreTokens); err != nil {
			t.Fatal(err)
		}
		refusedEverywhere(fmt.Sprintf("after restoring a snapshot saved before the revoke (restore tokens %v)", restoreTokens))
	}
	if got := c.Agent(leader).FSM().RevokedCerts(); len(got) != 1 || got[0].SHA256 != fp {
		t.Fatalf("deny-list after the restores: %+v", got)
	}

	c.Stop(leader)
	c.WaitLeader(10 * time.Second)
	refusedEverywhere("after a failover")
	c.Restart(leader)
	clustertest.Eventually(t, 10*time.Second, func() error {
		if !c.Agent(leader).FSM().CertRevoked(auth.KeyOf(w)) {
			return errors.New("the restarted old leader does not have the revoke")
		}
		return nil
	})
	refusedEverywhere("after the old leader restarted")
}

// TestRevokeCertNeedsCommandVersion8: while a node advertises command version 7 (a build
// that would stop at a RevokeCert entry), a revoke is refused FailedPrecondition naming that
// node, and nothing changes; once it is upgraded, the revoke goes through.
func TestRevokeCertNeedsCommandVersion8(t *testing.T) {
	c, p, bootstrap := streamCluster(t, func(i int, cfg *rpc.AgentConfig) {
		if i == 2 {
			cfg.Cluster.AdvertisedCommandVersion = fsm.CertRevokeVersion - 1
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	boot := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+bootstrap)
	old := c.ClusterConfig(2).ID
	revoke := func() error {
		l := c.Leader()
		if l < 0 {
			return errors.New("no leader")
		}
		conn := p.dialAs(c.Addrs()[l], "")
		_, err := quotadv1.NewAdminClient(conn).RevokeCert(boot, &quotadv1.RevokeCertRequest{CertPem: p.pemOf("w")})
		return err
	}
	clustertest.Eventually(t, 10*time.Second, func() error { // gossip has reported node 2's version
		err := revoke()
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), old+" advertises command version 7") {
			return fmt.Errorf("revoke on a cluster with a version 7 node: %v, want FailedPrecondition naming %s", err, old)
		}
		return nil
	})
	wantCode(t, revoke(), codes.FailedPrecondition, "upgrade those nodes first", "nothing changed")
	for i := range 3 {
		if c.Agent(i).FSM().AnyCertRevoked() {
			t.Fatalf("node %d holds a revoke after a refused one", i)
		}
	}
	if err := freeCall(ctx, p.dialAs(c.Addrs()[0], "w"), 1); err != nil {
		t.Fatal(err)
	}

	c.Kill(2)
	c.Reconfigure(2, func(_ int, cfg *rpc.AgentConfig) { cfg.Cluster.AdvertisedCommandVersion = 0 })
	c.Restart(2)
	clustertest.Eventually(t, 15*time.Second, revoke)
	clustertest.Eventually(t, 5*time.Second, func() error {
		if err := freeCall(ctx, p.dialAs(c.Addrs()[2], "w"), 2); status.Code(err) != codes.Unauthenticated {
			return fmt.Errorf("after the upgrade and revoke: %v", err)
		}
		return nil
	})

	// A snapshot holding the revoke (format 3) is not restored while a node is at version 7:
	// it could not read it.
	file := filepath.Join(t.TempDir(), "s.snap")
	snap := func() quotadv1.SnapshotClient {
		return quotadv1.NewSnapshotClient(p.dialAs(c.Addrs()[c.WaitLeader(10*time.Second)], ""))
	}
	if _, err := backup.Save(boot, snap(), file); err != nil {
		t.Fatal(err)
	}
	c.Kill(2)
	c.Reconfigure(2, func(_ int, cfg *rpc.AgentConfig) { cfg.Cluster.AdvertisedCommandVersion = fsm.CertRevokeVersion - 1 })
	c.Restart(2)
	clustertest.Eventually(t, 15*time.Second, func() error {
		_, err := backup.Restore(boot, snap(), file, false)
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "restoring a snapshot that holds revoked certificates") ||
			!strings.Contains(err.Error(), old+" advertises command version 7") {
			return fmt.Errorf("restore with a version 7 node: %v", err)
		}
		return nil
	})
}

// TestCertKeyOncePerConnection: the deny-list is checked on every call, but the certificate's
// key (a SHA-256 of its DER) is computed once per connection, at the handshake.
func TestCertKeyOncePerConnection(t *testing.T) {
	c, p, _ := streamCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var n atomic.Int64
	rpc.SetCertKeyHook(func() { n.Add(1) })
	defer rpc.SetCertKeyHook(nil)
	conn := p.dialAs(c.Addrs()[c.Leader()], "w")
	for i := range 50 {
		if err := freeCall(ctx, conn, uint64(i+1)); err != nil {
			t.Fatal(err)
		}
	}
	if got := n.Load(); got != 1 {
		t.Fatalf("the certificate's key was computed %d times for 50 calls on one connection, want once", got)
	}
}

// TestRevokedCertRefusedOnHTTPDebug: the HTTP debug endpoints, which take an admin
// certificate, refuse a revoked one; another admin certificate still gets in.
func TestRevokedCertRefusedOnHTTPDebug(t *testing.T) {
	c, creds := secureCluster(t, 1, true)
	if _, _, err := pkifiles.CreateCert(creds.Dir, creds.CAFile, filepath.Join(creds.Dir, pkifiles.CAKeyFile), auth.CertOptions{
		Cluster: rpc.DefaultClusterName, Name: "ops2", Identity: auth.Identity{Role: auth.RoleAdmin}}); err != nil {
		t.Fatal(err)
	}
	base := "https://" + c.Agent(0).HTTPAddr() + "/debug/state"
	leaked := httpsClient(t, creds, "ops2")
	if code, body := get(t, leaked, base, ""); code != http.StatusOK {
		t.Fatalf("before the revoke: %d %s", code, body)
	}
	pem, err := os.ReadFile(filepath.Join(creds.Dir, pkifiles.CertFile("ops2")))
	if err != nil {
		t.Fatal(err)
	}
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+creds.Token)
	cc, err := grpc.NewClient(c.Addrs()[0], grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: caPool(t, creds.CAFile)})))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	if _, err := quotadv1.NewAdminClient(cc).RevokeCert(ctx, &quotadv1.RevokeCertRequest{CertPem: pem}); err != nil {
		t.Fatal(err)
	}
	if code, body := get(t, leaked, base, ""); code != http.StatusUnauthorized || !strings.Contains(body, "revoked") {
		t.Fatalf("the revoked admin certificate on the open connection: %d %q, want 401 saying revoked", code, body)
	}
	if code, _ := get(t, httpsClient(t, creds, pkifiles.AdminName), base, ""); code != http.StatusOK {
		t.Fatalf("another admin certificate: %d", code)
	}
}

// TestRevokeCertDenyListFull: at fsm.MaxRevokedCerts a revoke is refused RESOURCE_EXHAUSTED
// (before: INVALID_ARGUMENT, as if the request were malformed, proposed to the log anyway,
// and telling the operator that replacing the CA drops entries, which nothing does), saying
// what to do instead, and nothing changes; a certificate already on the full list is still
// answered "already revoked".
func TestRevokeCertDenyListFull(t *testing.T) {
	c := rpctest.Start(t, 1, "")
	admin := quotadv1.NewAdminClient(dial(t, c.Addrs()[0]))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := fillDenyList(ctx, admin, fsm.MaxRevokedCerts, func(i int) *quotadv1.RevokeCertRequest {
		return &quotadv1.RevokeCertRequest{Serial: fmt.Sprintf("0x%x", i)}
	}); err != nil {
		t.Fatal(err)
	}
	f := c.Agent(0).FSM()
	gen := f.CertsGeneration()
	_, err := admin.RevokeCert(ctx, &quotadv1.RevokeCertRequest{Serial: "abcdef01", Reason: "leaked"})
	wantCode(t, err, codes.ResourceExhausted, "replace the CA")
	if strings.Contains(status.Convert(err).Message(), "to drop them") || f.RevokedCertCount() != fsm.MaxRevokedCerts || f.CertsGeneration() != gen {
		t.Fatalf("a revoke past the cap: %v; %d entries", err, f.RevokedCertCount())
	}
	if r, err := admin.RevokeCert(ctx, &quotadv1.RevokeCertRequest{Serial: "0x1"}); err != nil || !r.AlreadyRevoked {
		t.Fatalf("a revoke of a listed certificate on the full list: %v %v", r, err)
	}
}

// TestListRevokedCertsLargeThroughFollower: a deny-list whose listing is above gRPC's default
// 4 MB receive cap (~9,000 entries with long reasons, revoked by an admin with a long name;
// the full 10,000 can reach ~12 MB) is listed through a follower too: before, the follower's
// forward to the leader failed RESOURCE_EXHAUSTED ("received message larger than max"), so
// `quotad tls cert revoked` could not list what the cluster held.
func TestListRevokedCertsLargeThroughFollower(t *testing.T) {
	c, p, _ := streamCluster(t)
	name := strings.Repeat("a", 200)
	p.client(auth.Identity{Name: name, Role: auth.RoleAdmin})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	leader := c.Leader()
	admin := quotadv1.NewAdminClient(p.dialAs(c.Addrs()[leader], name))
	const n = 9000
	reason := strings.Repeat("r", 256)
	if err := fillDenyList(ctx, admin, n, func(i int) *quotadv1.RevokeCertRequest {
		fp := sha256.Sum256(fmt.Appendf(nil, "cert %d", i))
		return &quotadv1.RevokeCertRequest{Sha256: hex.EncodeToString(fp[:]), Reason: reason}
	}); err != nil {
		t.Fatal(err)
	}
	leader = c.Leader() // again: it may have changed under the load
	follower := quotadv1.NewAdminClient(p.dialAs(c.Addrs()[(leader+1)%3], name))
	l, err := follower.ListRevokedCerts(ctx, &quotadv1.ListRevokedCertsRequest{}, grpc.MaxCallRecvMsgSize(rpc.MaxRevokedCertsListBytes))
	if err != nil {
		t.Fatalf("listing through a follower: %v", err)
	}
	if len(l.Certs) != n || proto.Size(l) <= 4<<20 {
		t.Fatalf("listed %d entries, %d bytes; want %d, above 4 MB", len(l.Certs), proto.Size(l), n)
	}
}

// TestRevokedCertRefusedOnRLS: the Envoy rate limit service refuses a revoked certificate on
// every node, on connections opened before the revoke (a follower's batched forward
// included), and the leader checks the principals of a forwarded batch (Peer
// ForwardRateLimit) call by call: a revoked certificate's principal, and a certificate
// principal without its key once certificates are revoked, are refused while the batch's
// other calls are decided.
func TestRevokedCertRefusedOnRLS(t *testing.T) {
	c, p, _ := streamCluster(t)
	p.client(auth.Identity{Name: "w2", Role: auth.RoleWorker, Domains: []string{"free"}})
	p.client(auth.Identity{Name: "admin", Role: auth.RoleAdmin})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	leader := c.Leader()
	req := rlsReq("free", []string{"k", "v"})
	var rls []rlsv3.RateLimitServiceClient
	for _, addr := range c.Addrs() {
		rls = append(rls, rlsv3.NewRateLimitServiceClient(p.dialAs(addr, "w")))
	}
	for i, r := range rls {
		if resp, err := r.ShouldRateLimit(ctx, req); err != nil || resp.OverallCode != rlsv3.RateLimitResponse_OK {
			t.Fatalf("node %d before the revoke: %v %v", i, resp, err)
		}
	}
	admin := quotadv1.NewAdminClient(p.dialAs(c.Addrs()[leader], "admin"))
	if _, err := admin.RevokeCert(ctx, &quotadv1.RevokeCertRequest{CertPem: p.pemOf("w")}); err != nil {
		t.Fatal(err)
	}
	clustertest.Eventually(t, 5*time.Second, func() error {
		for i, r := range rls {
			if _, err := r.ShouldRateLimit(ctx, req); status.Code(err) != codes.Unauthenticated || !strings.Contains(err.Error(), "revoked") {
				return fmt.Errorf("node %d: ShouldRateLimit of the revoked certificate answered %v", i, err)
			}
		}
		return nil
	})

	data, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	worker := func(name string, k auth.CertKey) string {
		return auth.EncodePrincipal(auth.Identity{Name: "cert:" + name, Role: auth.RoleWorker, Domains: []string{"free"}, Cert: k})
	}
	peer := quotadv1.NewPeerClient(p.dialAs(c.Addrs()[leader], "node"))
	resp, err := peer.ForwardRateLimit(ctx, &quotadv1.ForwardRateLimitRequest{Calls: []*quotadv1.ForwardedCall{
		{Request: data, Principal: worker("w", auth.KeyOf(p.certOf("w")))},
		{Request: data, Principal: worker("w", auth.CertKey{})},
		{Request: data, Principal: worker("w2", auth.KeyOf(p.certOf("w2")))},
	}})
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []string{"revoked", "without its certificate's fingerprint"} {
		if r := resp.Results[i]; codes.Code(r.Code) != codes.Unauthenticated || !strings.Contains(r.Message, want) {
			t.Errorf("forwarded call %d: %v %q, want Unauthenticated saying %q", i, codes.Code(r.Code), r.Message, want)
		}
	}
	out := &rlsv3.RateLimitResponse{}
	if r := resp.Results[2]; r.Code != 0 || proto.Unmarshal(r.Response, out) != nil || out.OverallCode != rlsv3.RateLimitResponse_OK {
		t.Errorf("a valid certificate's forwarded call: %v %q %v", codes.Code(r.Code), r.Message, out)
	}
}

// fillDenyList revokes req(1)…req(n) through admin, 16 at a time. A revoke is idempotent, so
// one answered UNAVAILABLE (a leader change: the cluster is loaded, -race especially) is sent
// again.
func fillDenyList(ctx context.Context, admin quotadv1.AdminClient, n int, req func(i int) *quotadv1.RevokeCertRequest) error {
	var next atomic.Int64
	errs := make(chan error, 16)
	for range cap(errs) {
		go func() {
			for {
				i := int(next.Add(1))
				if i > n {
					errs <- nil
					return
				}
				for {
					_, err := admin.RevokeCert(ctx, req(i))
					if status.Code(err) == codes.Unavailable && ctx.Err() == nil {
						time.Sleep(50 * time.Millisecond)
						continue
					}
					if err != nil {
						errs <- fmt.Errorf("revoke %d: %w", i, err)
						return
					}
					break
				}
			}
		}()
	}
	var first error
	for range cap(errs) {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return first
}
