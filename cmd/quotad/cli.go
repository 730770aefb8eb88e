package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/config"
)

// Connection settings of the client commands (persistent flags; the environment fills what
// they leave empty: client.Config.LoadEnv).
var (
	cliTLS       client.TLSFiles
	cliTokenFile string
	cliAddrsOnly bool           // --configured-addrs-only
	cliFlags     *pflag.FlagSet // the root's persistent flags: was --configured-addrs-only given?
)

const addrsOnlyFlag = "configured-addrs-only"

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
	if cliFlags != nil && cliFlags.Changed(addrsOnlyFlag) { // the flag wins over the environment
		cfg.SetConfiguredAddrsOnly(cliAddrsOnly)
	}
	return cfg
}

func dialOptions() ([]grpc.DialOption, error) { return connConfig("").DialCredentials() }

// newClient returns a client library instance for the quota commands (leader discovery,
// retries with one request ID, backoff).
func newClient(ctx context.Context, addrs string) (*client.Client, error) {
	if err := reach(ctx, splitList(addrs)); err != nil {
		return nil, err
	}
	cfg := connConfig(addrs)
	cfg.Batch.Disabled = true  // one decision per invocation: nothing to batch
	cfg.Stream.Disabled = true // nor to stream
	return client.New(cfg)
}

// targets checks --addr and that a node answers, and gives the addresses and dial options
// call and callOnce use.
func targets(ctx context.Context, addrs string) ([]string, []grpc.DialOption, error) {
	list := splitList(addrs)
	if len(list) == 0 {
		return nil, nil, fmt.Errorf("--addr is empty: give one or more node gRPC addresses, e.g. 127.0.0.1:7101,127.0.0.1:7102")
	}
	opts, err := dialOptions()
	if err != nil {
		return nil, nil, err
	}
	if err := reach(ctx, list); err != nil {
		return nil, nil, err
	}
	return list, opts, nil
}

// call runs fn against each address in turn until one gives an answer that is not
// "unavailable" (fn must be idempotent: acquire reuses one request ID for every try).
func call(ctx context.Context, addrs string, fn func(ctx context.Context, conn *grpc.ClientConn) error) error {
	list, opts, err := targets(ctx, addrs)
	if err != nil {
		return err
	}
	last := make(map[string]error, len(list))
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
			last[a] = err
		}
		select {
		case <-ctx.Done():
			var b strings.Builder
			for _, a := range list {
				if err := last[a]; err != nil {
					fmt.Fprintf(&b, "\n  %s: %s", a, status.Convert(err).Message())
				}
			}
			return fmt.Errorf("no node gave an answer in time:%s%s", b.String(), plaintextHint())
		case <-time.After(time.Duration(100*(attempt+1)) * time.Millisecond):
		}
	}
}

// callOnce runs fn, which is not idempotent (token create: each call makes a new token), on
// one node: unlike call it moves to the next address only when the request surely never
// reached a node (connection refused), and never repeats it after a timeout or a lost
// answer — a repeat could leave a second token nobody holds. Such an ambiguous failure is
// returned with check, what to look at before trying again.
func callOnce(ctx context.Context, addrs, check string, fn func(ctx context.Context, conn *grpc.ClientConn) error) error {
	list, opts, err := targets(ctx, addrs)
	if err != nil {
		return err
	}
	var b strings.Builder
	for _, a := range list {
		conn, err := grpc.NewClient(a, opts...)
		if err != nil {
			return fmt.Errorf("--addr %q: %w", a, err)
		}
		err = fn(ctx, conn)
		conn.Close()
		code := status.Code(err)
		switch {
		case err == nil:
			return nil
		case code != codes.Unavailable && code != codes.DeadlineExceeded:
			return err
		case neverSent(err):
			fmt.Fprintf(&b, "\n  %s: %s", a, status.Convert(err).Message())
			continue
		}
		return fmt.Errorf("%w\nThe outcome is unknown (no answer came back) and it was not retried: it may have been done; %s", err, check)
	}
	return fmt.Errorf("no node took the request:%s%s", b.String(), plaintextHint())
}

