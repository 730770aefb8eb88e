package main

import (
	"errors"
	"fmt"

	"github.com/spf13/pflag"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/region"
	"github.com/quotad/quotad/rpc"
)

// regionFlags make the agent a member of a regional cluster under a global one (issue 13,
// docs/regions.md). The credential for the global cluster comes from files, never from the
// command line.
type regionFlags struct {
	name, addrs                               string
	tokenFile, caFile, cert, key, clusterName string
	insecure, followLeader                    bool
}

func (r *regionFlags) register(f *pflag.FlagSet) {
	f.StringVar(&r.name, "region", "", "run as regional cluster NAME under the global cluster at --global-addrs: the leader holds shares of the scope: global levels (docs/regions.md)")
	f.StringVar(&r.addrs, "global-addrs", "", "comma-separated gRPC addresses of the global cluster's nodes (with --region)")
	f.StringVar(&r.tokenFile, "global-token-file", "", "file holding a worker token of the global cluster for the domains the region serves (quotad token create --role worker --domain '*'): the region follows their limits and holds shares of their global levels")
	f.StringVar(&r.caFile, "global-cacert", "", "PEM CA that signed the global cluster's node certificates")
	f.StringVar(&r.cert, "global-cert", "", "PEM client certificate for the global cluster (a worker role; instead of --global-token-file)")
	f.StringVar(&r.key, "global-key", "", "PEM key for --global-cert")
	f.StringVar(&r.clusterName, "global-cluster-name", rpc.DefaultClusterName, "the global cluster's --cluster-name: its nodes' certificates are verified for server.<name>.quotad")
	f.BoolVar(&r.followLeader, "global-follow-leader", true, "dial the global leader at the address it names (x-quotad-leader); false: only --global-addrs (a proxy or load balancer in front of the global cluster: its followers forward to the leader)")
	f.BoolVar(&r.insecure, "global-insecure", false, "the global cluster runs with --insecure (plaintext): a throwaway setup on a trusted network only")
}

func (r *regionFlags) apply(cfg *rpc.AgentConfig) error {
	if r.name == "" {
		if r.addrs != "" || r.tokenFile != "" || r.caFile != "" || r.cert != "" || r.key != "" || r.insecure || !r.followLeader {
			return errors.New("--global-addrs and the --global-* credential flags need --region NAME: add --region or remove them")
		}
		return nil
	}
	if err := region.CheckName(r.name); err != nil {
		return fmt.Errorf("--region: %w", err)
	}
	addrs := splitList(r.addrs)
	if len(addrs) == 0 {
		return fmt.Errorf("--region %s needs --global-addrs A,B,C: the gRPC addresses of the global cluster's nodes", r.name)
	}
	g := client.Config{Addrs: addrs, ConfiguredAddrsOnly: !r.followLeader, TokenFile: r.tokenFile, Insecure: r.insecure,
		TLSFiles: client.TLSFiles{CAFile: r.caFile, CertFile: r.cert, KeyFile: r.key}}
	switch {
	case r.insecure && (r.caFile != "" || r.cert != ""):
		return errors.New("--global-insecure cannot be combined with --global-cacert or --global-cert: the global cluster is either plaintext or TLS")
	case !r.insecure && r.caFile == "":
		return fmt.Errorf("--region %s needs --global-cacert (the CA of the global cluster's nodes) and a credential (--global-token-file, or --global-cert and --global-key); --global-insecure for a global cluster run with --insecure", r.name)
	case !r.insecure && r.tokenFile == "" && r.cert == "":
		return fmt.Errorf("--region %s needs a credential for the global cluster: --global-token-file FILE (a worker token for the domains the region serves) or --global-cert and --global-key", r.name)
	}
	if !r.insecure {
		g.TLSFiles.ServerName = auth.ServerName(r.clusterName)
	}
	// Read the files now (client.New connects lazily), so a bad one stops the start.
	c, err := client.New(g)
	if err != nil {
		return fmt.Errorf("--global-addrs/--global-*: %w", err)
	}
	c.Close()
	cfg.Region = region.Agent(r.name, g)
	return nil
}

// printRegion prints a regional cluster's shares of the global levels (quotad status).
func printRegion(name string, shares []*quotadv1.RegionShare) {
	if name == "" {
		return
	}
	fmt.Printf("region: %s (global levels: the leader's share of the global cluster's buckets)\n", name)
	if len(shares) == 0 {
		fmt.Println("  no global levels, or no leader holding shares yet")
	}
	for _, s := range shares {
		fmt.Printf("  %-24s %-9s rate=%.4g/s capacity=%.4g local=%v expires_in=%dms admitted=%d refused=%d",
			s.Path, s.Status, s.Rate, s.Capacity, s.Local, s.ExpiresInMs, s.Admitted, s.Refused)
		if s.Message != "" {
			fmt.Printf(" (%s)", s.Message)
		}
		fmt.Println()
	}
}
