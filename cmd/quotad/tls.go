package main

import (
	"fmt"
	"net"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/rpc"
)

func tlsCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "tls", Short: "Make the cluster's CA and its node and client certificates"}
	ca := &cobra.Command{Use: "ca", Short: "The cluster's certificate authority"}
	cert := &cobra.Command{Use: "cert", Short: "Node and client certificates: create, revoke, list the revoked"}
	ca.AddCommand(caCreateCmd())
	cert.AddCommand(certCreateCmd())
	cert.AddCommand(certRevokeCmds()...)
	cmd.AddCommand(ca, cert)
	return cmd
}

func caCreateCmd() *cobra.Command {
	var (
		cluster, dir string
		validity     time.Duration
	)
	cmd := &cobra.Command{
		Use:   "create",
		Short: "Create a CA: " + pkifiles.CAFile + " and " + pkifiles.CAKeyFile + " (keep the key off the nodes)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, k, err := pkifiles.CreateCA(dir, cluster, validity)
			if err != nil {
				return err
			}
			fmt.Printf("wrote %s\nwrote %s (secret: it signs every credential of cluster %q)\n", c, k, cluster)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&cluster, "cluster", rpc.DefaultClusterName, "cluster name (the agents' --cluster-name)")
	f.StringVar(&dir, "dir", ".", "directory to write the files to")
	f.DurationVar(&validity, "validity", auth.DefaultCAValidity, "how long the CA is valid")
	return cmd
}

func certCreateCmd() *cobra.Command {
	var (
		server, client          bool
		cluster, dir, name      string
		caFile, caKeyFile, role string
		tenant                  string
		dns, domains            []string
		ips                     []net.IP
		validity                time.Duration
	)
	cmd := &cobra.Command{
		Use:   "create",
		Short: "Create a node (--server) or client (--client) certificate signed by the CA: <name>.pem, <name>-key.pem",
		Long: `Create a certificate signed by the cluster's CA.

  --server --name node1 [--dns host] [--ip addr]   a node: serves the API and speaks Raft
                                                   (carries server.<cluster>.quotad; valid for
                                                   localhost and 127.0.0.1 unless --dns/--ip)
  --client --name alice --role worker --domain provider [--tenant acme]
  --client --name ops --role admin                 a caller with a role (admin, worker, reader)`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if server == client {
				return fmt.Errorf("give exactly one of --server (a node) or --client (a caller)")
			}
			opts := auth.CertOptions{Server: server, Cluster: cluster, Name: name, DNSNames: dns, IPs: ips, Validity: validity}
			if client {
				if cmd.Flags().Changed("dns") || cmd.Flags().Changed("ip") {
					return fmt.Errorf("--dns and --ip are for --server certificates")
				}
				r, err := auth.ParseRole(role)
				if err != nil {
					return fmt.Errorf("--role: %v", err)
				}
				if err := checkTenantFlag(cmd, tenant, "no certificate was written"); err != nil {
					return err
				}
				opts.Identity = auth.Identity{Role: r, Domains: domains, Tenant: tenant}
			} else if cmd.Flags().Changed("role") || len(domains) > 0 || cmd.Flags().Changed("tenant") {
				return fmt.Errorf("--role, --domain and --tenant are for --client certificates")
			}
			if caFile == "" {
				caFile = filepath.Join(dir, pkifiles.CAFile)
			}
			if caKeyFile == "" {
				caKeyFile = filepath.Join(dir, pkifiles.CAKeyFile)
			}
			c, k, err := pkifiles.CreateCert(dir, caFile, caKeyFile, opts)
			if err != nil {
				return err
			}
			fmt.Printf("wrote %s\nwrote %s\n", c, k)
			return nil
		},
	}
	f := cmd.Flags()
	f.BoolVar(&server, "server", false, "a node certificate")
	f.BoolVar(&client, "client", false, "a client certificate")
	f.StringVar(&name, "name", "", "node ID or client name: the certificate's common name and file name (required)")
	f.StringVar(&cluster, "cluster", rpc.DefaultClusterName, "cluster name (the agents' --cluster-name)")
	f.StringVar(&dir, "dir", ".", "directory to write the files to (and to find the CA in)")
	f.StringVar(&caFile, "ca", "", "CA certificate (default <dir>/"+pkifiles.CAFile+")")
	f.StringVar(&caKeyFile, "ca-key", "", "CA key (default <dir>/"+pkifiles.CAKeyFile+")")
	f.StringSliceVar(&dns, "dns", nil, "--server: host names clients dial the node by (repeatable; default localhost)")
	f.IPSliceVar(&ips, "ip", nil, "--server: IP addresses clients dial the node by (repeatable; default 127.0.0.1)")
	f.StringVar(&role, "role", "", "--client: admin, worker or reader")
	f.StringSliceVar(&domains, "domain", nil, "--client --role worker: domains it may spend in (repeatable; \"*\" for all)")
	f.StringVar(&tenant, "tenant", "", "--client --role worker: the only tenant it may act for (default: any)")
	f.DurationVar(&validity, "validity", auth.DefaultCertValidity, "how long the certificate is valid")
	return cmd
}

func keygenCmd() *cobra.Command {
	var (
		token bool
		out   string
	)
	cmd := &cobra.Command{
		Use:   "keygen",
		Short: "Print a new base64 gossip encryption key (or, with --token, a bootstrap admin token)",
		Long: `Print a new random base64 32-byte gossip encryption key for --gossip-key-file
(quotad keygen --out gossip.key; the same key on every node). With --token make a new
bootstrap admin token for --bootstrap-token-file instead.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var s string
			var err error
			if token {
				s, _, err = auth.NewToken()
			} else {
				s, err = auth.NewGossipKey()
			}
			if err != nil {
				return err
			}
			if out != "" {
				if err := auth.WriteSecretFile(out, []byte(s+"\n")); err != nil {
					return err
				}
				fmt.Printf("wrote %s\n", out)
				return nil
			}
			fmt.Println(s)
			return nil
		},
	}
	cmd.Flags().BoolVar(&token, "token", false, "a bootstrap admin token instead of a gossip key")
	cmd.Flags().StringVarP(&out, "out", "o", "", "write it to this new file (mode 0600) instead of printing it")
	return cmd
}
