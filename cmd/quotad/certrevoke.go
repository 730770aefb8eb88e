package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/rpc"
)

// certRevokeCmds are `quotad tls cert revoke` and `quotad tls cert revoked` (admin).
func certRevokeCmds() []*cobra.Command {
	var addr, certFile, fingerprint, serial, reason string
	var force bool
	revoke := &cobra.Command{
		Use:   "revoke (--cert FILE.pem | --fingerprint SHA256 | --serial HEX)",
		Short: "Revoke one client (or node) certificate: every node refuses its calls once it applied the revoke, on open connections too (admin)",
		Long: `Revoke one certificate of the cluster's CA: it goes on the replicated deny-list, and every node
refuses the calls of a caller presenting it (gRPC and the HTTP debug endpoints), on connections
already open too. Its admissions waiting on the leader are answered UNAUTHENTICATED, its
AcquireStream ends, its share renewals are refused (a client.Limiter spends its grant in hand until
the grant ends, then admits nothing). Other certificates of the same CA are unaffected.

Name the certificate by exactly one of:
  --cert FILE.pem        the certificate file you issued (revoked by its SHA-256 fingerprint)
  --fingerprint SHA256   the SHA-256 of its DER, hex, colons allowed:
                         openssl x509 -noout -fingerprint -sha256 -in FILE.pem
  --serial HEX           its serial number in hex: openssl x509 -noout -serial -in FILE.pem
                         (refuses every certificate of the CA with that serial; digits
                         alone are refused as possibly decimal: write serial=… or 0x…)

A revoke is final (no un-revoke: issue a new certificate) and idempotent: revoking a certificate
already revoked changes nothing and says so. A snapshot restore keeps every revocation. Needs
fsm command version 8 on every node: on a cluster not yet upgraded it is refused, naming the nodes
to upgrade. Revoking a node certificate refuses it on the gRPC API (its forwarded calls too), not
on Raft: see docs/security.md. It is refused without --force when the leader can tell it is one (a
file with the server SAN, or a node certificate it has seen: its own or one a peer presented).`,
		Example: `  quotad tls cert revoke --cert gw1.pem --reason "key leaked in incident 42"
  quotad tls cert revoke --fingerprint 3F:9A:...:C1
  quotad tls cert revoke --serial serial=5E2F0C...`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			req := &quotadv1.RevokeCertRequest{Sha256: fingerprint, Serial: serial, Reason: reason, Force: force}
			if certFile != "" {
				b, err := os.ReadFile(certFile)
				if err != nil {
					return fmt.Errorf("--cert: %w (pass the certificate's PEM file, or name it with --fingerprint or --serial)", err)
				}
				req.CertPem = b
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 15*time.Second)
			defer cancel()
			return call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
				resp, err := quotadv1.NewAdminClient(conn).RevokeCert(ctx, req)
				if err != nil {
					return err
				}
				if resp.AlreadyRevoked {
					fmt.Printf("already revoked: %s (nothing changed)\n", describeRevoked(resp.Cert))
					return nil
				}
				fmt.Printf("revoked %s\n", describeRevoked(resp.Cert))
				fmt.Println("note: shares it holds are not taken back: a Limiter may spend its grant in hand until the grant ends\n" +
					"(the lease term; renewals are refused); concurrency leases it holds end at their TTL.")
				return nil
			})
		},
	}
	f := revoke.Flags()
	f.StringVar(&certFile, "cert", "", "the certificate's PEM file")
	f.StringVar(&fingerprint, "fingerprint", "", "the certificate's SHA-256 fingerprint (hex, colons allowed)")
	f.StringVar(&serial, "serial", "", "the certificate's serial number (hex, as openssl x509 -serial prints it)")
	f.StringVar(&reason, "reason", "", "why (shown by quotad tls cert revoked)")
	f.BoolVar(&force, "force", false, "revoke a node (server) certificate too (refused without it: the node's gRPC API and every call it forwards stop)")
	f.StringVar(&addr, "addr", defaultAddrs(), "comma-separated node gRPC addresses")

	var listAddr string
	var asJSON bool
	list := &cobra.Command{
		Use:   "revoked",
		Short: "List the revoked certificates: fingerprint or serial, subject, expiry, when and by whom (admin; linearizable)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), 10*time.Second)
			defer cancel()
			return call(ctx, listAddr, func(ctx context.Context, conn *grpc.ClientConn) error {
				resp, err := quotadv1.NewAdminClient(conn).ListRevokedCerts(ctx, &quotadv1.ListRevokedCertsRequest{}, grpc.MaxCallRecvMsgSize(rpc.MaxRevokedCertsListBytes))
				if err != nil {
					return err
				}
				if asJSON {
					out := resp.Certs
					if out == nil {
						out = []*quotadv1.RevokedCert{}
					}
					return printJSON(out)
				}
				fmt.Printf("%-72s  %-20s  %-20s  %-20s  %-16s  %s\n", "CERTIFICATE", "SUBJECT", "EXPIRES", "REVOKED", "BY", "REASON")
				for _, c := range resp.Certs {
					name := "sha256:" + c.Sha256
					if c.Sha256 == "" {
						name = "serial:" + c.Serial
					}
					fmt.Printf("%-72s  %-20s  %-20s  %-20s  %-16s  %s\n", name, orDash(c.Subject), msTime(c.NotAfterUnixMs), msTime(c.RevokedUnixMs), orDash(c.RevokedBy), c.Reason)
				}
				return nil
			})
		},
	}
	list.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	list.Flags().StringVar(&listAddr, "addr", defaultAddrs(), "comma-separated node gRPC addresses")
	return []*cobra.Command{revoke, list}
}

func describeRevoked(c *quotadv1.RevokedCert) string {
	if c == nil {
		return "the certificate"
	}
	s := "serial " + c.Serial
	if c.Sha256 != "" {
		s = "sha256:" + c.Sha256
		if c.SerialInfo != "" {
			s += " (serial " + c.SerialInfo + ")"
		}
	}
	if c.Subject != "" {
		s = fmt.Sprintf("%q %s", c.Subject, s)
	}
	if c.RevokedBy != "" {
		s += fmt.Sprintf(", revoked %s by %s", msTime(c.RevokedUnixMs), c.RevokedBy)
	}
	return s
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func msTime(ms int64) string {
	if ms == 0 {
		return "-"
	}
	return time.UnixMilli(ms).UTC().Format(time.RFC3339)
}