// neverSent reports whether a failed call surely never reached a node (so repeating it
// elsewhere cannot do it twice): the connection itself was refused.
func neverSent(err error) bool {
	msg := status.Convert(err).Message()
	return strings.Contains(msg, "connection refused") || strings.Contains(msg, "produced zero addresses")
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

// LeaseTTLMs is the TTL granted to the lease (the limit's lease_ttl caps --lease-ttl); 0
// without a lease.
func (d decisionView) LeaseTTLMs() int64 { return ceilMs(d.LeaseTTL) }

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
		Short: "Ask for quota once: exit 0 if admitted, 3 if denied, 4 if the request is invalid",
		Long: `Ask for quota once and print the decision. Exit codes: 0 admitted; 3 denied (rate or
concurrency limited, paused, … — asking again later may be admitted: retry_after says when); 4
refused as invalid (an unknown domain, an undefined key in a strict_keys domain, a cost above
the bucket — asking again cannot help: fix the request); 1 any other error (no decision).`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			switch {
			case domain == "":
				return fmt.Errorf("--domain is required: the limits domain to spend in, e.g. --domain provider")
			case cost == 0:
				return fmt.Errorf("--cost 0: use 1 or more (the units this request spends)")
			case leaseTTL < 0:
				return fmt.Errorf("--lease-ttl %v is negative; use 0 for the limit's configured TTL", leaseTTL)
			case timeout <= 0:
				return fmt.Errorf("--timeout %v: use a positive duration", timeout)
			}
			req := client.Request{Domain: domain, Cost: cost, LeaseTTL: leaseTTL, Attempt: 1}
			for _, d := range descs {
				k, v, ok := strings.Cut(d, "=")
				if !ok || k == "" {
					return fmt.Errorf("--descriptor %q: use key=value, e.g. --descriptor tenant=acme", d)
				}
				req.Descriptors = append(req.Descriptors, client.Entry{Key: k, Value: v})
			}
			c, err := newClient(cmd.Context(), addr)
			if err != nil {
				return err
			}
			defer c.Close()
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			dec, err := c.Allow(ctx, req)
			// A denial, and a decision refusing the request as invalid (an undefined key in a
			// strict_keys domain, an unknown domain), are answers: printed, exit code 3 or 4.
			answered := errors.Is(err, client.ErrDenied) || (errors.Is(err, client.ErrInvalid) && dec.Reason != "")
			if err != nil && !answered {
				if errors.Is(err, client.ErrUnavailable) {
					return fmt.Errorf("%w%s", err, plaintextHint())
				}
				return err
			}
			err = nil // a denial is an answer: printed below, exit code 3 (4 if invalid)
			d := decisionView{dec}
			if asJSON {
				err = printJSON(map[string]any{
					"admitted": d.Admitted, "reason": d.Reason, "scope": d.Scope, "limit": d.Limit,
					"remaining": d.Remaining, "reset_after_ms": d.ResetAfterMs(), "retry_after_ms": d.RetryAfterMs(),
					"lease_id": d.LeaseID, "lease_ttl_ms": d.LeaseTTLMs(), "message": d.Message,
				})
			} else {
				verdict := "denied"
				if d.Admitted {
					verdict = "admitted"
				}
				fmt.Printf("%s  reason=%s scope=%s limit=%d remaining=%d reset_after=%dms retry_after=%dms", verdict, d.Reason, d.Scope, d.Limit, d.Remaining, d.ResetAfterMs(), d.RetryAfterMs())
				if d.LeaseID != 0 {
					fmt.Printf(" lease_id=%d lease_ttl=%dms", d.LeaseID, d.LeaseTTLMs())
					if leaseTTL > d.LeaseTTL {
						fmt.Printf(" (--lease-ttl %v capped by the limit's lease_ttl)", leaseTTL)
					}
				}
				if d.Message != "" {
					fmt.Printf("\n  %s", d.Message)
				}
				fmt.Println()
			}
			if err != nil {
				return err
			}
			switch {
			case d.Admitted:
				return nil
			case d.Reason == client.ReasonInvalid || d.Reason == client.ReasonUnknownDomain:
				// Not a denial a retry can turn around: a script retrying on exit 3 looped on a
				// typo (--domain provder) forever.
				return exitError{code: 4}
			}
			return exitError{code: 3}
		},
	}
	f := cmd.Flags()
	f.StringVar(&addr, "addr", defaultAddrs(), "comma-separated node gRPC addresses (any nodes)")
	f.StringVar(&domain, "domain", "", "limits domain (required)")
	f.StringArrayVar(&descs, "descriptor", nil, "descriptor entry key=value, outermost first (repeatable)")
	f.Uint64Var(&cost, "cost", 1, "units to spend (1 or more)")
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
			if leaseID == 0 {
				return fmt.Errorf("--lease-id is required: the lease_id an admitted acquire printed")
			}
			c, err := newClient(cmd.Context(), addr)
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
			if !released {
				return fmt.Errorf("lease %d was not released: no lease by that ID is held — unknown, already released, or expired (its TTL passed without a renew), so it holds no permits; check the ID your acquire printed (another caller's lease is refused PermissionDenied instead, and stays held)", leaseID)
			}
			fmt.Printf("released=%v\n", released)
			return nil
		},
	}
	cmd.Flags().StringVar(&addr, "addr", defaultAddrs(), "comma-separated node gRPC addresses")
	cmd.Flags().Uint64Var(&leaseID, "lease-id", 0, "lease ID from an admitted acquire (required)")
	return cmd
}

func limitsCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "limits", Short: "Read or change the cluster's limits"}
	var (
		addr               string
		files              []string
		replaceAll, dryRun bool
	)
	apply := &cobra.Command{
		Use:   "apply [FILE|DIR]...",
		Short: "Add or replace the domains in limits files (the others stay); --dry-run shows the changes",
		Long: `Validate limits files and replicate them: each domain in them is added, or replaces the
domain of that name; domains they do not name stay as they are. A directory stands for its
*.yaml and *.yml files (one or more domains each). --dry-run prints the changes against the
limits in force and applies nothing; --replace-all makes the files the whole limit set (domains
they do not name are removed). The change takes effect on the next acquire, on every node at once.`,
		Example: `  quotad limits apply examples/limits.yaml --dry-run
  quotad limits apply examples/limits.yaml
  quotad limits apply -f limits.d/
  quotad limits apply --replace-all all-limits.yaml`,
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			paths := append(append([]string(nil), files...), args...)
			if len(paths) == 0 {
				return fmt.Errorf("no limits file: name one, e.g. quotad limits apply examples/limits.yaml (or -f FILE, -f DIR)")
			}
			// Validate locally first: errors name the file, line and key of every problem.
			limits, err := config.LoadFiles(paths...)
			if err != nil {
				return err
			}
			name, yaml := strings.Join(paths, ", "), ""
			if len(paths) == 1 {
				if st, err := os.Stat(paths[0]); err == nil && !st.IsDir() {
					data, err := os.ReadFile(paths[0])
					if err != nil {
						return fmt.Errorf("%s: %w", paths[0], err)
					}
					yaml = string(data) // as written, so the cluster's messages point at its lines
				}
			}
			if yaml == "" {
				yaml = string(config.Format(limits))
			}
			if len(limits.Domains) == 0 {
				return fmt.Errorf("%s: no domains: nothing to apply; a limits document starts with domain: NAME (to remove a domain: quotad limits delete DOMAIN)", name)
			}
			return changeLimits(cmd, addr, &quotadv1.ApplyLimitsRequest{Yaml: yaml, FileName: name, ReplaceAll: replaceAll, DryRun: dryRun})
		},
	}
	apply.Flags().StringArrayVarP(&files, "file", "f", nil, "limits YAML file or directory (repeatable; also as arguments)")
	apply.Flags().BoolVar(&replaceAll, "replace-all", false, "make the files the whole limit set: domains they do not name are removed")
	apply.Flags().BoolVar(&dryRun, "dry-run", false, "print the changes and apply nothing")
	del := &cobra.Command{
		Use:   "delete DOMAIN...",
		Short: "Remove domains from the limits (acquires in them become unknown_domain)",
		Long: `Remove domains from the limits: acquires in them become unknown_domain, and Envoy's rate
limit requests for them are answered per the leader's --rls-unknown-domain: with allow (the
default) OK, NOT rate limited; with deny OVER_LIMIT. The command warns naming each domain. To
stop limiting a domain Envoy still sends without letting its traffic through unlimited, keep it
with a permissive limit instead, or run every node with --rls-unknown-domain deny.`,
		Example: "  quotad limits delete platform --dry-run",
		Args:    atLeastOneArg,
		RunE: func(cmd *cobra.Command, args []string) error {
			return changeLimits(cmd, addr, &quotadv1.ApplyLimitsRequest{DeleteDomains: args, DryRun: dryRun})
		},
	}
	del.Flags().BoolVar(&dryRun, "dry-run", false, "print the changes and apply nothing")
	get := &cobra.Command{
		Use:   "get",
		Short: "Print the limits in force as YAML",
		Long: `Print the limits in force as YAML, in the format limits apply reads: applying the output
unchanged gives the same limits.

A rate_limit's burst is printed only where the applied file wrote one. Left out, a bucket holds
one unit's worth (requests_per_unit), so editing requests_per_unit in this output moves the
burst with it; a burst that is printed stays as printed, even if you change the rate. Limits
applied by a build before this one stored the default burst as a number: their output shows it,
and keeps it when the rate is edited — delete that burst line to return to the default.

lease_ttl (default 30s) and adaptive's decrease_percent, increase and stable_window are always
printed: their defaults are constants filled in when a file is read, and the stored limits do
not say whether a value was written or defaulted. Re-applying the output keeps the same values,
but they will not follow a default changed by a later build.`,
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
	cmd.AddCommand(apply, del, get)
	return cmd
}

