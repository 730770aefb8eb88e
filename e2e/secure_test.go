package e2e

import (
	"crypto/tls"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/internal/proccluster"
)

// TestNoSecretOnCommandLineOrHTTP: a secure agent process has neither the gossip key nor the
// bootstrap token in /proc/PID/cmdline (world-readable) nor in /debug/pprof/cmdline, which
// only the admin may read.
func TestNoSecretOnCommandLineOrHTTP(t *testing.T) {
	c := startCluster(t, 1)
	creds := c.Credentials()
	gossipKey, err := pkifiles.ReadSecret(creds.GossipKeyFile)
	if err != nil {
		t.Fatal(err)
	}
	secrets := map[string]string{"bootstrap token": creds.Token, "gossip key": gossipKey}
	check := func(where, text string) {
		t.Helper()
		for name, secret := range secrets {
			if strings.Contains(text, secret) {
				t.Errorf("%s shows the %s", where, name)
			}
		}
	}
	raw, err := os.ReadFile("/proc/" + strconv.Itoa(c.Pid(0)) + "/cmdline")
	if err != nil {
		t.Fatal(err)
	}
	cmdline := strings.ReplaceAll(string(raw), "\x00", " ")
	if !strings.Contains(cmdline, "--gossip-key-file") || !strings.Contains(cmdline, "--bootstrap-token-file") {
		t.Fatalf("not the agent's command line: %s", cmdline)
	}
	check("/proc/PID/cmdline", cmdline)

	url := c.URL(0, "/debug/pprof/cmdline")
	resp, err := c.HTTPClient().Get(url)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "--tls-ca") {
		t.Fatalf("admin GET %s: %s %q", url, resp.Status, body)
	}
	check("/debug/pprof/cmdline", string(body))

	// Without the admin credential: only /metrics and /healthz answer.
	anon, err := proccluster.HTTPClient(nil, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	anon.Transport = &http.Transport{TLSClientConfig: mustTLS(t, c)}
	for path, want := range map[string]int{"/debug/pprof/cmdline": 401, "/debug/state": 401, "/metrics": 200, "/healthz": 200} {
		resp, err := anon.Get(c.URL(0, path))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("anonymous GET %s: %d, want %d", path, resp.StatusCode, want)
		}
	}
}

// TestAgentSecureByDefault: without TLS material the agent refuses to start and says how to
// make it; with --insecure it starts and warns.
func TestAgentSecureByDefault(t *testing.T) {
	dir := t.TempDir()
	out, err := exec.Command(binary, "agent", "--id", "n1", "--data-dir", filepath.Join(dir, "n1"),
		"--grpc-addr", "127.0.0.1:0", "--http-addr", "").CombinedOutput()
	if err == nil {
		t.Fatalf("the agent started without TLS material:\n%s", out)
	}
	for _, want := range []string{"quotad tls ca create", "quotad tls cert create --server", "quotad keygen", "--insecure"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the refusal lacks %q:\n%s", want, out)
		}
	}
	c, err := proccluster.Start(proccluster.Config{Binary: binary, Dir: dir, Nodes: 1, Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	defer c.KillAll()
	if _, err := c.WaitLeader(15 * time.Second); err != nil {
		t.Fatal(err)
	}
	hits, err := c.ScanLogs("RUNNING INSECURE")
	if err != nil || len(hits) != 1 {
		t.Fatalf("want one insecure warning at start, got %v (%v)", hits, err)
	}
	c.Stop(0)
	if err := c.Start(0); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WaitLeader(15 * time.Second); err != nil {
		t.Fatal(err)
	}
	if hits, _ := c.ScanLogs("RUNNING INSECURE"); len(hits) != 2 {
		t.Fatalf("want the warning at every start, got %d", len(hits))
	}
}

// mustTLS verifies c's nodes but presents no client certificate.
func mustTLS(t *testing.T, c *proccluster.Cluster) *tls.Config {
	t.Helper()
	cfg, err := client.TLSFiles{CAFile: c.Credentials().CAFile, ServerName: auth.ServerName(proccluster.ClusterName)}.Load()
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}
