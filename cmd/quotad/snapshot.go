package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/backup"
)

func snapshotCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "snapshot",
		Short: "Back up and restore the cluster's state (save, inspect, restore)",
	}
	var addr string
	var timeout time.Duration
	var force bool
	save := &cobra.Command{
		Use:   "save FILE",
		Short: "Save a consistent snapshot of the whole state from the leader (admin)",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !force {
				if err := backup.CheckNew(args[0]); err != nil {
					return err
				}
			}
			var h backup.Header
			err := onLeader(cmd.Context(), addr, timeout, func(ctx context.Context, conn *grpc.ClientConn) (err error) {
				h, err = backup.SaveWith(ctx, quotadv1.NewSnapshotClient(conn), args[0], backup.SaveOptions{Force: force})
				return err
			})
			if err != nil {
				return err
			}
			fmt.Printf("saved %s: index %d, term %d, %d bytes, sha256 %s (cluster %s, leader %s)\n",
				args[0], h.Index, h.Term, h.Size, h.SHA256, h.ClusterID, h.Leader)
			return nil
		},
	}
	var asJSON bool
	inspect := &cobra.Command{
		Use:   "inspect FILE",
		Short: "Check a snapshot file and print what it holds (offline)",
		Args:  exactArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			info, err := backup.Inspect(args[0])
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(info)
			}
			fmt.Printf("file            %s\ncluster id      %s\nsaved by        %s (quotad %s, command version %d) at %s\nindex, term     %d, %d\nsize            %d bytes\nsha256          %s (ok)\nlimits version  %d (domains: %s)\nbuckets         %d\nleases          %d\npauses          %d\ndedup entries   %d\ntokens          %d\n",
				args[0], info.ClusterID, info.Leader, info.QuotadVersion, info.CommandVersion, info.CreatedAt.Format(time.RFC3339),
				info.Index, info.Term, info.Size, info.SHA256, info.LimitsVersion, strings.Join(info.Domains, ", "),
				info.Buckets, info.Leases, info.Pauses, info.DedupEntries, info.Tokens)
			return nil
		},
	}
	inspect.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	var restoreTokens, dryRun bool
	restore := &cobra.Command{
		Use:   "restore FILE",
		Short: "Replace the cluster's whole state with a saved snapshot (admin; disaster recovery)",
		Long: `Replace the cluster's whole state with a saved snapshot: limits, buckets, leases, pauses
and the dedup window become what they were when it was saved, and every decision made since is
forgotten. Tokens are security state, not quota state: the cluster keeps its current tokens and
revocations (a token revoked since the save stays revoked, one created since stays valid) unless
--restore-tokens is given, which installs the file's tokens too (revoked tokens come back). The file is checked (size, checksum, decodes) before it is sent; the leader
installs it through Raft and replicates it to every node. Meant for a fresh cluster after a
loss of every data dir (docs/operations.md, "Backup and restore"). The restored limits get a new
version above both the current and the file's (a version never moves backwards). It prints what
changed: limits version, leases and pauses dropped and added, buckets, dedup entries, tokens;
--dry-run prints the same without restoring anything.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var resp *quotadv1.SnapshotRestoreResponse
			err := onLeader(cmd.Context(), addr, timeout, func(ctx context.Context, conn *grpc.ClientConn) (err error) {
				resp, err = backup.RestoreWith(ctx, quotadv1.NewSnapshotClient(conn), args[0], backup.RestoreOptions{RestoreTokens: restoreTokens, DryRun: dryRun})
				return err
			})
			if err != nil {
				return err
			}
			fmt.Println(backup.RestoreSummary(args[0], resp))
			return nil
		},
	}
	for _, c := range []*cobra.Command{save, restore} {
		c.Flags().StringVar(&addr, "addr", defaultAddrs(), "comma-separated node gRPC addresses (or $QUOTAD_ADDR); any node relays to the leader")
		c.Flags().DurationVar(&timeout, "timeout", 5*time.Minute, "give up after this long")
	}
	save.Flags().BoolVar(&force, "force", false, "replace FILE if it exists (without it an existing FILE is refused and nothing is saved)")
	restore.Flags().BoolVar(&restoreTokens, "restore-tokens", false, "also restore the file's tokens (tokens revoked since the save become valid again, tokens created since are dropped); default: keep the cluster's current tokens")
	restore.Flags().BoolVar(&dryRun, "dry-run", false, "check the file and print what a restore would change (limits version, leases and pauses dropped and added, tokens) without restoring")
	cmd.AddCommand(save, inspect, restore)
	return cmd
}

// onLeader runs fn against each address in turn (nodes relay to the leader) until one answers
// with something other than "unavailable", or timeout passes.
func onLeader(ctx context.Context, addrs string, timeout time.Duration, fn func(ctx context.Context, conn *grpc.ClientConn) error) error {
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	list := splitList(addrs)
	if len(list) == 0 {
		return fmt.Errorf("--addr is empty: give one or more node gRPC addresses, e.g. 127.0.0.1:7101")
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
			err = fn(ctx, conn)
			conn.Close()
			if err == nil {
				return nil
			}
			if c := status.Code(err); c != codes.Unavailable || ctx.Err() != nil {
				return err
			}
			last = fmt.Errorf("%s: %w", a, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("no node answered within --timeout %v: %w%s", timeout, last, plaintextHint())
		case <-time.After(time.Duration(200*(attempt+1)) * time.Millisecond):
		}
	}
}
