package rpc

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/fsm"
)

// Certificate revocation (docs/security.md "Callers"): the replicated deny-list
// (fsm/certs.go) is checked on every call of a certificate caller, on connections already
// open too, as a token is looked up on every call. The key it is checked by (auth.CertKey:
// the SHA-256 of the certificate's DER and its serial) is computed once per connection, at
// the TLS handshake (certCreds), so a call costs two map lookups.

// certCreds wraps the gRPC server's TLS credentials: a connection whose client certificate
// verified carries its auth.CertKey in its AuthInfo (certInfo).
type certCreds struct {
	credentials.TransportCredentials
	// nodes records the node (server) certificates of cluster that peers present (a revoke
	// of one needs force: nodeCertSet).
	nodes   *nodeCertSet
	cluster string
}

// certInfo is a verified client certificate's connection: the TLS state and its key.
type certInfo struct {
	credentials.TLSInfo
	key auth.CertKey
}

func (c certCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	out, ai, err := c.TransportCredentials.ServerHandshake(conn)
	if err != nil {
		return out, ai, err
	}
	if info, ok := ai.(credentials.TLSInfo); ok && len(info.State.VerifiedChains) > 0 && len(info.State.PeerCertificates) > 0 {
		leaf := info.State.PeerCertificates[0]
		if c.nodes != nil && auth.IsServerCert(leaf, c.cluster) {
			c.nodes.add(leaf)
		}
		return out, certInfo{TLSInfo: info, key: certKeyOf(leaf)}, nil
	}
	return out, ai, nil
}

func (c certCreds) Clone() credentials.TransportCredentials {
	return certCreds{TransportCredentials: c.TransportCredentials.Clone(), nodes: c.nodes, cluster: c.cluster}
}

// verifiedPeerCert returns the caller's certificate if it verified against the CA, and its
// key (computed at the handshake; here only for a connection the wrapper did not see).
func verifiedPeerCert(ctx context.Context) (*x509.Certificate, auth.CertKey) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil, auth.CertKey{}
	}
	var info credentials.TLSInfo
	var key *auth.CertKey
	switch ai := p.AuthInfo.(type) {
	case certInfo:
		info, key = ai.TLSInfo, &ai.key
	case credentials.TLSInfo:
		info = ai
	default:
		return nil, auth.CertKey{}
	}
	if len(info.State.VerifiedChains) == 0 || len(info.State.PeerCertificates) == 0 {
		return nil, auth.CertKey{}
	}
	cert := info.State.PeerCertificates[0]
	if key == nil {
		k := certKeyOf(cert)
		key = &k
	}
	return cert, *key
}

// certKeyHook, if set, is called each time a certificate's key is computed (tests count them:
// once per connection).
var certKeyHook atomic.Pointer[func()]

func certKeyOf(cert *x509.Certificate) auth.CertKey {
	if hook := certKeyHook.Load(); hook != nil {
		(*hook)()
	}
	return auth.KeyOf(cert)
}

// revokedCertError is the refusal of a call whose certificate is on the deny-list.
func revokedCertError(method, subject string, k auth.CertKey) error {
	return status.Errorf(codes.Unauthenticated, "%s: the client certificate %q (serial %s) was revoked (quotad tls cert revoked lists it); ask an admin for a new certificate (quotad tls cert create) or a token",
		method, subject, k.Serial)
}

// checkPrincipalCert refuses a forwarded principal whose certificate is revoked, and a
// certificate principal without its certificate's key once any certificate is revoked (a
// forwarding node of a build before command version 8 does not send it; a principal that
// left it out could not be checked).
func (a *authenticator) checkPrincipalCert(method, server string, fwd auth.Identity) error {
	if a.certRevoked == nil {
		return nil
	}
	if !fwd.Cert.IsZero() {
		if a.certRevoked(fwd.Cert) {
			return revokedCertError(method, strings.TrimPrefix(fwd.Name, "cert:"), fwd.Cert)
		}
		return nil
	}
	if strings.HasPrefix(fwd.Name, "cert:") && a.anyCertRevoked() {
		return status.Errorf(codes.Unauthenticated, "%s: server %s forwarded certificate caller %s without its certificate's fingerprint, and the cluster has revoked certificates: upgrade that node (fsm command version %d) or call the leader directly",
			method, server, fwd.Name, fsm.CertRevokeVersion)
	}
	return nil
}

// certRevokedOwner reports whether the certificate a waiter's caller presented is revoked.
func (s *Server) certRevokedOwner(k auth.CertKey) bool {
	return !k.IsZero() && s.fsm.CertRevoked(k)
}

