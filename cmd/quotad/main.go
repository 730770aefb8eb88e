// Command quotad runs a quotad server (agent), a local development cluster (dev), and the
// client commands operators use (acquire, release, limits, status). It only wires flags to the
// packages that do the work.
package main

import (
	"errors"
	"fmt"
	"os"
	"reflect"
	"strconv"
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
	if err := newRoot().Execute(); err != nil {
		var ee exitError
		if errors.As(err, &ee) {
			os.Exit(ee.code)
		}
		fmt.Fprintln(os.Stderr, errorMessage(err))
		os.Exit(1)
	}
}

// newRoot builds the whole command tree.
func newRoot() *cobra.Command {
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
		versionCmd(), bucketCmd(), feedbackCmd(), operatorCmd(), membersCmd(), snapshotCmd(), sharesCmd(), recoverCmd(), healthCmd())
	root.InitDefaultCompletionCmd() // cobra adds it at Execute; now, so that the walks below see it
	refuseUnknownSubcommands(root)
	refuseStrayArgs(root)
	return root
}

// refuseUnknownSubcommands makes every command that only groups subcommands (pause, limits,
// tls ca, completion, ...) refuse an unknown one with an error naming it and the valid ones:
// cobra prints such a parent's help and exits 0 for `quotad pause list`, which scripts took
// for success. The parent alone (`quotad pause`) still prints its help and exits 0, as git and
// kubectl do. A flag of the unknown subcommand (`quotad pause list --domain x`) gets the same
// error, not "unknown flag".
func refuseUnknownSubcommands(c *cobra.Command) {
	if c.HasSubCommands() && !c.Runnable() {
		c.Args = func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 {
				return unknownSubcommand(cmd, args[0])
			}
			return nil
		}
		c.RunE = func(cmd *cobra.Command, _ []string) error { return cmd.Help() }
		c.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error {
			if args := cmd.Flags().Args(); cmd.HasSubCommands() && len(args) > 0 {
				return unknownSubcommand(cmd, args[0])
			}
			return err
		})
	}
	for _, sub := range c.Commands() {
		refuseUnknownSubcommands(sub)
	}
}

func unknownSubcommand(cmd *cobra.Command, name string) error {
	var valid []string
	for _, sub := range cmd.Commands() {
		if sub.IsAvailableCommand() {
			valid = append(valid, sub.Name())
		}
	}
	hint := ""
	if cmd.SuggestionsMinimumDistance <= 0 {
		cmd.SuggestionsMinimumDistance = 2 // cobra's default, which it sets only for the root
	}
	if s := cmd.SuggestionsFor(name); len(s) > 0 {
		hint = " (did you mean " + strings.Join(s, " or ") + "?)"
	}
	return fmt.Errorf("unknown command %q for %q%s; valid: %s", name, cmd.CommandPath(), hint, strings.Join(valid, ", "))
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

// refuseStrayArgs makes every command that takes no arguments refuse them with an error
// naming them (cobra accepts and ignores them when a command declares nothing, and its NoArgs
// says `unknown command "extra" for "quotad status"`, as if it were a subcommand): `quotad
// status extra` is an error, not a silent no-op, and says what is wrong.
func refuseStrayArgs(c *cobra.Command) {
	if c.Runnable() && (c.Args == nil || reflect.ValueOf(c.Args).Pointer() == reflect.ValueOf(cobra.NoArgs).Pointer()) {
		c.Args = noArgs
	}
	for _, sub := range c.Commands() {
		refuseStrayArgs(sub)
	}
}

// exactArgs is cobra.ExactArgs(n) with an error naming what the command takes (the words
// of its Use line after its name) and what it got; cobra said only "accepts 1 arg(s),
// received 2".
func exactArgs(n int) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) == n {
			return nil
		}
		want := strings.Join(strings.Fields(cmd.Use)[1:], " ")
		if want == "" {
			want = "ARG"
		}
		what := "argument"
		if n != 1 {
			what = "arguments"
		}
		got := "none"
		if len(args) > 0 {
			got = fmt.Sprintf("%d: %s", len(args), quoteArgs(args))
		}
		return fmt.Errorf("%q takes %d %s, %s; got %s (see %s --help)", cmd.CommandPath(), n, what, want, got, cmd.CommandPath())
	}
}

// atLeastOneArg is cobra.MinimumNArgs(1) with an error naming what the command takes.
func atLeastOneArg(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return nil
	}
	return fmt.Errorf("%q takes at least one argument, %s; got none (see %s --help)",
		cmd.CommandPath(), strings.Join(strings.Fields(cmd.Use)[1:], " "), cmd.CommandPath())
}

func quoteArgs(args []string) string {
	quoted := make([]string, len(args))
	for i, a := range args {
		quoted[i] = strconv.Quote(a)
	}
	return strings.Join(quoted, " ")
}

// noArgs refuses any positional argument, naming them.
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) == 0 {
		return nil
	}
	what := "argument"
	if len(args) > 1 {
		what = "arguments"
	}
	return fmt.Errorf("%q takes no arguments; got the %s %s (options are flags starting with --: see %s --help)",
		cmd.CommandPath(), what, quoteArgs(args), cmd.CommandPath())
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
