package e2e

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/quotad/quotad/internal/testports"
)

// TestDevClusterIsSecure: `quotad dev` (what `make run` starts) runs its nodes without
// --insecure: a call with no credential is refused, the credentials in dev.env are admin, and
// no secret is on an agent's command line.
func TestDevClusterIsSecure(t *testing.T) {
	// dev binds base+1+i (gRPC), +101+i (Raft), +201+i (gossip), +301+i (HTTP) for node i:
	// reserve exactly those ports.
	base, err := devPortBase(1)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	dev := exec.Command(binary, "dev", "--nodes", "1", "--port-base", fmt.Sprint(base), "--data-dir", dir,
		"--limits", filepath.Join("..", "examples", "limits.yaml"))
	dev.Stdout, dev.Stderr = os.Stderr, os.Stderr
	if err := dev.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = dev.Process.Signal(syscall.SIGINT)
		done := make(chan struct{})
		go func() { _ = dev.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = dev.Process.Kill()
		}
	})
	envFile := filepath.Join(dir, "dev.env")
	waitFor(t, 30*time.Second, "dev.env", func() bool { _, err := os.Stat(envFile); return err == nil })
	env := devEnv(t, envFile)
	addr := fmt.Sprintf("127.0.0.1:%d", base+1)
	status := func(extra ...string) (string, error) {
		cmd := exec.Command(binary, "status", "--addr", addr)
		cmd.Env = append(os.Environ(), extra...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	waitFor(t, 30*time.Second, "the dev cluster to answer its admin", func() bool { _, err := status(env...); return err == nil })

	// The CA alone (server-authenticated TLS) with no token and no client certificate.
	var caOnly []string
	for _, kv := range env {
		if strings.HasPrefix(kv, "QUOTAD_CACERT=") {
			caOnly = append(caOnly, kv)
		}
	}
	caOnly = append(caOnly, "QUOTAD_TOKEN=", "QUOTAD_CLIENT_CERT=", "QUOTAD_CLIENT_KEY=")
	if out, err := status(caOnly...); err == nil || !strings.Contains(out, "Unauthenticated") {
		t.Fatalf("a call without credentials to the dev cluster: err %v, output %q; want Unauthenticated", err, out)
	}
	pids, _ := exec.Command("pgrep", "-f", "--", "--data-dir "+filepath.Join(dir, "node1")).Output()
	pid := strings.Fields(string(pids))
	if len(pid) == 0 {
		t.Fatal("no agent process found for the dev node")
	}
	cmdline, err := os.ReadFile("/proc/" + pid[0] + "/cmdline")
	if err != nil {
		t.Fatal(err)
	}
	args := strings.ReplaceAll(string(cmdline), "\x00", " ")
	if strings.Contains(args, "--insecure") {
		t.Fatalf("the dev agent runs with --insecure: %s", args)
	}
	for _, kv := range env {
		if k, v, _ := strings.Cut(kv, "="); k == "QUOTAD_TOKEN" && strings.Contains(args, v) {
			t.Fatalf("the bootstrap token is on the agent's command line: %s", args)
		}
	}
}

// devEnv reads the export lines of dev.env as KEY=VALUE pairs.
func devEnv(t *testing.T, path string) []string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var env []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		for _, f := range strings.Fields(strings.TrimPrefix(strings.TrimSpace(sc.Text()), "export ")) {
			if k, v, ok := strings.Cut(f, "="); ok && strings.HasPrefix(k, "QUOTAD_") {
				env = append(env, k+"="+strings.Trim(v, `"'`))
			}
		}
	}
	return env
}

// devPortBase reserves (testports) the ports quotad dev --nodes nodes --port-base base binds
// and returns base.
func devPortBase(nodes int) (int, error) {
	var offs []int
	for kind := range 4 {
		for i := range nodes {
			offs = append(offs, kind*100+i+1)
		}
	}
	return testports.ReserveBase(offs...)
}

// TestDevRefusesBusyPorts: `quotad dev` checks every port before it starts a node, so a busy
// one (another dev cluster still running or shutting down) is a clear error naming the port,
// its node and flag, and --port-base — not the "cluster of N" banner followed by a node that
// exits with "address already in use".
func TestDevRefusesBusyPorts(t *testing.T) {
	base, err := devPortBase(1)
	if err != nil {
		t.Fatal(err)
	}
	busy, err := net.ListenPacket("udp", fmt.Sprintf("127.0.0.1:%d", base+201)) // node1's gossip, UDP only
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	dev := exec.Command(binary, "dev", "--nodes", "1", "--port-base", fmt.Sprint(base), "--data-dir", t.TempDir(),
		"--limits", filepath.Join("..", "examples", "limits.yaml"))
	var out strings.Builder
	dev.Stdout, dev.Stderr = &out, &out
	if err := dev.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- dev.Wait() }()
	select {
	case err = <-done:
	case <-time.After(20 * time.Second):
		_ = dev.Process.Signal(syscall.SIGINT)
		<-done
		t.Fatalf("quotad dev with a busy port kept running:\n%s", out.String())
	}
	want := fmt.Sprintf("port 127.0.0.1:%d (node1's --gossip-addr) is not free", base+201)
	if err == nil || !strings.Contains(out.String(), want) || !strings.Contains(out.String(), "--port-base") {
		t.Fatalf("quotad dev with a busy port: %v\n%s\nwant an error saying %q and naming --port-base", err, out.String(), want)
	}
	if strings.Contains(out.String(), "cluster of") || strings.Contains(out.String(), "pid ") {
		t.Fatalf("quotad dev started nodes or printed its banner before finding the port busy:\n%s", out.String())
	}
}