// changeLimits sends an ApplyLimits request and prints the changes it made (or would make).
func changeLimits(cmd *cobra.Command, addr string, req *quotadv1.ApplyLimitsRequest) error {
	ctx, cancel := context.WithTimeout(cmd.Context(), 15*time.Second)
	defer cancel()
	out := cmd.OutOrStdout()
	// lost: a try answered Unavailable or DeadlineExceeded, which call retries — also one that
	// committed, so the retry of a delete can find its domains gone.
	var lost error
	// inForce: the domains in force before the first try of a delete, so that a retry finding
	// them gone is told apart from a delete of a domain that never was (a typo).
	var inForce []string
	return call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
		if len(req.DeleteDomains) > 0 && !req.DryRun && inForce == nil && lost == nil {
			if names, _, err := domainsInForce(ctx, conn); err == nil {
				inForce = names
			}
		}
		resp, err := quotadv1.NewAdminClient(conn).ApplyLimits(ctx, req)
		if err != nil {
			switch {
			case status.Code(err) == codes.Unavailable || status.Code(err) == codes.DeadlineExceeded:
				lost = err
			case status.Code(err) == codes.NotFound && lost != nil && len(req.DeleteDomains) > 0 && !req.DryRun:
				// One delete removes all its domains in one entry: if none is in force now,
				// the lost try removed them (exit 0, as pause lift and members remove).
				if v, gone := allGone(ctx, conn, inForce, req.DeleteDomains); gone {
					fmt.Fprintf(out, "removed %s: an earlier try whose answer was lost (%s) removed it; limits version %d (quotad limits get)\n",
						strings.Join(req.DeleteDomains, ", "), status.Convert(lost).Message(), v)
					return nil
				}
				return fmt.Errorf("%s", status.Convert(err).Message())
			case status.Code(err) == codes.InvalidArgument || status.Code(err) == codes.NotFound:
				return fmt.Errorf("%s", status.Convert(err).Message())
			case client.IsMessageTooLarge(err):
				return fmt.Errorf("%w\nThe limits (%d bytes of YAML) are more than a node accepts in one request: split them into several files and apply them one at a time (apply adds or replaces only the domains a file names), or raise --max-request-bytes on every agent", err, len(req.Yaml))
			}
			return err
		}
		for _, c := range resp.Changes {
			fmt.Fprintln(out, c)
		}
		for _, w := range resp.Warnings {
			fmt.Fprintln(cmd.ErrOrStderr(), "warning:", w)
		}
		domains := strings.Join(resp.Domains, ", ")
		switch {
		case !resp.Applied && len(resp.Changes) == 0:
			fmt.Fprintf(out, "dry run: no changes to limits version %d (domains: %s)\n", resp.Version, domains)
		case !resp.Applied:
			fmt.Fprintf(out, "dry run: %d changes to limits version %d; nothing applied (domains would be: %s)\n", len(resp.Changes), resp.Version, domains)
		case len(resp.Changes) == 0 && lost != nil:
			fmt.Fprintf(out, "applied limits version %d: no changes left to make — an earlier try whose answer was lost (%s) may have made them (domains: %s)\n",
				resp.Version, status.Convert(lost).Message(), domains)
		case len(resp.Changes) == 0:
			fmt.Fprintf(out, "applied limits version %d: no changes (domains: %s)\n", resp.Version, domains)
		default:
			fmt.Fprintf(out, "applied limits version %d (domains: %s)\n", resp.Version, domains)
		}
		return nil
	})
}

// allGone reports whether every one of domains was in force before the first try (inForce)
// and none is now, and the limits version now.
func allGone(ctx context.Context, conn *grpc.ClientConn, inForce, domains []string) (uint64, bool) {
	for _, d := range domains {
		if !slices.Contains(inForce, d) {
			return 0, false // never there (or not known to have been): a real NotFound
		}
	}
	now, v, err := domainsInForce(ctx, conn)
	if err != nil {
		return 0, false
	}
	for _, d := range domains {
		if slices.Contains(now, d) {
			return 0, false
		}
	}
	return v, true
}

