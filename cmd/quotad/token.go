package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

func tokenCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "token", Short: "Create, list and revoke bearer tokens (admin)"}
	var addr string
	cmd.PersistentFlags().StringVar(&addr, "addr", defaultAddrs(), "comma-separated node gRPC addresses")

	var (
		role, tenant, description string
		domains                   []string
	)
	create := &cobra.Command{
		Use:   "create",
		Short: "Create a token and print it (once: the cluster keeps only its hash)",
		Example: `  quotad token create --role worker --domain provider --description "checkout workers"
  quotad token create --role worker --domain provider --tenant acme
  quotad token create --role reader`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkTenantFlag(cmd, tenant, "no token was created"); err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 15*time.Second)
			defer cancel()
			return callOnce(ctx, addr, "check `quotad token list` (and revoke a token nobody holds) before creating it again", func(ctx context.Context, conn *grpc.ClientConn) error {
				resp, err := quotadv1.NewAdminClient(conn).CreateToken(ctx, &quotadv1.CreateTokenRequest{
					Role: role, Domains: domains, Tenant: tenant, Description: description})
				if err != nil {
					return err
				}
				fmt.Printf("token:    %s\naccessor: %s\n", resp.Token, resp.Accessor)
				fmt.Println("Store the token now: it is not shown again. Callers send it with --token-file or $QUOTAD_TOKEN.")
				if len(resp.UnknownDomains) > 0 {
					fmt.Fprintf(os.Stderr, "warning: the current limits define no domain %s: the token can spend nothing there until they do (misspelled --domain? see quotad limits get)\n",
						strings.Join(resp.UnknownDomains, ", "))
				}
				return nil
			})
		},
	}
	f := create.Flags()
	f.StringVar(&role, "role", "", "admin, worker or reader (required)")
	f.StringArrayVar(&domains, "domain", nil, "worker: a limits domain it may spend in (repeatable; \"*\" for all)")
	f.StringVar(&tenant, "tenant", "", "worker: the only tenant descriptor value it may send (default: any)")
	f.StringVar(&description, "description", "", "what the token is for (shown by token list)")

	var asJSON bool
	list := &cobra.Command{
		Use:   "list",
		Short: "List tokens (accessor, role, scope; never the secrets)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), 10*time.Second)
			defer cancel()
			return call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
				resp, err := quotadv1.NewAdminClient(conn).ListTokens(ctx, &quotadv1.ListTokensRequest{})
				if err != nil {
					return err
				}
				if asJSON {
					type token struct {
						Accessor    string   `json:"accessor"`
						Role        string   `json:"role"`
						Domains     []string `json:"domains,omitempty"`
						Tenant      string   `json:"tenant,omitempty"`
						Description string   `json:"description,omitempty"`
						Created     string   `json:"created"`
					}
					out := []token{}
					for _, t := range resp.Tokens {
						out = append(out, token{t.Accessor, t.Role, t.Domains, t.Tenant, t.Description, created(t)})
					}
					return printJSON(out)
				}
				fmt.Printf("%-16s  %-6s  %-20s  %-10s  %-20s  %s\n", "ACCESSOR", "ROLE", "DOMAINS", "TENANT", "CREATED", "DESCRIPTION")
				for _, t := range resp.Tokens {
					fmt.Printf("%-16s  %-6s  %-20s  %-10s  %-20s  %s\n", t.Accessor, t.Role, strings.Join(t.Domains, ","), t.Tenant, created(t), t.Description)
				}
				return nil
			})
		},
	}
	list.Flags().BoolVar(&asJSON, "json", false, "print JSON")

	revoke := &cobra.Command{
		Use:   "revoke ACCESSOR",
		Short: "Revoke a token: calls carrying it are refused from then on",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), 15*time.Second)
			defer cancel()
			// lost: a try answered Unavailable/DeadlineExceeded, which call retries — also one
			// that committed, whose retry then finds the token already revoked. listed: the
			// token was live before the first try (a typo'd accessor never was).
			var lost error
			listed, known := false, false
			return call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
				admin := quotadv1.NewAdminClient(conn)
				if !known && lost == nil {
					if l, err := admin.ListTokens(ctx, &quotadv1.ListTokensRequest{}); err == nil {
						known = true
						for _, t := range l.Tokens {
							listed = listed || t.Accessor == args[0]
						}
					}
				}
				if _, err := admin.RevokeToken(ctx, &quotadv1.RevokeTokenRequest{Accessor: args[0]}); err != nil {
					c := status.Code(err)
					switch {
					case c == codes.Unavailable || c == codes.DeadlineExceeded:
						lost = err
						return err
					case c != codes.NotFound || lost == nil || !listed:
						return err
					}
					fmt.Printf("revoked %s: an earlier try whose answer was lost (%s) revoked it\n", args[0], status.Convert(lost).Message())
				} else {
					fmt.Printf("revoked %s\n", args[0])
				}
				// What the revoke does not take back (docs/security.md): the operator should
				// not take the worker for cut off yet.
				fmt.Println("note: shares it holds are not taken back: a Limiter may spend its grant in hand until the grant ends\n" +
					"(the lease term; renewals are refused). `quotad shares` marks such holders \"revoked — grant valid until\".")
				return nil
			})
		},
	}
	cmd.AddCommand(create, list, revoke)
	return cmd
}

