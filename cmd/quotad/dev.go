package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/config"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/quota"
	"github.com/quotad/quotad/rpc"
)

func devCmd() *cobra.Command {
	var (
		nodes    int
		limits   string
		dataDir  string
		host     string
		base     int
		insecure bool
		regions  int
	)
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run a local cluster of separate agent processes (Ctrl-C stops them all)",
		Long: `Run a local cluster of separate agent processes. It makes a throwaway CA, a certificate per
node, an admin client certificate, a gossip key and a bootstrap admin token in
DATA_DIR/credentials, starts the nodes in secure mode with them (and --enable-debug), and writes
DATA_DIR/dev.env: source it to point the quotad CLI and the examples at the cluster as admin.
It prints each node's pid (also in DATA_DIR/NODE.pid). When a node exits (kill -9 it to see
a failover), press Enter in the dev terminal or send the dev process SIGHUP to restart the nodes
that exited, with the same command line and data. dev keeps running while any node runs, and
until Ctrl-C (SIGINT/SIGTERM), which stops all nodes and removes DATA_DIR if dev made it (a temp
dir; a --data-dir you give is kept).`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if nodes < 1 || nodes > 9 {
				return fmt.Errorf("--nodes %d: use 1 to 9", nodes)
			}
			if regions < 0 || regions > 8 {
				return fmt.Errorf("--regions %d: use 0 to 8", regions)
			}
			if regions > 0 && !cmd.Flags().Changed("limits") {
				limits = "examples/regions.yaml" // a scope: global level to hold shares of
			}
			example := ""
			if limits != "" {
				l, err := config.LoadFile(limits)
				if err != nil {
					return err
				}
				example = devAcquireExample(l)
			}
			// Every port before anything starts: a node that finds its port busy exits after
			// dev printed that the cluster is up.
			if err := devPortsFree(host, base, nodes, regions); err != nil {
				return err
			}
			tempDir := dataDir == ""
			if tempDir {
				d, err := os.MkdirTemp("", "quotad-dev-")
				if err != nil {
					return err
				}
				dataDir = d
			}
			dataDir, err := filepath.Abs(dataDir)
			if err != nil {
				return err
			}
			// cleanup removes the data dir if dev made it (never a --data-dir the user gave).
			cleanup := func() {
				if tempDir {
					if err := os.RemoveAll(dataDir); err == nil {
						fmt.Fprintf(os.Stderr, "removed %s\n", dataDir)
					}
				}
			}
			self, err := os.Executable()
			if err != nil {
				return err
			}
			addr := func(kind, i int) string { return fmt.Sprintf("%s:%d", host, base+kind*100+i+1) }
			var gossip, grpcs []string
			for i := 0; i < nodes; i++ {
				gossip = append(gossip, addr(2, i))
				grpcs = append(grpcs, addr(0, i))
			}
			// A throwaway PKI, gossip key and bootstrap admin token in the data dir, and the
			// client settings for them in dev.env.
			var creds *pkifiles.Local
			envFile := filepath.Join(dataDir, "dev.env")
			if !insecure {
				if creds, err = pkifiles.EnsureLocal(filepath.Join(dataDir, "credentials"), rpc.DefaultClusterName); err != nil {
					cleanup()
					return fmt.Errorf("making the dev credentials: %w", err)
				}
				// QUOTAD_DEV_DIR: where the nodes' pid files are (kill -9 $(cat $QUOTAD_DEV_DIR/node2.pid)).
				devDir := "export QUOTAD_DEV_DIR='" + strings.ReplaceAll(dataDir, "'", `'\''`) + "'\n"
				if err := writeDevEnv(envFile, creds.Env(grpcs)+devDir); err != nil {
					cleanup()
					return err
				}
			}
			var nodeArgs [][]string
			for i := 0; i < nodes; i++ {
				id := fmt.Sprintf("node%d", i+1)
				args := []string{"agent", "--id", id,
					"--data-dir", filepath.Join(dataDir, id),
					"--grpc-addr", addr(0, i), "--raft-addr", addr(1, i),
					"--gossip-addr", addr(2, i), "--http-addr", addr(3, i),
					"--bootstrap-expect", fmt.Sprint(nodes), "--join", strings.Join(gossip, ","),
				}
				if limits != "" {
					args = append(args, "--limits", limits)
				}
				args = append(args, "--enable-debug")
				if insecure {
					args = append(args, "--insecure")
				} else {
					sec, err := creds.AgentArgs(id, host)
					if err != nil {
						return err
					}
					args = append(args, sec...)
				}
				nodeArgs = append(nodeArgs, args)
			}
			// --regions N: N regional clusters of --nodes nodes each under the one above
			// (docs/regions.md), region k (1..N) on the ports of the global one + 1000·k.
			type regionInfo struct {
				name  string
				grpcs []string
			}
			var regionList []regionInfo
			for k := 1; k <= regions; k++ {
				rb := base + 1000*k
				raddr := func(kind, i int) string { return fmt.Sprintf("%s:%d", host, rb+kind*100+i+1) }
				ri := regionInfo{name: fmt.Sprintf("r%d", k)}
				var rgossip []string
				for i := 0; i < nodes; i++ {
					rgossip = append(rgossip, raddr(2, i))
					ri.grpcs = append(ri.grpcs, raddr(0, i))
				}
				for i := 0; i < nodes; i++ {
					id := fmt.Sprintf("%s-node%d", ri.name, i+1)
					args := []string{"agent", "--id", id,
						"--data-dir", filepath.Join(dataDir, id),
						"--grpc-addr", raddr(0, i), "--raft-addr", raddr(1, i),
						"--gossip-addr", raddr(2, i), "--http-addr", raddr(3, i),
						"--bootstrap-expect", fmt.Sprint(nodes), "--join", strings.Join(rgossip, ","),
						"--limits", limits, "--enable-debug",
						"--region", ri.name, "--global-addrs", strings.Join(grpcs, ","),
					}
					if insecure {
						args = append(args, "--insecure", "--global-insecure")
					} else {
						// Each region is a cluster of its own: its own CA and cluster name, so
						// its nodes hold no server certificate of the global cluster (which
						// would make them its peers) and vice versa.
						rcreds, err := pkifiles.EnsureLocal(filepath.Join(dataDir, "credentials-"+ri.name), ri.name)
						if err != nil {
							return err
						}
						if err := writeDevEnv(filepath.Join(dataDir, "dev-"+ri.name+".env"), rcreds.Env(ri.grpcs)); err != nil {
							return err
						}
						sec, err := rcreds.AgentArgs(id, host)
						if err != nil {
							return err
						}
						// dev only: the regional leaders use the bootstrap admin token of the
						// global cluster; in production a worker token scoped to the domains.
						args = append(args, sec...)
						args = append(args, "--global-cacert", creds.CAFile, "--global-token-file", creds.TokenFile)
					}
					nodeArgs = append(nodeArgs, args)
				}
				regionList = append(regionList, ri)
			}
			dc := newDevCluster(self, dataDir, nodeArgs)
			for i := range nodeArgs {
				if err := dc.start(i); err != nil {
					dc.stopAll()
					cleanup()
					return err
				}
				n := dc.nodes[i]
				a := nodeArgs[i]
				fmt.Printf("%s  pid %d  grpc %s  raft %s  gossip %s  http %s  data %s\n", n.id, n.pid(), argOf(a, "--grpc-addr"), argOf(a, "--raft-addr"), argOf(a, "--gossip-addr"), argOf(a, "--http-addr"), filepath.Join(dataDir, n.id))
			}
			for _, r := range regionList {
				if insecure {
					fmt.Printf("region %s: QUOTAD_ADDR=%s quotad status   (shows the region's share of each global level)\n", r.name, strings.Join(r.grpcs, ","))
				} else {
					fmt.Printf("region %s (its own CA and cluster name %q): source %s; quotad status   (shows the region's share of each global level)\n",
						r.name, r.name, filepath.Join(dataDir, "dev-"+r.name+".env"))
				}
			}
			if insecure {
				fmt.Printf("\ninsecure cluster of %d (plaintext, no credentials needed): try\n  export QUOTAD_ADDR=%s\n  quotad status\n",
					nodes, strings.Join(grpcs, ","))
			} else {
				fmt.Printf("\ncluster of %d (TLS; credentials in %s): in another shell\n  source %s\n  quotad status\n",
					nodes, creds.Dir, envFile)
				if example != "" {
					fmt.Printf("  %s\n", example)
				}
			}
			fmt.Printf("Each node's pid is in %s/NODE.pid ($QUOTAD_DEV_DIR after sourcing dev.env): kill -9 $(cat $QUOTAD_DEV_DIR/node1.pid) crashes node1.\n", dataDir)
			fmt.Printf("Press Enter here (or kill -HUP %d) to restart the nodes that exited; Ctrl-C stops all nodes", os.Getpid())
			if tempDir {
				fmt.Printf(" and removes %s (a temp dir; give --data-dir to keep the data).\n\n", dataDir)
			} else {
				fmt.Printf(" (data stays in %s).\n\n", dataDir)
			}
			err = dc.run()
			cleanup()
			return err
		},
	}
	f := cmd.Flags()
	f.IntVar(&nodes, "nodes", 3, "number of agent processes")
	f.StringVar(&limits, "limits", "examples/limits.yaml", "limits file applied at first start")
	f.StringVar(&dataDir, "data-dir", "", "parent directory for the nodes' data (default: a new temp dir)")
	f.StringVar(&host, "host", "127.0.0.1", "address the nodes listen on")
	f.BoolVar(&insecure, "insecure", false, "run the nodes with --insecure (plaintext, no credentials) instead of with a throwaway CA, gossip key and admin token")
	f.IntVar(&base, "port-base", 7100, "node i listens on grpc base+1+i, raft base+101+i, gossip base+201+i, http base+301+i")
	f.IntVar(&regions, "regions", 0, "also start N regional clusters of --nodes nodes under this (global) one, region k on the global ports + 1000·k, with examples/regions.yaml unless --limits is given (docs/regions.md)")
	return cmd
}

