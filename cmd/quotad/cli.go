package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/client"
)

// Connection settings of the client commands (persistent flags; the environment fills what
// they leave empty: client.Config.LoadEnv).
var (
	cliTLS       client.TLSFiles
	cliTokenFile string
)

// defaultAddrs is the --addr default: $QUOTAD_ADDR, else the nodes of `quotad dev`.
func defaultAddrs() string {
	if a := os.Getenv(client.EnvAddr); a != "" {
		return a
	}
	return "127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103"
}

// connConfig is the client configuration of the client commands for addrs: flags, then the
// environment.
func connConfig(addrs string) client.Config {
	cfg := client.DefaultConfig(splitList(addrs)...)
	cfg.TLSFiles, cfg.TokenFile = cliTLS, cliTokenFile
	cfg.LoadEnv()
	return cfg
}

func dialOptions() ([]grpc.DialOption, error) { return connConfig("").DialCredentials() }

// newClient returns a client library instance for the quota commands (leader discovery,
// retries with one request ID, backoff).
func newClient(addrs string) (*client.Client, error) {
	cfg := connConfig(addrs)
	cfg.Batch.Disabled = true // one decision per invocation: nothing to batch
	return client.New(cfg)
}

// call runs fn against each address in turn until one gives an answer that is not
// "unavailable" (fn must be idempotent: acquire reuses one request ID for every try).
func call(ctx context.Context, addrs string, fn func(ctx context.Context, conn *grpc.ClientConn) error) error {
	list := splitList(addrs)
	if len(list) == 0 {
		return fmt.Errorf("--addr is empty: give one or more node gRPC addresses, e.g. 127.0.0.1:7101,127.0.0.1:7102")
	}
	opts, err := dialOptions()
	if err != nil {
		return err
	}
	var last error
	for attempt := 0; ; attempt++ {
		for _, a := range list {
			conn, err := grpc.NewClient(a, opts...)
			if err != nil {
				return fmt.Errorf("--addr %q: %w", a, err)
			}
			cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			err = fn(cctx, conn)
			cancel()
			conn.Close()
			if err == nil {
				return nil
			}
			code := status.Code(err)
			if code != codes.Unavailable && code != codes.DeadlineExceeded {
				return err
			}
			last = fmt.Errorf("%s: %w", a, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("no node answered in time: %w%s", last, plaintextHint())
		case <-time.After(time.Duration(100*(attempt+1)) * time.Millisecond):
		}
	}
}

// plaintextHint explains the likely cause of unanswered plaintext calls: a secure cluster.
func plaintextHint() string {
	if tlsCfg, err := connConfig("").TLSConfig(); err == nil && tlsCfg == nil {
		return "\n(no TLS configured: a secure cluster needs the CA that signed its certificates, --cacert or $QUOTAD_CACERT; for `quotad dev`, source DATA_DIR/dev.env)"
	}
	return ""
}

// decisionView prints a client.Decision in the API's millisecond units (rounded up, so a
// caller that waits retry_after_ms is never early).
type decisionView struct{ client.Decision }

func (d decisionView) ResetAfterMs() int64 { return ceilMs(d.ResetAfter) }
func (d decisionView) RetryAfterMs() int64 { return ceilMs(d.RetryAfter) }

func ceilMs(d time.Duration) int64 { return int64((d + time.Millisecond - 1) / time.Millisecond) }

func printJSON(v any) error {
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func acquireCmd() *cobra.Command {
	var (
		addr, domain string
		descs        []string
		cost         uint64
		leaseTTL     time.Duration
		asJSON       bool
		timeout      time.Duration
	)
	cmd := &cobra.Command{
		Use:   "acquire",
		Short: "Ask for quota once: exit 0 if admitted, 3 if denied",
		RunE: func(cmd *cobra.Command, _ []string) error {
			req := client.Request{Domain: domain, Cost: cost, LeaseTTL: leaseTTL, Attempt: 1}
			for _, d := range descs {
				k, v, ok := strings.Cut(d, "=")
				if !ok || k == "" {
					return fmt.Errorf("--descriptor %q: use key=value, e.g. --descriptor tenant=acme", d)
				}
				req.Descriptors = append(req.Descriptors, client.Entry{Key: k, Value: v})
			}
			c, err := newClient(addr)
			if err != nil {
				return err
			}
			defer c.Close()
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			dec, err := c.Allow(ctx, req)
			if err != nil && !errors.Is(err, client.ErrDenied) {
				if errors.Is(err, client.ErrUnavailable) {
					return fmt.Errorf("%w%s", err, plaintextHint())
				}
				return err
			}
			err = nil // a denial is an answer: printed below, exit code 3
			d := decisionView{dec}
			if asJSON {
				err = printJSON(map[string]any{
					"admitted": d.Admitted, "reason": d.Reason, "scope": d.Scope, "limit": d.Limit,
					"remaining": d.Remaining, "reset_after_ms": d.ResetAfterMs(), "retry_after_ms": d.RetryAfterMs(),
					"lease_id": d.LeaseID, "message": d.Message,
				})
			} else {
				verdict := "denied"
				if d.Admitted {
					verdict = "admitted"
				}
				fmt.Printf("%s  reason=%s scope=%s limit=%d remaining=%d reset_after=%dms retry_after=%dms", verdict, d.Reason, d.Scope, d.Limit, d.Remaining, d.ResetAfterMs(), d.RetryAfterMs())
				if d.LeaseID != 0 {
					fmt.Printf(" lease_id=%d", d.LeaseID)
				}
				if d.Message != "" {
					fmt.Printf("\n  %s", d.Message)
				}
				fmt.Println()
			}
			if err != nil {
				return err
			}
			if !d.Admitted {
				return exitError{code: 3}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&addr, "addr", defaultAddrs(), "comma-separated node gRPC addresses (any nodes)")
	f.StringVar(&domain, "domain", "", "limits domain (required)")
	f.StringArrayVar(&descs, "descriptor", nil, "descriptor entry key=value, outermost first (repeatable)")
	f.Uint64Var(&cost, "cost", 1, "units to spend")
	f.DurationVar(&leaseTTL, "lease-ttl", 0, "TTL of concurrency permits (0: the limit's configured TTL)")
	f.BoolVar(&asJSON, "json", false, "print the decision as JSON")
	f.DurationVar(&timeout, "timeout", 10*time.Second, "give up after this long")
	return cmd
}

func releaseCmd() *cobra.Command {
	var (
		addr    string
		leaseID uint64
	)
	cmd := &cobra.Command{
		Use:   "release",
		Short: "Release a concurrency lease",
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := newClient(addr)
			if err != nil {
				return err
			}
			defer c.Close()
			ctx, cancel := context.WithTimeout(cmd.Context(), 10*time.Second)
			defer cancel()
			released, err := c.ReleaseLease(ctx, leaseID)
			if err != nil {
				return err
			}
			fmt.Printf("released=%v\n", released)
			return nil
		},
	}
	cmd.Flags().StringVar(&addr, "addr", defaultAddrs(), "comma-separated node gRPC addresses")
	cmd.Flags().Uint64Var(&leaseID, "lease-id", 0, "lease ID from an admitted acquire")
	return cmd
}

func limitsCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "limits", Short: "Read or change the cluster's limits"}
	var addr, file string
	apply := &cobra.Command{
		Use:   "apply",
		Short: "Validate a limits file and replicate it (takes effect on the next acquire)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			data, err := os.ReadFile(file)
			if err != nil {
				return fmt.Errorf("-f %q: %w", file, err)
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 15*time.Second)
			defer cancel()
			return call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
				resp, err := quotadv1.NewAdminClient(conn).ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: string(data), FileName: file})
				if err != nil {
					if status.Code(err) == codes.InvalidArgument {
						return fmt.Errorf("%s", status.Convert(err).Message())
					}
					return err
				}
				fmt.Printf("applied limits version %d (domains: %s)\n", resp.Version, strings.Join(resp.Domains, ", "))
				return nil
			})
		},
	}
	apply.Flags().StringVarP(&file, "file", "f", "", "limits YAML file")
	get := &cobra.Command{
		Use:   "get",
		Short: "Print the limits in force as YAML",
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), 10*time.Second)
			defer cancel()
			return call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
				resp, err := quotadv1.NewAdminClient(conn).GetLimits(ctx, &quotadv1.GetLimitsRequest{})
				if err == nil {
					fmt.Print(resp.Yaml) // config.Format starts with a version comment
				}
				return err
			})
		},
	}
	cmd.PersistentFlags().StringVar(&addr, "addr", defaultAddrs(), "comma-separated node gRPC addresses")
	cmd.AddCommand(apply, get)
	return cmd
}

