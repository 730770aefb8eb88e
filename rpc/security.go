package rpc

import (
	"context"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/quota"
)

// TLSFiles names the PEM files of a node's TLS identity: its server certificate and key
// (carrying auth.ServerName of the cluster) and the cluster's CA. One identity serves gRPC and
// HTTP, dials the leader when forwarding, and secures Raft.
type TLSFiles struct {
	CertFile string
	KeyFile  string
	CAFile   string
}

// Enabled reports whether any file is set.
func (f TLSFiles) Enabled() bool { return f.CertFile != "" || f.KeyFile != "" || f.CAFile != "" }

// Load builds the server configuration (gRPC and HTTP: a client certificate is verified
// against the CA if the client sends one — callers may authenticate by token alone) and the
// client configuration for dialing other nodes (verifies their server SAN
// auth.ServerName(cluster)).
func (f TLSFiles) Load(cluster string) (server, client *tls.Config, err error) {
	if f.CertFile == "" || f.KeyFile == "" || f.CAFile == "" {
		return nil, nil, fmt.Errorf("TLS needs a certificate (--tls-cert %q), its key (--tls-key %q) and the cluster's CA (--tls-ca %q)", f.CertFile, f.KeyFile, f.CAFile)
	}
	cert, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("loading TLS certificate %q and key %q: %w", f.CertFile, f.KeyFile, err)
	}
	pem, err := os.ReadFile(f.CAFile)
	if err != nil {
		return nil, nil, fmt.Errorf("reading TLS CA %q: %w", f.CAFile, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, nil, fmt.Errorf("TLS CA %q holds no PEM certificate", f.CAFile)
	}
	if !auth.IsServerCert(cert.Leaf, cluster) {
		return nil, nil, fmt.Errorf("--tls-cert %q is not a server certificate of cluster %q (it lacks the DNS name %s); make one with `quotad tls cert create --server --cluster %s --name <node>`",
			f.CertFile, cluster, auth.ServerName(cluster), cluster)
	}
	server = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12,
		ClientCAs: pool, ClientAuth: tls.VerifyClientCertIfGiven}
	client = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12,
		RootCAs: pool, ServerName: auth.ServerName(cluster)}
	return server, client, nil
}

// Caller authentication (docs/security.md "Callers").
//
// Every gRPC call is mapped to an auth.Identity before its handler runs, then authorized by
// auth.Authorize (the method → role table in auth/policy.go):
//   - a bearer token, metadata "authorization: Bearer <token>": the bootstrap admin token
//     (AgentConfig.BootstrapTokenFile; each node keeps only its hash) or a token an admin
//     created (stored hashed in the replicated state);
//   - else a client certificate that verified against the cluster's CA, mapped by
//     auth.IdentityFromCert. If both are present the token wins: it is the more specific
//     credential (a gateway holding a certificate may call with a tenant's token).
//   - else, with AgentConfig.Insecure, the identity "insecure" with the admin role: --insecure
//     gives up authorization along with encryption.
//
// A follower forwards a call to the leader with the caller's identity: a token call with its
// authorization header (the leader authenticates it again), a certificate call with the
// identity in metadata auth.PrincipalHeader, which the leader believes only from a peer
// whose certificate carries the server role.

// authorizationHeader carries "Bearer <token>".
const authorizationHeader = "authorization"

// authenticator turns a call's credentials into an identity and authorizes it.
type authenticator struct {
	insecure bool
	cluster  string
	// bootstrap is the hash of the bootstrap admin token, if one is configured.
	bootstrap *[32]byte
	// token looks up a created token by hash (the FSM's table).
	token func(hash [32]byte) (auth.Identity, bool)
	// generation is the token table's generation (fsm.FSM.TokensGeneration): a call whose
	// token the tap looked up is looked up again by the interceptor only if it changed.
	// nil: always again.
	generation func() uint64
	// calls caps each identity's calls in flight on this node (--max-calls-per-identity);
	// nil: no cap.
	calls *callCounter
	// certRevoked reports whether a certificate is on the deny-list (fsm.FSM.CertRevoked),
	// anyCertRevoked whether any is, certGeneration the deny-list's generation (a call the
	// tap identified by its certificate is checked again by the interceptor only if it
	// changed). nil: no deny-list.
	certRevoked    func(auth.CertKey) bool
	anyCertRevoked func() bool
	certGeneration func() uint64
}

