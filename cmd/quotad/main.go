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
	pf.StringVar(&cliTLS.CAFile, "ca", "", "client commands: PEM CA to verify nodes (enables TLS)")
	pf.StringVar(&cliTLS.CertFile, "cert", "", "client commands: PEM client certificate (mutual TLS)")
	pf.StringVar(&cliTLS.KeyFile, "key", "", "client commands: PEM key for --cert")
	pf.StringVar(&cliAdminToken, "token", "", "client commands: bearer token (visible in the process list: prefer --token-file or $QUOTAD_TOKEN)")
	pf.StringVar(&cliTokenFile, "token-file", "", "client commands: file holding the bearer token (default: $QUOTAD_TOKEN)")
	root.AddCommand(agentCmd(), devCmd(), acquireCmd(), releaseCmd(), limitsCmd(), statusCmd(), topCmd(), tokenCmd(), pauseCmd())
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
