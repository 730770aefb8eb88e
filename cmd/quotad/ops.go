package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/internal/buildinfo"
	"github.com/quotad/quotad/rpc"
)

func versionCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Print quotad's version, commit and Go version (also: quotad --version)",
		RunE: func(*cobra.Command, []string) error {
			bi := buildinfo.Get()
			if asJSON {
				return printJSON(map[string]string{"version": bi.Version, "commit": bi.Commit, "go_version": bi.GoVersion})
			}
			fmt.Println(bi.String())
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

// descriptorFlag turns --descriptor key=value values into API entries.
func descriptorFlag(values []string, example string) ([]*quotadv1.Entry, error) {
	var out []*quotadv1.Entry
	for _, d := range values {
		k, v, ok := strings.Cut(d, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("--descriptor %q: use key=value, e.g. --descriptor %s", d, example)
		}
		out = append(out, &quotadv1.Entry{Key: k, Value: v})
	}
	return out, nil
}

func addrFlag(f interface {
	StringVar(p *string, name, value, usage string)
}, p *string) {
	f.StringVar(p, "addr", defaultAddrs(), "comma-separated node gRPC addresses (any nodes)")
}

func bucketCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "bucket", Short: "Read buckets (worker or reader)"}
	var (
		addr, domain string
		descs        []string
		asJSON       bool
	)
	st := &cobra.Command{
		Use:     "status",
		Short:   "Show the buckets on a descriptor path: limit, remaining, in flight, pause (linearizable)",
		Example: "  quotad bucket status --domain provider --descriptor endpoint=charges --descriptor tenant=acme",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if domain == "" {
				return fmt.Errorf("--domain is required: the limits domain whose buckets to show")
			}
			entries, err := descriptorFlag(descs, "endpoint=charges")
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 10*time.Second)
			defer cancel()
			var resp *quotadv1.StatusResponse
			if err := call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
				resp, err = quotadv1.NewQuotaClient(conn).Status(ctx, &quotadv1.StatusRequest{Domain: domain, Descriptors: entries})
				return err
			}); err != nil {
				return err
			}
			if asJSON {
				type bucket struct {
					Scope        string `json:"scope"`
					Key          string `json:"key"`
					Limit        uint64 `json:"limit"`
					Burst        uint64 `json:"burst"`
					Remaining    uint64 `json:"remaining"`
					WindowMs     int64  `json:"window_ms"`
					ResetAfterMs int64  `json:"reset_after_ms"`
					InFlight     uint64 `json:"in_flight"`
					MaxInFlight  uint64 `json:"max_in_flight"`
					PausedForMs  int64  `json:"paused_for_ms"`
					LentLimit    uint64 `json:"lent_limit,omitempty"`
					LentBurst    uint64 `json:"lent_burst,omitempty"`
					Ceiling      uint64 `json:"ceiling,omitempty"`
				}
				out := struct {
					AppliedIndex uint64   `json:"applied_index"`
					LeaderID     string   `json:"leader_id"`
					Buckets      []bucket `json:"buckets"`
				}{resp.AppliedIndex, resp.LeaderId, []bucket{}}
				for _, b := range resp.Buckets {
					out.Buckets = append(out.Buckets, bucket{b.Scope, b.Key, b.Limit, b.Burst, b.Remaining, b.WindowMs, b.ResetAfterMs, b.InFlight, b.MaxInFlight, b.PausedForMs, b.LentLimit, b.LentBurst, b.Ceiling})
				}
				return printJSON(out)
			}
			out := cmd.OutOrStdout()
			for _, b := range resp.Buckets {
				fmt.Fprintf(out, "%-10s %s\n", b.Scope, b.Key)
				window := time.Duration(b.WindowMs) * time.Millisecond
				if b.Limit > 0 || b.LentLimit > 0 {
					fmt.Fprintf(out, "  rate        %d per %s, burst %d: remaining %d, full in %s\n", b.Limit, window, b.Burst, b.Remaining, humanMs(b.ResetAfterMs))
				}
				if b.LentLimit > 0 || b.LentBurst > 0 {
					// The line above is the central part: without this an operator read a
					// 100/s level that lends 90/s as a 10/s limit.
					fmt.Fprintf(out, "  lent        %d per %s, burst %d to share holders (quotad shares); the rate above is what is left for central callers of %d per %s, burst %d\n",
						b.LentLimit, window, b.LentBurst, b.Limit+b.LentLimit, window, b.Burst+b.LentBurst)
				}
				if b.Ceiling > 0 && b.Ceiling != b.Limit+b.LentLimit {
					fmt.Fprintf(out, "  adaptive    configured requests_per_unit %d; lowered by provider feedback to %d\n", b.Ceiling, b.Limit+b.LentLimit)
				}
				if b.MaxInFlight > 0 {
					fmt.Fprintf(out, "  concurrency %d of %d in flight\n", b.InFlight, b.MaxInFlight)
				}
				if b.PausedForMs > 0 {
					fmt.Fprintf(out, "  paused      for %s more\n", humanMs(b.PausedForMs))
				}
				if b.Limit == 0 && b.LentLimit == 0 && b.MaxInFlight == 0 && b.PausedForMs == 0 {
					fmt.Fprintln(out, "  no limit at this level")
				}
			}
			return nil
		},
	}
	f := st.Flags()
	addrFlag(f, &addr)
	f.StringVar(&domain, "domain", "", "limits domain (required)")
	f.StringArrayVar(&descs, "descriptor", nil, "descriptor entry key=value, outermost first (repeatable)")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	cmd.AddCommand(st)
	return cmd
}