// tapped is what the tap found for a call, handed to the interceptors in its context so the
// token is hashed and looked up once per call.
type tapped struct {
	c caller
	// gen is the token table's generation before the tap looked the token up, certGen the
	// deny-list's.
	gen, certGen uint64
	// slot is the call's place in its identity's in-flight count (nil: not counted).
	slot *callSlot
}

type tappedKey struct{}

// end releases what the tap reserved for the call.
func (t *tapped) end() {
	if t != nil && t.slot != nil {
		t.slot.end()
	}
}

// caller is what the interceptor stores in a call's context.
type caller struct {
	id auth.Identity
	// viaToken: the identity came from the authorization header, which forwarding passes on.
	viaToken bool
}

type callerKey struct{}

// IdentityFrom returns the authenticated identity of the call whose context is ctx (the zero
// Identity if the call was not authenticated, e.g. an open method).
func IdentityFrom(ctx context.Context) auth.Identity {
	c, _ := ctx.Value(callerKey{}).(caller)
	return c.id
}

func callerFrom(ctx context.Context) caller {
	c, _ := ctx.Value(callerKey{}).(caller)
	return c
}

// insecureIdentity is the name of every caller without a credential of an agent run with
// --insecure: one name for everyone, so not an identity to count anything by.
const insecureIdentity = "insecure"

// identify authenticates a call. An error is a gRPC status (Unauthenticated).
func (a *authenticator) identify(ctx context.Context, method string) (caller, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if vals := md.Get(authorizationHeader); len(vals) > 0 {
		id, err := a.fromToken(vals, method)
		return caller{id: id, viaToken: true}, err
	}
	if cert, key := verifiedPeerCert(ctx); cert != nil {
		// Revoked first: a revoked server certificate forwards no one.
		if a.certRevoked != nil && a.certRevoked(key) {
			return caller{}, revokedCertError(method, cert.Subject.CommonName, key)
		}
		id, err := auth.IdentityFromCert(cert, a.cluster)
		if err != nil {
			return caller{}, status.Errorf(codes.Unauthenticated, "%s: the client certificate (subject %q) carries no quotad role for cluster %q; issue it with quotad tls cert create --client --role ... or send a bearer token", method, cert.Subject.CommonName, a.cluster)
		}
		if id.Role == auth.RoleServer {
			if p := md.Get(auth.PrincipalHeader); len(p) == 1 {
				// A peer forwarding its caller's call: only a server certificate may say
				// who the caller is.
				fwd, err := auth.DecodePrincipal(p[0])
				if err != nil {
					return caller{}, status.Errorf(codes.Unauthenticated, "%s: server %s forwarded a bad principal: %v", method, id.Name, err)
				}
				if err := a.checkPrincipalCert(method, id.Name, fwd); err != nil {
					return caller{}, err
				}
				return caller{id: fwd}, nil
			}
		}
		id.Cert = key
		return caller{id: id}, nil
	}
	if a.insecure {
		return caller{id: auth.Identity{Name: insecureIdentity, Role: auth.RoleAdmin}}, nil
	}
	return caller{}, nil // Authorize says what to send
}

