package main

import (
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/fsm"
)

func recoverCmd() *cobra.Command {
	var dataDir string
	var voters []string
	var dryRun, asJSON bool
	cmd := &cobra.Command{
		Use:   "recover --data-dir DIR --voter ID=RAFT_ADDR",
		Short: "Offline: make a stopped survivor of a cluster that lost its majority lead again (docs/operations.md)",
		Long: `recover makes a stopped node the only voter of its data dir's Raft configuration, keeping every
entry the node holds: use it only when a majority of the voters is lost for good and the cluster
has no leader. Stop the agent first. Run it with --dry-run on every survivor and recover the one
with the highest last term, then last index, naming itself (--voter ITS_ID=ITS_RAFT_ADDR); start
it again with its usual flags, then start the other survivors with emptied data dirs and any
replacement nodes with empty ones (docs/operations.md, "Lost majority").`,
		Args: cobra.NoArgs,
		RunE: func(_ *cobra.Command, _ []string) error {
			if dataDir == "" {
				return fmt.Errorf("--data-dir is required: the stopped node's data dir")
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
			before, err := cluster.InspectDataDir(dataDir, log)
			if err != nil {
				return err
			}
			if dryRun {
				return printRecoverState(before, asJSON)
			}
			servers, err := cluster.ParseVoters(voters)
			if err != nil {
				return err
			}
			after, err := cluster.RecoverDataDir(dataDir, servers, fsm.New(fsm.Options{}), log)
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(after)
			}
			fmt.Println("recovered; the data dir now holds:")
			return printRecoverState(after, false)
		},
	}
	cmd.Flags().StringVar(&dataDir, "data-dir", "", "the stopped node's --data-dir")
	cmd.Flags().StringArrayVar(&voters, "voter", nil, "this node as the recovered cluster's only voter: its --id=its --raft-addr")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "only print what the data dir holds (compare survivors)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func printRecoverState(st cluster.DataDirState, asJSON bool) error {
	if asJSON {
		return printJSON(st)
	}
	var servers []string
	for _, s := range st.Servers {
		servers = append(servers, fmt.Sprintf("%s=%s (%s)", s.ID, s.Address, strings.ToLower(s.Suffrage.String())))
	}
	fmt.Printf("data dir        %s\nnode            %s\ncluster id      %s\nlog store       %s\nrecovering      %v\ncurrent term    %d\nlast term/index %d / %d (log from %d)\nsnapshot        term %d, index %d\nservers         %s\n",
		st.Dir, st.NodeID, st.ClusterID, st.LogStore, st.Recovering, st.CurrentTerm, st.LastTerm, st.LastIndex, st.FirstIndex,
		st.SnapshotTerm, st.SnapshotIndex, strings.Join(servers, ", "))
	return nil
}