// RevokeCert adds a certificate to the deny-list (admin). The leader writes it only when
// every node applies fsm command version 8: an older node would stop at the entry.
func (s *Server) RevokeCert(ctx context.Context, req *quotadv1.RevokeCertRequest) (*quotadv1.RevokeCertResponse, error) {
	op, err := revokeCertOp(req)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		resp, err := quotadv1.NewAdminClient(conn).RevokeCert(forwardCtx(ctx), req)
		if err == nil {
			// Read your writes: this node refuses the certificate from the answer on.
			s.awaitCertRevoked(ctx, op)
		}
		return resp, err
	}
	if err := s.certRevokeAllowed("revoking a certificate"); err != nil {
		return nil, err
	}
	if e, ok := s.fsm.RevokedCertOf(op); ok {
		return &quotadv1.RevokeCertResponse{Cert: revokedCertInfo(e), AlreadyRevoked: true}, nil
	}
	if !req.Force {
		if err := s.refuseNodeCert(req, op); err != nil {
			return nil, err
		}
	}
	if n := s.fsm.RevokedCertCount(); n >= fsm.MaxRevokedCerts {
		// Refused here, without a log entry the FSM would refuse (it checks again: a revoke
		// that committed meanwhile).
		return nil, denyListFullError(fsm.DenyListFull(n))
	}
	op.RevokedBy, op.RevokedUnixMs = clip(IdentityFrom(ctx).Name), time.Now().UnixMilli()
	r, err := s.prop.propose(ctx, &fsmv1.Op{Op: &fsmv1.Op_RevokeCert{RevokeCert: op}})
	if err != nil {
		return nil, s.applyError(err)
	}
	already := false
	if err := r.Other.Err; err != nil {
		switch {
		case errors.Is(err, fsm.ErrCertRevoked):
			already = true // revoked by a call that committed first
		case errors.Is(err, fsm.ErrCertDenyListFull):
			return nil, denyListFullError(err)
		case errors.Is(err, fsm.ErrInvalidCertRevoke) && strings.Contains(err.Error(), "command version"):
			return nil, status.Errorf(codes.FailedPrecondition, "the revoke was written at an older command version (a node joined or was downgraded meanwhile): %v; nothing changed", err)
		default:
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
	}
	s.fair.wake() // its waiting admissions are failed at the pump's next pass: now
	e, _ := s.fsm.RevokedCertOf(op)
	return &quotadv1.RevokeCertResponse{Cert: revokedCertInfo(e), AlreadyRevoked: already}, nil
}

// refuseNodeCert refuses (FailedPrecondition) a revoke without force that names a node
// certificate: a file carrying the server SAN, or the fingerprint or serial of a node
// certificate this leader has seen (its own, or one a peer presented: nodeCertSet).
func (s *Server) refuseNodeCert(req *quotadv1.RevokeCertRequest, op *fsmv1.RevokeCert) error {
	subject, node := "", false
	if len(req.CertPem) > 0 {
		if c, err := auth.ParseCertPEM(req.CertPem); err == nil && auth.IsServerCert(c, s.clusterName) {
			subject, node = c.Subject.CommonName, true
		}
	}
	if !node {
		subject, node = s.nodeCerts.match(op.Sha256, op.Serial)
	}
	if !node {
		return nil
	}
	return status.Errorf(codes.FailedPrecondition, "the certificate %q is a node (server) certificate of this cluster: revoking it refuses that node's gRPC API and every call it forwards for the callers it serves (every node's, if nodes share it), but not its Raft or gossip; to retire a node, remove it (quotad members remove) and replace the CA (docs/security.md). Nothing changed; pass --force to revoke it anyway", subject)
}

// denyListFullError is the refusal of a revoke (or restore) the deny-list has no room for
// (fsm.ErrCertDenyListFull): RESOURCE_EXHAUSTED, not INVALID_ARGUMENT — the request was
// fine, the cluster cannot take it.
func denyListFullError(err error) error {
	return status.Error(codes.ResourceExhausted, err.Error())
}

// certRevokeAllowed refuses (FailedPrecondition) what (a revoke, a restore of revoked
// certificates) unless this leader writes entries at command version 8 or newer, naming the
// nodes that hold it back.
func (s *Server) certRevokeAllowed(what string) error {
	if s.node.CommandVersion() >= fsm.CertRevokeVersion {
		return nil
	}
	var old []string
	for _, m := range s.node.Members() {
		if m.Suffrage == "" || m.CommandVersion >= fsm.CertRevokeVersion {
			continue
		}
		has := fmt.Sprintf("advertises command version %d", m.CommandVersion)
		if m.CommandVersion == 0 {
			has = "advertises no command version (a build before version 6, or not seen in gossip)"
		}
		old = append(old, "node "+m.ID+" "+has)
	}
	if len(old) == 0 {
		old = append(old, fmt.Sprintf("the cluster's command version is %d (a member not yet seen in gossip counts as an old build)", s.node.CommandVersion()))
	}
	return status.Errorf(codes.FailedPrecondition, "%s needs fsm command version %d on every node, and %s; upgrade those nodes first (docs/operations.md, Upgrades), then try again — nothing changed",
		what, fsm.CertRevokeVersion, strings.Join(old, "; "))
}

