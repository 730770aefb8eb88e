package proccluster

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestFreePortsDistinctAndFreeForTCPAndUDP(t *testing.T) {
	ports, err := FreePorts(8)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, p := range ports {
		if seen[p] {
			t.Fatalf("port %d twice in %v", p, ports)
		}
		seen[p] = true
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			t.Fatalf("tcp %d: %v", p, err)
		}
		l.Close()
		u, err := net.ListenPacket("udp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			t.Fatalf("udp %d: %v", p, err)
		}
		u.Close()
	}
}

// fakeAgent writes a shell script standing in for quotad: it prints help, or logs its
// arguments and sleeps (an "agent").
func fakeAgent(t *testing.T) string {
	t.Helper()
	if _, err := os.Stat("/bin/sh"); err != nil {
		t.Skip("no /bin/sh")
	}
	p := filepath.Join(t.TempDir(), "quotad")
	script := `#!/bin/sh
if [ "$2" = "--help" ]; then
  echo "      --data-dir string   dir"
  echo "      --snapshot-threshold uint   n"
  exit 0
fi
echo "args: $*"
echo "env: $FAKE_ENV"
exec sleep 60
`
	if err := os.WriteFile(p, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestAgentFlags(t *testing.T) {
	f := AgentFlags(fakeAgent(t))
	if !f["data-dir"] || !f["snapshot-threshold"] || f["trailing-logs"] {
		t.Fatalf("flags %v", f)
	}
}

func TestProcessLifecycleArgsEnvLogs(t *testing.T) {
	bin := fakeAgent(t)
	dir, logDir := t.TempDir(), filepath.Join(t.TempDir(), "logs")
	c, err := Start(Config{Binary: bin, Dir: dir, LogDir: logDir, Nodes: 2, ExtraArgs: []string{"--x", "1"},
		NodeArgs: func(n *Node) []string { return []string{"--only-" + n.ID} },
		NodeEnv:  func(n *Node) []string { return []string{"FAKE_ENV=env-" + n.ID} }})
	if err != nil {
		t.Fatal(err)
	}
	defer c.KillAll()
	for i := range c.Nodes {
		if !c.Running(i) || c.Paused(i) {
			t.Fatalf("node %d: running %v paused %v", i, c.Running(i), c.Paused(i))
		}
	}
	c.Pause(0)
	if !c.Paused(0) {
		t.Fatal("not paused after Pause")
	}
	if c.Leader(context.Background()) != -1 {
		t.Fatal("a fake agent leads")
	}
	c.Resume(0)
	c.StopTimeout(0, time.Second)
	if c.Running(0) {
		t.Fatal("running after Stop")
	}
	i, err := c.PrepareNode()
	if err != nil || c.Running(i) {
		t.Fatalf("PrepareNode: %d %v running=%v", i, err, c.Running(i))
	}
	if err := c.Start(i); err != nil {
		t.Fatal(err)
	}
	if err := c.Start(0); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	c.Kill(1)
	c.StopAll(time.Second)
	if got := c.Nodes[0].Starts(); got != 2 {
		t.Fatalf("node1 started %d times, want 2", got)
	}
	b, err := os.ReadFile(filepath.Join(logDir, "node1.log"))
	if err != nil {
		t.Fatal(err)
	}
	log := string(b)
	for _, want := range []string{"--bootstrap-expect 2", "--x 1 --only-node1", "env: env-node1", "=== proccluster: start #2", "=== proccluster: exited"} {
		if !strings.Contains(log, want) {
			t.Errorf("node1.log lacks %q:\n%s", want, log)
		}
	}
	// Secure by default: credentials by file, never a secret on the command line.
	creds := c.Credentials()
	if creds == nil {
		t.Fatal("no credentials for a secure cluster")
	}
	for _, want := range []string{"--enable-debug", "--tls-ca " + creds.CAFile, "--gossip-key-file", "--bootstrap-token-file"} {
		if !strings.Contains(log, want) {
			t.Errorf("node1.log lacks %q", want)
		}
	}
	if strings.Contains(log, creds.Token) || strings.Contains(log, "--insecure") {
		t.Errorf("the token or --insecure on the command line:\n%s", log)
	}
	if u := c.URL(0, "/x"); !strings.HasPrefix(u, "https://") {
		t.Errorf("URL %s", u)
	}
	b, _ = os.ReadFile(filepath.Join(logDir, "node3.log"))
	if !strings.Contains(string(b), "--bootstrap-expect 0") {
		t.Errorf("an added node must join (--bootstrap-expect 0):\n%s", b)
	}
	if hits, _ := c.ScanLogs("env: env-node2"); len(hits) != 1 {
		t.Errorf("ScanLogs: %v", hits)
	}
}

// TestOverrideArgs: ExtraArgs and NodeArgs replace a flag the cluster already sets (the agent
// refuses one given twice), values and --name=value forms included; others are kept. A flag
// given twice within ExtraArgs (a harness default, then the user's own) keeps the last.
func TestOverrideArgs(t *testing.T) {
	base := []string{"agent", "--id", "n1", "--tls-cert", "a.pem", "--tls-key", "a-key.pem", "--enable-debug", "--insecure", "--log-format=json"}
	got := OverrideArgs(base, []string{"--tls-cert=b.pem", "--tls-key", "b-key.pem", "--insecure", "--log-format", "text", "--x", "1"})
	want := []string{"agent", "--id", "n1", "--enable-debug", "--tls-cert=b.pem", "--tls-key", "b-key.pem", "--insecure", "--log-format", "text", "--x", "1"}
	if !slices.Equal(got, want) {
		t.Fatalf("OverrideArgs:\n got %q\nwant %q", got, want)
	}
	got = OverrideArgs(base, []string{"--min-voters", "3", "--dead-node-timeout=5s", "--min-voters", "1", "--x"})
	want = []string{"agent", "--id", "n1", "--tls-cert", "a.pem", "--tls-key", "a-key.pem", "--enable-debug", "--insecure", "--log-format=json",
		"--dead-node-timeout=5s", "--min-voters", "1", "--x"}
	if !slices.Equal(got, want) {
		t.Fatalf("OverrideArgs with a flag twice in more:\n got %q\nwant %q", got, want)
	}
	if got := OverrideArgs(base, nil); !slices.Equal(got, base) {
		t.Fatalf("OverrideArgs(base, nil) = %q", got)
	}
}
