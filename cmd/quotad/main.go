// Command quotad runs a quotad server (agent), a local development cluster (dev), and the
// client commands operators use (acquire, release, limits, status). It only wires flags to the
// packages that do the work.
package main

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"google.golang.org/grpc/status"

	"github.com/quotad/quotad/internal/buildinfo"
)

// exitError carries a specific exit code (acquire exits 3 when denied).
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit %d", e.code) }

func main() {
	root := &cobra.Command{
		Use:           "quotad",
		Short:         "quotad: a Raft-replicated quota cluster",
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       buildinfo.Get().Version,
		// Client commands (those with --addr) check their addresses and that one answers.
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error { return checkAddrFlag(cmd) },
	}
	root.SetVersionTemplate(buildinfo.Get().String() + "\n")
	clientFlags(root.PersistentFlags())
	root.AddCommand(agentCmd(), devCmd(), acquireCmd(), releaseCmd(), limitsCmd(), statusCmd(), topCmd(), tlsCmd(), keygenCmd(), tokenCmd(), pauseCmd(),
		versionCmd(), bucketCmd(), feedbackCmd(), operatorCmd(), membersCmd(), snapshotCmd(), sharesCmd(), recoverCmd())
	refuseStrayArgs(root)
	if err := root.Execute(); err != nil {
		var ee exitError
		if errors.As(err, &ee) {
			os.Exit(ee.code)
		}
		fmt.Fprintln(os.Stderr, errorMessage(err))
		os.Exit(1)
	}
}

// clientFlags registers the client commands' connection flags on pf (the root's persistent
// flags).
func clientFlags(pf *pflag.FlagSet) {
	pf.StringVar(&cliTLS.CAFile, "cacert", "", "client commands: PEM CA that signed the nodes' certificates (or $QUOTAD_CACERT)")
	pf.StringVar(&cliTLS.CertFile, "client-cert", "", "client commands: PEM client certificate (or $QUOTAD_CLIENT_CERT)")
	pf.StringVar(&cliTLS.KeyFile, "client-key", "", "client commands: PEM key for --client-cert (or $QUOTAD_CLIENT_KEY)")
	pf.StringVar(&cliTokenFile, "token-file", "", "client commands: file holding a bearer token (or the token in $QUOTAD_TOKEN)")
	pf.BoolVar(&cliAddrsOnly, addrsOnlyFlag, false, "client commands: dial only --addr, never the leader's own address — for nodes behind a proxy or load balancer; a follower forwards (or $QUOTAD_CONFIGURED_ADDRS_ONLY=true)")
	cliFlags = pf
}

// refuseStrayArgs makes every command that declares no arguments refuse them (cobra accepts
// and ignores them by default): `quotad status extra` is an error, not a silent no-op.
func refuseStrayArgs(c *cobra.Command) {
	if c.Args == nil && c.Runnable() {
		c.Args = cobra.NoArgs
	}
	for _, sub := range c.Commands() {
		refuseStrayArgs(sub)
	}
}

// errorMessage is the line a failed command prints: gRPC's "rpc error: code = NotFound desc =
// ..." reads "NotFound: ...", wherever it sits in the chain of wrapped errors, and the line
// starts with "quotad: " once.
func errorMessage(err error) string {
	msg := err.Error()
	var se interface{ GRPCStatus() *status.Status }
	if errors.As(err, &se) {
		if raw, ok := se.(error); ok {
			st := se.GRPCStatus()
			msg = strings.Replace(msg, raw.Error(), st.Code().String()+": "+st.Message(), 1)
		}
	}
	if !strings.HasPrefix(msg, "quotad: ") {
		msg = "quotad: " + msg
	}
	return msg
}
