// Package deploy holds no code: its tests check the deployment files in this directory
// (container image and compose file, Kubernetes manifests, systemd unit, Grafana dashboard)
// against the quotad binary built from this tree.
package deploy

import (
	"fmt"
	"os"
	"testing"

	"github.com/quotad/quotad/internal/proccluster"
)

var (
	binary     string
	agentFlags map[string]bool
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "quotad-deploy-")
	if err != nil {
		panic(err)
	}
	if binary = os.Getenv("QUOTAD_BIN"); binary == "" {
		if binary, err = proccluster.Build("..", dir); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	agentFlags = proccluster.AgentFlags(binary)
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}