// revokeCertOp checks a request: exactly one of a fingerprint, a serial and a certificate.
func revokeCertOp(req *quotadv1.RevokeCertRequest) (*fsmv1.RevokeCert, error) {
	n := 0
	for _, set := range []bool{req.Sha256 != "", req.Serial != "", len(req.CertPem) > 0} {
		if set {
			n++
		}
	}
	if n != 1 {
		return nil, fmt.Errorf("name the certificate by exactly one of --cert FILE.pem (the certificate file), --fingerprint SHA256 (hex, as openssl x509 -noout -fingerprint -sha256 prints it) and --serial HEX (as openssl x509 -noout -serial prints it); got %d", n)
	}
	if len(req.Reason) > maxStringLen {
		return nil, fmt.Errorf("--reason is %d bytes; at most %d", len(req.Reason), maxStringLen)
	}
	op := &fsmv1.RevokeCert{Reason: req.Reason}
	switch {
	case req.Sha256 != "":
		h, err := auth.ParseFingerprint(req.Sha256)
		if err != nil {
			return nil, err
		}
		op.Sha256 = h[:]
	case req.Serial != "":
		sn, err := auth.ParseSerial(req.Serial)
		if err != nil {
			return nil, err
		}
		op.Serial = sn
	default:
		c, err := auth.ParseCertPEM(req.CertPem)
		if err != nil {
			return nil, err
		}
		k := auth.KeyOf(c)
		op.Sha256, op.SerialInfo, op.NotAfterUnixMs = k.SHA256[:], k.Serial, c.NotAfter.UnixMilli()
		op.Subject = clip(c.Subject.CommonName)
		if len(op.SerialInfo) > maxStringLen {
			op.SerialInfo = ""
		}
	}
	return op, nil
}

func revokedCertInfo(e fsm.RevokedCert) *quotadv1.RevokedCert {
	out := &quotadv1.RevokedCert{Serial: e.Serial, Subject: e.Subject, NotAfterUnixMs: e.NotAfter, RevokedBy: e.RevokedBy,
		RevokedUnixMs: e.RevokedAt, Reason: e.Reason, SerialInfo: e.SerialInfo}
	if e.HasSHA {
		out.Sha256 = fmt.Sprintf("%x", e.SHA256)
	}
	return out
}

// MaxRevokedCertsListBytes bounds a ListRevokedCerts answer: a full deny-list
// (fsm.MaxRevokedCerts entries of at most ~1.2 KB: fingerprint, serials, and subject,
// revoked_by and reason of up to 256 bytes each) is ~12 MB, above gRPC's default 4 MB
// receive cap, so whoever reads the answer (a follower forwarding it, quotad tls cert
// revoked) raises its cap to this for that call.
const MaxRevokedCertsListBytes = 32 << 20

// ListRevokedCerts lists the deny-list, linearizably (admin).
func (s *Server) ListRevokedCerts(ctx context.Context, req *quotadv1.ListRevokedCertsRequest) (*quotadv1.ListRevokedCertsResponse, error) {
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewAdminClient(conn).ListRevokedCerts(forwardCtx(ctx), req, grpc.MaxCallRecvMsgSize(MaxRevokedCertsListBytes))
	}
	if err := s.node.VerifyRead(ctx); err != nil {
		return nil, s.applyError(err)
	}
	resp := &quotadv1.ListRevokedCertsResponse{}
	for _, e := range s.fsm.RevokedCerts() {
		resp.Certs = append(resp.Certs, revokedCertInfo(e))
	}
	return resp, nil
}

// awaitCertRevoked waits (up to a second, or until ctx ends) until this node has applied the
// revoke op.
func (s *Server) awaitCertRevoked(ctx context.Context, op *fsmv1.RevokeCert) {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	t := time.NewTicker(2 * time.Millisecond)
	defer t.Stop()
	for {
		if _, ok := s.fsm.RevokedCertOf(op); ok {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// clip makes s a valid UTF-8 string of at most maxStringLen bytes (a certificate's common
// name is whatever its issuer wrote).
func clip(s string) string {
	if len(s) > maxStringLen {
		s = s[:maxStringLen]
	}
	return strings.ToValidUTF8(s, "")
}
