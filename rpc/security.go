package rpc

import (
	"context"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/quotad/quotad/auth"
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

// adminMethods change the cluster and need the admin token when one is configured. Reads
// (GetLimits, Members) stay open so monitoring needs no secret.
var adminMethods = map[string]bool{
	"/quotad.v1.Admin/ApplyLimits":        true,
	"/quotad.v1.Admin/TransferLeadership": true,
}

// authorizationHeader carries "Bearer <admin token>".
const authorizationHeader = "authorization"

// adminAuth returns an interceptor that refuses admin calls without the token.
func adminAuth(token string) grpc.UnaryServerInterceptor {
	want := []byte("Bearer " + token)
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if token == "" || !adminMethods[info.FullMethod] {
			return handler(ctx, req)
		}
		md, _ := metadata.FromIncomingContext(ctx)
		got := md.Get(authorizationHeader)
		if len(got) != 1 || subtle.ConstantTimeCompare([]byte(got[0]), want) != 1 {
			method := info.FullMethod[strings.LastIndex(info.FullMethod, "/")+1:]
			return nil, status.Errorf(codes.Unauthenticated, "%s needs the admin token: send metadata \"authorization: Bearer <token>\" (quotad ... --token-file, or $QUOTAD_TOKEN)", method)
		}
		return handler(ctx, req)
	}
}