func statusCmd() *cobra.Command {
	var (
		addr   string
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the cluster's leader and members",
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), 10*time.Second)
			defer cancel()
			var resp *quotadv1.MembersResponse
			err := call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
				var err error
				resp, err = quotadv1.NewAdminClient(conn).Members(ctx, &quotadv1.MembersRequest{})
				return err
			})
			if err != nil {
				return err
			}
			type member struct {
				ID           string `json:"id"`
				GRPCAddr     string `json:"grpc_addr"`
				RaftAddr     string `json:"raft_addr"`
				Suffrage     string `json:"suffrage"`
				State        string `json:"state"`
				AppliedIndex uint64 `json:"applied_index"`
			}
			out := struct {
				Leader *struct {
					ID       string `json:"id"`
					GRPCAddr string `json:"grpc_addr"`
				} `json:"leader"`
				Members []member `json:"members"`
			}{Members: []member{}}
			if l := resp.Leader; l != nil {
				out.Leader = &struct {
					ID       string `json:"id"`
					GRPCAddr string `json:"grpc_addr"`
				}{l.Id, l.GrpcAddr}
			}
			for _, m := range resp.Members {
				out.Members = append(out.Members, member{m.Id, m.GrpcAddr, m.RaftAddr, m.Suffrage, m.State, m.AppliedIndex})
			}
			if asJSON {
				return printJSON(out)
			}
			if out.Leader != nil {
				fmt.Printf("leader: %s (%s)\n", out.Leader.ID, out.Leader.GRPCAddr)
			} else {
				fmt.Println("leader: none")
			}
			for _, m := range out.Members {
				fmt.Printf("  %-8s %-9s %-9s grpc=%s raft=%s applied=%d\n", m.ID, m.State, m.Suffrage, m.GRPCAddr, m.RaftAddr, m.AppliedIndex)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&addr, "addr", defaultAddrs(), "comma-separated node gRPC addresses")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
