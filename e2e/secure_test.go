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

// TestProductionSetupWithTheCLI follows the README: make a CA, a node certificate, a gossip
// key, a bootstrap token and an admin and a worker certificate with the CLI, start an agent
// with them, and use it with --cacert/--client-cert/--client-key/--token-file.
func TestProductionSetupWithTheCLI(t *testing.T) {
	dir := t.TempDir()
	run := func(env []string, args ...string) (string, error) {
		cmd := exec.Command(binary, args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), env...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	must := func(args ...string) {
		t.Helper()
		if out, err := run(nil, args...); err != nil {
			t.Fatalf("quotad %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	must("tls", "ca", "create")
	must("tls", "cert", "create", "--server", "--name", "n1")
	must("tls", "cert", "create", "--client", "--name", "ops", "--role", "admin")
	must("tls", "cert", "create", "--client", "--name", "alice", "--role", "worker", "--domain", "provider")
	must("keygen", "--out", "gossip.key")
	must("keygen", "--token", "--out", "bootstrap.token")
	if out, err := run(nil, "tls", "ca", "create"); err == nil || !strings.Contains(out, "refusing to overwrite") {
		t.Fatalf("a second CA over the first: %v %s", err, out)
	}
	ports, err := proccluster.FreePorts(4)
	if err != nil {
		t.Fatal(err)
	}
	a := func(i int) string { return "127.0.0.1:" + strconv.Itoa(ports[i]) }
	agent := exec.Command(binary, "agent", "--id", "n1", "--data-dir", filepath.Join(dir, "data"),
		"--grpc-addr", a(0), "--raft-addr", a(1), "--gossip-addr", a(2), "--http-addr", a(3), "--bootstrap-expect", "1",
		"--limits", filepath.Join(dir, "limits.yaml"),
		"--tls-cert", "n1.pem", "--tls-key", "n1-key.pem", "--tls-ca", "quotad-ca.pem",
		"--gossip-key-file", "gossip.key", "--bootstrap-token-file", "bootstrap.token")
	agent.Dir = dir
	if err := os.WriteFile(filepath.Join(dir, "limits.yaml"), []byte(limits), 0o644); err != nil {
		t.Fatal(err)
	}
	logf, _ := os.Create(filepath.Join(dir, "agent.log"))
	agent.Stdout, agent.Stderr = logf, logf
	if err := agent.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		agent.Process.Kill()
		agent.Wait()
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(dir, "agent.log"))
			t.Logf("agent log:\n%s", tail(string(b), 30))
		}
	}()
	admin := []string{"--addr", a(0), "--cacert", "quotad-ca.pem", "--client-cert", "ops.pem", "--client-key", "ops-key.pem"}
	waitFor(t, 15*time.Second, "the agent to lead with the limits applied", func() bool {
		out, err := run(nil, append([]string{"status"}, admin...)...)
		if err != nil || !strings.Contains(out, "leader: n1") {
			return false
		}
		out, err = run(nil, append([]string{"limits", "get"}, admin...)...)
		return err == nil && strings.Contains(out, "domain: provider")
	})
	worker := []string{"--addr", a(0), "--cacert", "quotad-ca.pem", "--client-cert", "alice.pem", "--client-key", "alice-key.pem"}
	if out, err := run(nil, append([]string{"acquire", "--domain", "provider", "--descriptor", "endpoint=search"}, worker...)...); err != nil || !strings.HasPrefix(out, "admitted") {
		t.Fatalf("acquire with a worker certificate: %v %s", err, out)
	}
	// The bootstrap token from a file or the environment makes admin calls.
	os.WriteFile(filepath.Join(dir, "l.yaml"), []byte(limits), 0o644)
	apply := []string{"limits", "apply", "-f", "l.yaml", "--addr", a(0), "--cacert", "quotad-ca.pem"}
	if out, err := run(nil, append(apply, "--token-file", "bootstrap.token")...); err != nil || !strings.Contains(out, "applied limits version 2") {
		t.Fatalf("limits apply --token-file: %v %s", err, out)
	}
	tok, _ := pkifiles.ReadSecret(filepath.Join(dir, "bootstrap.token"))
	if out, err := run([]string{"QUOTAD_TOKEN=" + tok}, apply...); err != nil || !strings.Contains(out, "applied limits version 3") {
		t.Fatalf("limits apply with $QUOTAD_TOKEN: %v %s", err, out)
	}
	if out, err := run([]string{"QUOTAD_TOKEN="}, apply...); err == nil || !strings.Contains(out, "Unauthenticated") {
		t.Fatalf("limits apply without a token: %v %s", err, out)
	}
	// Plaintext gets a hint instead of a bare timeout.
	if out, err := run([]string{"QUOTAD_CACERT="}, "status", "--addr", a(0)); err == nil || !strings.Contains(out, "no TLS configured") {
		t.Fatalf("plaintext status: %v %s", err, out)
	}
}
