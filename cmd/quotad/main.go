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
	}
	pf := root.PersistentFlags()
	pf.StringVar(&cliTLS.CAFile, "cacert", "", "client commands: PEM CA that signed the nodes' certificates (or $QUOTAD_CACERT)")
	pf.StringVar(&cliTLS.CertFile, "client-cert", "", "client commands: PEM client certificate (or $QUOTAD_CLIENT_CERT)")
	pf.StringVar(&cliTLS.KeyFile, "client-key", "", "client commands: PEM key for --client-cert (or $QUOTAD_CLIENT_KEY)")
	pf.StringVar(&cliTokenFile, "token-file", "", "client commands: file holding a bearer token (or the token in $QUOTAD_TOKEN)")
	root.AddCommand(agentCmd(), devCmd(), acquireCmd(), releaseCmd(), limitsCmd(), statusCmd(), topCmd(), tlsCmd(), keygenCmd(), tokenCmd(), pauseCmd(), snapshotCmd())
	if err := root.Execute(); err != nil {
		var ee exitError
		if errors.As(err, &ee) {
			os.Exit(ee.code)
		}
		msg := err.Error()
		if !strings.HasPrefix(msg, "quotad: ") {
			msg = "quotad: " + msg
		}
		fmt.Fprintln(os.Stderr, msg)
		os.Exit(1)
	}
}