// domainsInForce lists the domains of the limits in force and their version.
func domainsInForce(ctx context.Context, conn *grpc.ClientConn) ([]string, uint64, error) {
	resp, err := quotadv1.NewAdminClient(conn).GetLimits(ctx, &quotadv1.GetLimitsRequest{})
	if err != nil {
		return nil, 0, err
	}
	limits, err := config.Parse("limits in force", []byte(resp.Yaml))
	if err != nil {
		return nil, 0, err
	}
	names := []string{}
	for _, d := range limits.Domains {
		names = append(names, d.Name)
	}
	return names, resp.Version, nil
}

// statusMember is one node as `quotad status` shows it.
type statusMember struct {
	ID           string `json:"id"`
	GRPCAddr     string `json:"grpc_addr"`
	RaftAddr     string `json:"raft_addr"`
	Suffrage     string `json:"suffrage"`
	State        string `json:"state"`
	AppliedIndex uint64 `json:"applied_index"`
	// CommandVersion: the newest FSM command version it advertises (0: none seen).
	CommandVersion int32 `json:"command_version"`
	// AppliedIndexStale: the node is unreachable or left; applied_index is the last one
	// gossip reported, not where it is now.
	AppliedIndexStale bool `json:"applied_index_stale,omitempty"`
}

// writeMembers writes one line per member, its columns aligned whatever their widths (state
// "unreachable" and IDs such as "r1-node1" are wider than fixed %-9s/%-8s columns).
func writeMembers(w io.Writer, members []statusMember) error {
	tw := tabwriter.NewWriter(w, 0, 0, 1, ' ', 0)
	for _, m := range members {
		cv := "cmd=none"
		if m.CommandVersion > 0 {
			cv = fmt.Sprintf("cmd=%d", m.CommandVersion)
		}
		applied := fmt.Sprint(m.AppliedIndex)
		if m.AppliedIndexStale {
			applied = "unknown" // what gossip last said is not where it is now
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\tgrpc=%s\traft=%s\tapplied=%s\t%s\n", m.ID, m.State, m.Suffrage, m.GRPCAddr, m.RaftAddr, applied, cv)
	}
	return tw.Flush()
}

func statusCmd() *cobra.Command {
	var (
		addr   string
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the cluster's leader, members and command versions (rolling upgrades)",
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
			type member = statusMember
			out := struct {
				Leader *struct {
					ID       string `json:"id"`
					GRPCAddr string `json:"grpc_addr"`
				} `json:"leader"`
				Members []member `json:"members"`
				// CommandVersion: the version log entries are written at (the lowest advertised).
				CommandVersion int32 `json:"command_version"`
				// A regional cluster (docs/regions.md): its leader's share of each global level.
				Region       string                  `json:"region,omitempty"`
				RegionShares []*quotadv1.RegionShare `json:"region_shares,omitempty"`
			}{Members: []member{}, CommandVersion: resp.CommandVersion, Region: resp.Region, RegionShares: resp.RegionShares}
			if l := resp.Leader; l != nil {
				out.Leader = &struct {
					ID       string `json:"id"`
					GRPCAddr string `json:"grpc_addr"`
				}{l.Id, l.GrpcAddr}
			}
			for _, m := range resp.Members {
				stale := m.State == "unreachable" || m.State == "left"
				out.Members = append(out.Members, member{m.Id, m.GrpcAddr, m.RaftAddr, m.Suffrage, m.State, m.AppliedIndex, m.CommandVersion, stale})
			}
			if asJSON {
				return printJSON(out)
			}
			if out.Leader != nil {
				fmt.Printf("leader: %s (%s)\n", out.Leader.ID, out.Leader.GRPCAddr)
			} else {
				fmt.Println("leader: none")
			}
			if out.CommandVersion > 0 {
				fmt.Printf("command version: %d (log entries are written at the lowest any server advertises; cmd= per node)\n", out.CommandVersion)
			}
			if err := writeMembers(os.Stdout, out.Members); err != nil {
				return err
			}
			printRegion(out.Region, out.RegionShares)
			return nil
		},
	}
	cmd.Flags().StringVar(&addr, "addr", defaultAddrs(), "comma-separated node gRPC addresses")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
