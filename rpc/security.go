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
)

// TLSFiles names the PEM files of a node's TLS identity. With CAFile set, the node also
// requires and verifies client certificates (mutual TLS) and verifies the leader's certificate
// when it forwards calls.
type TLSFiles struct {
	CertFile string
	KeyFile  string
	CAFile   string
}

// Enabled reports whether any file is set.
func (f TLSFiles) Enabled() bool { return f.CertFile != "" || f.KeyFile != "" || f.CAFile != "" }

// Load builds the server and client (for forwarding) TLS configurations.
func (f TLSFiles) Load() (server, client *tls.Config, err error) {
	if f.CertFile == "" || f.KeyFile == "" {
		return nil, nil, fmt.Errorf("TLS needs both a certificate (%q) and a key (%q)", f.CertFile, f.KeyFile)
	}
	cert, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("loading TLS certificate %q and key %q: %w", f.CertFile, f.KeyFile, err)
	}
	server = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	client = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if f.CAFile != "" {
		pem, err := os.ReadFile(f.CAFile)
		if err != nil {
			return nil, nil, fmt.Errorf("reading TLS CA %q: %w", f.CAFile, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, nil, fmt.Errorf("TLS CA %q holds no PEM certificate", f.CAFile)
		}
		server.ClientCAs = pool
		server.ClientAuth = tls.RequireAndVerifyClientCert
		client.RootCAs = pool
	}
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
			return nil, status.Errorf(codes.Unauthenticated, "%s needs the admin token: send metadata \"authorization: Bearer <token>\" (quotad ... --admin-token)", method)
		}
		return handler(ctx, req)
	}
}