// fromToken authenticates a bearer token.
func (a *authenticator) fromToken(vals []string, method string) (auth.Identity, error) {
	scheme, tok, _ := strings.Cut(vals[0], " ")
	tok = strings.TrimSpace(tok)
	if len(vals) != 1 || !strings.EqualFold(scheme, "bearer") || tok == "" {
		return auth.Identity{}, status.Errorf(codes.Unauthenticated, "%s: metadata %q must be one value \"Bearer <token>\"", method, authorizationHeader)
	}
	h := auth.HashToken(tok)
	if hook := tokenHashHook.Load(); hook != nil {
		(*hook)()
	}
	if a.bootstrap != nil && subtle.ConstantTimeCompare(h[:], a.bootstrap[:]) == 1 {
		return auth.Identity{Name: "bootstrap", Role: auth.RoleAdmin}, nil
	}
	if a.token != nil {
		if id, ok := a.token(h); ok {
			return id, nil
		}
	}
	which := "the bearer token"
	if acc, err := auth.TokenAccessor(tok); err == nil {
		which += " with accessor " + acc
	}
	return auth.Identity{}, status.Errorf(codes.Unauthenticated, "%s: %s is not known to this cluster: revoked, mistyped, or from another cluster; ask an admin for a token (quotad token create)", method, which)
}

// tokenHashHook, if set, is called each time a bearer token is hashed (tests count them).
var tokenHashHook atomic.Pointer[func()]

// authorize authenticates and authorizes one call and returns the context its handler gets.
// t is what the tap found (nil: nothing, e.g. a Server without an agent): its identity is
// used unless the table its credential was checked against (tokens, or the certificate
// deny-list) changed since (a revoke between the call's headers and its message is not
// missed).
func (a *authenticator) authorize(ctx context.Context, t *tapped, fullMethod string) (context.Context, error) {
	if auth.AccessOf(fullMethod).Open {
		return ctx, nil
	}
	var c caller
	if t != nil && a.unchangedSince(t) {
		c = t.c
	} else {
		var err error
		if c, err = a.identify(ctx, auth.MethodName(fullMethod)); err != nil {
			return nil, err
		}
	}
	if err := auth.Authorize(c.id, fullMethod); err != nil {
		code := codes.PermissionDenied
		if errors.Is(err, auth.ErrUnauthenticated) {
			code = codes.Unauthenticated
		}
		return nil, status.Error(code, err.Error())
	}
	return context.WithValue(ctx, callerKey{}, c), nil
}

// tap authenticates a call before grpc-go starts its stream (grpc.InTapHandle: it sees the
// headers, not the message) and refuses it unless the method is open or the call carries a
// credential: a bearer token this node knows, or a client certificate the TLS handshake
// verified. Who may call what is still decided by the interceptors, after the message, with
// the identity the tap found (tapped). Without it a caller with no credential could open
// streams that send headers and never a message: each held a goroutine and ~12 KB until the
// connection closed, 32,768 per connection and connections are not capped (30,000 such
// streams took a make-run node from 48 to 396 MB). A caller with a credential can do the
// same, so the tap also counts each identity's calls in flight (callCounter,
// --max-calls-per-identity) and refuses one beyond the cap; calls to open methods are
// bounded per source address and in total by ending the oldest (MaxOpenCallsPerAddress). It runs on the connection's
// reader goroutine: a SHA-256, a map lookup and a counter under a mutex.
func (a *authenticator) tap(ctx context.Context, info *tap.Info) (context.Context, error) {
	if auth.AccessOf(info.FullMethodName).Open {
		// No credential needed: bounded by source address and in total (MaxOpenCallsPerAddress).
		if a.calls == nil {
			return ctx, nil
		}
		ctx, slot := a.calls.takeOpen(ctx)
		return context.WithValue(ctx, tappedKey{}, &tapped{slot: slot}), nil
	}
	var gen, certGen uint64
	if a.generation != nil {
		gen = a.generation() // before the lookup: a revoke after it changes the generation
	}
	if a.certGeneration != nil {
		certGen = a.certGeneration()
	}
	method := auth.MethodName(info.FullMethodName)
	c, err := a.identify(ctx, method)
	if err != nil {
		return nil, err
	}
	if c.id.IsZero() {
		return nil, status.Error(codes.Unauthenticated, auth.Authorize(auth.Identity{}, info.FullMethodName).Error())
	}
	t := &tapped{c: c, gen: gen, certGen: certGen}
	if a.calls != nil && counted(c.id) {
		if t.slot, err = a.calls.take(ctx, c.id.Name, method); err != nil {
			return nil, err
		}
	}
	return context.WithValue(ctx, tappedKey{}, t), nil
}