// checkTenantFlag refuses a --tenant given but empty: an empty tenant means "every tenant",
// so `--tenant "$TENANT"` with TENANT unset made a worker of every tenant — the widest scope
// from a flag meant to narrow it (trial).
func checkTenantFlag(cmd *cobra.Command, tenant, nothing string) error {
	if cmd.Flags().Changed("tenant") && strings.TrimSpace(tenant) == "" {
		return fmt.Errorf("--tenant %q is empty; name the one tenant the worker acts for, or leave --tenant out for a worker of every tenant (%s)", tenant, nothing)
	}
	return nil
}

func created(t *quotadv1.TokenInfo) string {
	return time.UnixMilli(t.CreatedUnixMs).UTC().Format(time.RFC3339)
}

func pauseCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "pause", Short: "Manage pauses set by provider feedback (admin)"}
	var (
		addr, domain string
		descs        []string
	)
	lift := &cobra.Command{
		Use:   "lift",
		Short: "End a pause now, on exactly the scope named",
		Example: `  quotad pause lift --domain provider
  quotad pause lift --domain provider --descriptor endpoint=charges`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			req := &quotadv1.LiftPauseRequest{Domain: domain}
			for _, d := range descs {
				k, v, ok := strings.Cut(d, "=")
				if !ok || k == "" {
					return fmt.Errorf("--descriptor %q: use key=value, e.g. --descriptor endpoint=charges", d)
				}
				req.Descriptors = append(req.Descriptors, &quotadv1.Entry{Key: k, Value: v})
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 15*time.Second)
			defer cancel()
			// maybe: an earlier try that may have lifted the pause (call retries one that
			// failed Unavailable or DeadlineExceeded, also after it committed).
			var maybe error
			return call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
				resp, err := quotadv1.NewAdminClient(conn).LiftPause(ctx, req)
				if err != nil {
					maybe = err
					return err
				}
				path := domain
				for _, d := range descs {
					path += " " + d
				}
				if !resp.Lifted && maybe != nil {
					// Not an error: the lost try most likely lifted it (a retry of a lift that
					// worked finds nothing to lift), and the pause is not active now.
					fmt.Printf("no pause is active on %s now (scope %s): an earlier try whose answer was lost (%s) may have lifted it; quotad bucket status shows that path's pauses\n",
						path, resp.Scope, status.Convert(maybe).Message())
					return nil
				}
				if !resp.Lifted {
					// Exit 1, like release of a lease not held: a typo in a value (endpoint=serach)
					// names a valid, unpaused bucket, and a script must not take the real pause
					// as lifted.
					args := "--domain " + domain
					for _, d := range descs {
						args += " --descriptor " + d
					}
					return fmt.Errorf("no pause is active on %s (scope %s): nothing was lifted; check the descriptor values — quotad bucket status %s shows that path's pauses", path, resp.Scope, args)
				}
				fmt.Printf("lifted the pause on %s (scope %s)\n", path, resp.Scope)
				return nil
			})
		},
	}
	lift.Flags().StringVar(&domain, "domain", "", "limits domain (required)")
	lift.Flags().StringArrayVar(&descs, "descriptor", nil, "descriptor entry key=value of the paused scope, outermost first (repeatable; none: the whole domain)")
	cmd.PersistentFlags().StringVar(&addr, "addr", defaultAddrs(), "comma-separated node gRPC addresses")
	cmd.AddCommand(lift)
	return cmd
}
