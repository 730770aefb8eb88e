package main

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"os"
	"os/signal"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/internal/top"
)

func topCmd() *cobra.Command {
	var (
		addr     string
		interval time.Duration
		ratio    float64
		once     bool
	)
	cmd := &cobra.Command{
		Use:   "top",
		Short: "Live view of per-tenant usage, share and wait on contended buckets, and over-subscribed limits",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
			defer stop()
			switch {
			case math.IsNaN(ratio) || math.IsInf(ratio, 0) || ratio <= 0:
				return fmt.Errorf("--max-oversubscription %v: use a ratio above 0 (default 1.5: warn when a parent's children's limits sum to more than 1.5 × its rate)", ratio)
			case once:
				interval = 0
			case interval <= 0:
				return fmt.Errorf("--interval %v: use a positive refresh interval such as 1s (or --once for one frame)", interval)
			}
			// Find a node that answers, then keep its connection for the view.
			var src top.Source
			err := call(ctx, addr, func(ctx context.Context, conn *grpc.ClientConn) error {
				_, err := quotadv1.NewAdminClient(conn).Members(ctx, &quotadv1.MembersRequest{})
				return err
			})
			if err != nil {
				return err
			}
			opts, err := dialOptions()
			if err != nil {
				return err
			}
			conn, err := grpc.NewClient(splitList(addr)[0], opts...)
			if err != nil {
				return err
			}
			defer conn.Close()
			hc, scheme, err := httpClient()
			if err != nil {
				return err
			}
			src = top.Source{Admin: quotadv1.NewAdminClient(conn), HTTP: hc, Scheme: scheme}
			return top.Run(ctx, cmd.OutOrStdout(), src, ratio, interval)
		},
	}
	f := cmd.Flags()
	f.StringVar(&addr, "addr", defaultAddrs(), "comma-separated node gRPC addresses")
	f.DurationVar(&interval, "interval", time.Second, "refresh interval")
	f.Float64Var(&ratio, "max-oversubscription", 1.5, "warn when a parent's children's limits sum to more than this multiple of its rate")
	f.BoolVar(&once, "once", false, "print one frame and exit")
	return cmd
}

// httpClient reaches the nodes' HTTP endpoints (/debug/fair needs the admin credential) with
// the client commands' credentials: https when a CA or certificate is configured.
func httpClient() (*http.Client, string, error) {
	cfg := connConfig("")
	tlsCfg, err := cfg.TLSConfig()
	if err != nil {
		return nil, "", err
	}
	tok, err := cfg.BearerToken()
	if err != nil {
		return nil, "", err
	}
	scheme := "http"
	tr := http.DefaultTransport.(*http.Transport).Clone()
	if tlsCfg != nil {
		scheme, tr.TLSClientConfig = "https", tlsCfg
	}
	return &http.Client{Timeout: 3 * time.Second, Transport: bearerTransport{tr, tok}}, scheme, nil
}

// bearerTransport adds "Authorization: Bearer <token>" to every request (if token is set).
type bearerTransport struct {
	http.RoundTripper
	token string
}

func (b bearerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if b.token == "" {
		return b.RoundTripper.RoundTrip(r)
	}
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return b.RoundTripper.RoundTrip(r)
}