func feedbackCmd() *cobra.Command {
	var (
		addr, domain, reason string
		descs                []string
		code                 uint32
		retryAfter           time.Duration
	)
	cmd := &cobra.Command{
		Use:   "feedback",
		Short: "Report a provider's 429/503 for a scope: quotad pauses it for every worker (worker)",
		Example: `  quotad feedback --domain provider --status 429 --retry-after 30s --reason app
  quotad feedback --domain provider --descriptor endpoint=charges --status 429 --retry-after 5s`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			switch {
			case domain == "":
				return fmt.Errorf("--domain is required: the limits domain the provider answered for")
			case code != 429 && code != 503:
				return fmt.Errorf("--status %d: use 429 or 503, the provider's throttling answers", code)
			case retryAfter < 0:
				return fmt.Errorf("--retry-after %v is negative; use 0 when the provider sent no Retry-After", retryAfter)
			}
			entries, err := descriptorFlag(descs, "endpoint=charges")
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 10*time.Second)
			defer cancel()
			return call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
				resp, err := quotadv1.NewQuotaClient(conn).Feedback(ctx, &quotadv1.FeedbackRequest{Domain: domain, Descriptors: entries,
					StatusCode: code, RetryAfterMs: retryAfter.Milliseconds(), Reason: reason})
				if err != nil {
					return err
				}
				out := cmd.OutOrStdout()
				switch {
				case resp.PausedForMs > 0:
					// Name the bucket, not only its level: a typo in a value (endpoint=chrages)
					// matches a wildcard level and pauses a bucket nobody spends from, while
					// "paused scope endpoint" read as success for the endpoint meant.
					fmt.Fprintf(out, "paused %s (scope %s) for %dms", pausedPath(domain, entries, resp.Scope), resp.Scope, resp.PausedForMs)
					if resp.ClampedToMaxPauseMs > 0 {
						fmt.Fprintf(out, " (--retry-after %v was clamped to the domain's max_pause %v; raise the domain's max_pause in the limits to pause longer)",
							retryAfter, time.Duration(resp.ClampedToMaxPauseMs)*time.Millisecond)
					}
				case resp.Attributed:
					fmt.Fprintf(out, "recorded against %s (scope %s; no pause)", pausedPath(domain, entries, resp.Scope), resp.Scope)
				default:
					fmt.Fprintf(out, "recorded as evidence only: a 429 without a reason for the whole domain is not assumed global (add --reason or a --descriptor)")
				}
				if resp.Decreased {
					fmt.Fprintf(out, "; adaptive rate decreased to %d", resp.Limit)
				}
				fmt.Fprintln(out)
				return nil
			})
		},
	}
	f := cmd.Flags()
	addrFlag(f, &addr)
	f.StringVar(&domain, "domain", "", "limits domain (required)")
	f.StringArrayVar(&descs, "descriptor", nil, "descriptor entry key=value of the limited scope, outermost first (repeatable; none: the whole domain)")
	f.Uint32Var(&code, "status", 429, "the provider's status code: 429 or 503")
	f.DurationVar(&retryAfter, "retry-after", 0, "the provider's Retry-After (0: none sent)")
	f.StringVar(&reason, "reason", "", "the provider's limiter-reason header, if any")
	return cmd
}

func operatorCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "operator", Short: "Cluster operations (admin)"}
	var (
		addr, to string
	)
	transfer := &cobra.Command{
		Use:   "transfer-leadership",
		Short: "Hand leadership to another voter (--to ID, or the most up-to-date one)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cmd.Flags().Changed("to") && strings.TrimSpace(to) == "" {
				return fmt.Errorf("--to %q is empty: give the member ID to hand leadership to (quotad status lists them), or leave --to out to let raft pick the most up-to-date voter", to)
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 15*time.Second)
			defer cancel()
			var leader string
			var already bool
			if err := call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
				resp, err := quotadv1.NewAdminClient(conn).TransferLeadership(ctx, &quotadv1.TransferLeadershipRequest{To: to})
				if err == nil {
					leader, already = resp.LeaderId, resp.AlreadyLeader
				}
				return err
			}); err != nil {
				return err
			}
			if already {
				fmt.Printf("%s already leads; nothing to transfer\n", leader)
				return nil
			}
			// The old leader may not know the new one yet: ask the nodes for a few seconds.
			for wait := time.Now().Add(5 * time.Second); leader == "" && time.Now().Before(wait); time.Sleep(100 * time.Millisecond) {
				_ = call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
					resp, err := quotadv1.NewAdminClient(conn).Members(ctx, &quotadv1.MembersRequest{})
					if err == nil && resp.Leader != nil {
						leader = resp.Leader.Id
					}
					return err
				})
			}
			if leader == "" {
				fmt.Println("leadership transferred; the new leader is being elected (quotad status shows it)")
			} else {
				fmt.Printf("leadership transferred; leader: %s\n", leader)
			}
			return nil
		},
	}
	addrFlag(transfer.Flags(), &addr)
	transfer.Flags().StringVar(&to, "to", "", "member ID to hand leadership to (quotad status lists them; empty: raft picks)")
	cmd.AddCommand(transfer)
	return cmd
}

func membersCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "members", Short: "Cluster membership (admin)"}
	var addr string
	var force bool
	remove := &cobra.Command{
		Use:   "remove ID",
		Short: "Remove a member from the Raft configuration (a node gone for good; stop it first)",
		Long: `Remove a member from the Raft configuration through the leader, as consul operator raft
remove-peer does: for a node that is gone for good, before --dead-node-timeout removes it. A node
that is still running and in gossip is added back (as a non-voter, promoted once caught up):
stop it first.

The leader refuses a removal that would leave voters without a live majority by its own recent
contact (e.g. removing a healthy voter of three while another is down): the cluster could not
commit and would stop leading until the down voter returns. Bring the down voter back, or
remove it first. --force removes anyway (docs/operations.md, "Removing a member").`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), 15*time.Second)
			defer cancel()
			// maybe: a try that may have removed it (the call timed out after it was sent).
			var maybe error
			// running: gossip saw the node alive just before the removal, so it will be added
			// back (user trial: a removed node that was still running rejoined, unannounced).
			running := false
			err := call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
				admin := quotadv1.NewAdminClient(conn)
				if ms, err := admin.Members(ctx, &quotadv1.MembersRequest{}); err == nil {
					for _, m := range ms.Members {
						if m.Id == args[0] {
							running = m.State != "" && m.State != cluster.StateUnreachable && m.State != cluster.StateLeft
						}
					}
				}
				resp, err := admin.RemoveServer(ctx, &quotadv1.RemoveServerRequest{Id: args[0], Force: force})
				switch {
				case err == nil:
					fmt.Printf("removed %s; members: %s\n", args[0], strings.Join(resp.Members, ", "))
					if running {
						fmt.Fprintf(cmd.ErrOrStderr(), "note: %s is still running (gossip sees it alive): the leader will add it back as a non-voter "+
							"after --rejoin-delay (15 s by default) and promote it once it keeps up. To remove it for good, stop its agent first "+
							"(systemctl stop quotad, docker stop, kill), then run quotad members remove %s again if it came back.\n", args[0], args[0])
					}
					return nil
				case maybe != nil && status.Code(err) == codes.NotFound:
					fmt.Printf("removed %s (by an earlier try whose answer timed out; `quotad status` shows whether it committed)\n", args[0])
					return nil
				case status.Code(err) == codes.DeadlineExceeded:
					if msg := status.Convert(err).Message(); strings.Contains(msg, rpc.RemovalOutcomeUnknown) {
						return errors.New(msg) // the leader appended it and says so: no retry
					}
					maybe = err // sent, then no answer in time
				}
				return err
			})
			if err != nil && maybe != nil {
				return fmt.Errorf("the removal of %s may have been applied: a try timed out after it was sent (%s); check `quotad status` before retrying", args[0], status.Convert(maybe).Message())
			}
			return err
		},
	}
	addrFlag(remove.Flags(), &addr)
	remove.Flags().BoolVar(&force, "force", false, "remove even if the voters left have no live majority (the cluster stops committing until enough of them return)")
	cmd.AddCommand(remove)
	return cmd
}

// humanMs prints a duration in milliseconds as such below a minute and as a Go duration
// rounded to the second above: a day bucket's "full in 259199965178ms" said nothing at a
// glance.
func humanMs(ms int64) string {
	if ms < 60_000 {
		return fmt.Sprintf("%dms", ms)
	}
	return (time.Duration(ms) * time.Millisecond).Round(time.Second).String()
}

// pausedPath is the bucket a feedback paused: the domain and the descriptors up to the last
// one whose key is scope (the engine pauses that prefix of the path sent).
func pausedPath(domain string, entries []*quotadv1.Entry, scope string) string {
	var b strings.Builder
	b.WriteString(domain)
	if scope == "domain" {
		return b.String()
	}
	last := -1
	for i, e := range entries {
		if e.Key == scope {
			last = i
		}
	}
	for _, e := range entries[:last+1] {
		fmt.Fprintf(&b, "/%s=%s", e.Key, e.Value)
	}
	return b.String()
}
