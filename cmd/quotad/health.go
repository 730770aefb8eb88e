package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

// healthCmd asks one node's /healthz, for a container healthcheck: the image is FROM scratch
// (no curl or wget), so compose's healthcheck runs `quotad health` itself.
func healthCmd() *cobra.Command {
	var (
		httpAddr string
		timeout  time.Duration
	)
	cmd := &cobra.Command{
		Use:   "health",
		Short: "Ask a node's /healthz: exit 0 if it is ready, 1 if not (a container healthcheck)",
		Long: `Ask one node's /healthz and print its answer: exit 0 if the node is ready (it knows a
leader, can write its Raft log and is caught up), 1 otherwise, with the reason. The node's HTTP
address is --http-addr, else $QUOTAD_HTTP_ADDR (the agent's own setting, so inside a node's
container it needs no flag), else 127.0.0.1:7401. HTTPS with --cacert ($QUOTAD_CACERT), plain
HTTP without (a node started with --insecure). No credential is needed.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if httpAddr == "" {
				httpAddr = os.Getenv("QUOTAD_HTTP_ADDR")
			}
			if httpAddr == "" {
				httpAddr = "127.0.0.1:7401"
			}
			hc, scheme, err := httpClient()
			if err != nil {
				return err
			}
			hc.Timeout = timeout
			url := scheme + "://" + httpAddr + "/healthz"
			resp, err := hc.Get(url)
			if err != nil {
				hint := ""
				if scheme == "http" {
					hint = " (a secure node serves HTTPS: give --cacert or $QUOTAD_CACERT)"
				}
				return fmt.Errorf("GET %s: %v%s", url, err, hint)
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			msg := strings.TrimSpace(string(body))
			if resp.StatusCode == http.StatusBadRequest && scheme == "http" {
				return fmt.Errorf("%s serves HTTPS: give the CA that signed the nodes' certificates, --cacert or $QUOTAD_CACERT", httpAddr)
			}
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("%s: %s: %s", httpAddr, resp.Status, msg)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: %s\n", httpAddr, msg)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&httpAddr, "http-addr", "", "the node's HTTP address, host:port (default $QUOTAD_HTTP_ADDR, else 127.0.0.1:7401)")
	f.DurationVar(&timeout, "timeout", 3*time.Second, "give up after this long")
	return cmd
}