// unchangedSince reports whether what the tap found for a call still holds: its token table,
// or its certificate deny-list, is the one the tap checked.
func (a *authenticator) unchangedSince(t *tapped) bool {
	if t.c.viaToken {
		return a.generation != nil && a.generation() == t.gen
	}
	return a.certGeneration == nil || a.certGeneration() == t.certGen
}

func (a *authenticator) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	t, _ := ctx.Value(tappedKey{}).(*tapped)
	ctx, err := a.authorize(ctx, t, info.FullMethod)
	// Its request has arrived: a unary call leaves its identity's in-flight count here. The
	// count bounds calls that hold a node without a message (headers only); what a call
	// holds from here is its method's to bound (a waiting Acquire by the waiter caps). Counted
	// to its end, one identity's legitimate unary waits — on a regional node, with streams
	// off, or forwarded by followers — were refused at the cap beside the waiter caps.
	t.end()
	if err != nil {
		return nil, err
	}
	return handler(ctx, req)
}

func (a *authenticator) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	t, _ := ss.Context().Value(tappedKey{}).(*tapped)
	defer t.end()
	ctx, err := a.authorize(ss.Context(), t, info.FullMethod)
	if err != nil {
		return err
	}
	return handler(srv, &identifiedStream{ServerStream: ss, ctx: ctx})
}

type identifiedStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *identifiedStream) Context() context.Context { return s.ctx }

// permissionDenied is the error of a call whose identity may not act on what it names.
func permissionDenied(format string, args ...any) error {
	return status.Errorf(codes.PermissionDenied, format, args...)
}

// tenantPathProblem refuses a tenant-bound worker's descriptors that the domain's limits do
// not match entry by entry. The native walk stops at the first entry that matches nothing and
// charges nothing after it (Envoy's rule gives such a descriptor no limit at all), so an
// unmatched entry before tenant=<its tenant> would skip the tenant's own limit: a worker bound
// to one tenant could spend the whole shared ceiling. Workers that may act for any tenant
// (gateways) keep the native rule. The node's current matcher decides; an unknown domain is
// left to the decision.
func (s *Server) tenantPathProblem(id auth.Identity, domain string, ds []*quotadv1.Entry) string {
	if id.Role != auth.RoleWorker || id.Tenant == "" {
		return "" // the common case: no matcher read on the spend path
	}
	m := s.fsm.Matcher()
	entries := make([]quota.Entry, len(ds))
	for i, e := range ds {
		entries[i] = quota.Entry{Key: e.GetKey(), Value: e.GetValue()}
	}
	nodes, ok := m.Path(domain, entries)
	if !ok || len(nodes) == len(entries) {
		return ""
	}
	e := entries[len(nodes)]
	return fmt.Sprintf("%s: descriptor %.60s=%.60q matches no limit of domain %q at position %d, which would skip the levels after it; a worker bound to a tenant must send a path the domain's limits define",
		id, e.Key, e.Value, domain, len(nodes))
}

// scopeProblem says why id may not act in domain on a path with descriptors ds, or "". A
// tenant-scoped worker may only name its own tenant, and when it spends (spend) it must name
// it: without a tenant entry it would spend the shared quota of every tenant.
func scopeProblem(id auth.Identity, domain string, ds []*quotadv1.Entry, spend bool) string {
	if !id.MayUseDomain(domain) {
		return fmt.Sprintf("%s may not use domain %q", id, domain)
	}
	if id.Role != auth.RoleWorker || id.Tenant == "" {
		return ""
	}
	named := false
	for _, e := range ds {
		if e.GetKey() != auth.TenantKey {
			continue
		}
		if !id.MayActForTenant(e.GetValue()) {
			return fmt.Sprintf("%s may act only for %s=%s, not %s=%.60q", id, auth.TenantKey, id.Tenant, auth.TenantKey, e.GetValue())
		}
		named = true
	}
	if spend && !named {
		return fmt.Sprintf("%s must name its tenant: add the descriptor %s=%s", id, auth.TenantKey, id.Tenant)
	}
	return ""
}