func prefixLines(w io.Writer, r io.Reader, prefix string) {
	s := bufio.NewScanner(r)
	s.Buffer(make([]byte, 64*1024), 1024*1024)
	for s.Scan() {
		fmt.Fprintf(w, "[%s] %s\n", prefix, s.Text())
	}
}

// writeDevEnv (re)writes the dev.env file, readable by its owner only (it holds the token).
func writeDevEnv(path, content string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return auth.WriteSecretFile(path, []byte("# quotad dev: source this file to use the local cluster as admin\n"+content))
}

// argOf returns the value after flag in args ("" if absent).
func argOf(args []string, flag string) string {
	for i := 0; i+1 < len(args); i++ {
		if args[i] == flag {
			return args[i+1]
		}
	}
	return ""
}

// devAcquireExample is the acquire line dev prints: the README tour's when the limits define
// its provider domain, else one in the file's first domain (the tour's line answered
// unknown_domain under quotad dev --regions, whose examples/regions.yaml has only platform).
func devAcquireExample(l *quota.Limits) string {
	for _, d := range l.Domains {
		if d.Name == "provider" {
			return "quotad acquire --domain provider --descriptor endpoint=charges"
		}
	}
	if len(l.Domains) == 0 {
		return ""
	}
	d := l.Domains[0]
	line := "quotad acquire --domain " + d.Name
	if len(d.Descriptors) > 0 {
		n := d.Descriptors[0]
		v := n.Value
		if v == "" {
			v = "example"
		}
		line += " --descriptor " + n.Key + "=" + v
	}
	return line
}
