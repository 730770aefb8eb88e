package e2e

import (
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestHealthCommand: `quotad health` (compose's healthcheck: the image has no curl) exits 0
// with "ok" on a ready node of a secure cluster, says to give the CA without one, takes the
// address from $QUOTAD_HTTP_ADDR (a node container's own setting), and exits 1 naming the
// reason on a node without a leader.
func TestHealthCommand(t *testing.T) {
	c := startCluster(t, 3)
	if _, err := c.WaitLeader(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	creds := c.Credentials()
	health := func(env []string, args ...string) (string, int) {
		t.Helper()
		cmd := exec.Command(binary, append([]string{"health"}, args...)...)
		cmd.Env = append(cleanEnv(), env...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			if ee, ok := err.(*exec.ExitError); ok {
				return string(out), ee.ExitCode()
			}
			t.Fatal(err)
		}
		return string(out), 0
	}
	ca := "QUOTAD_CACERT=" + creds.CAFile
	for i := range c.Nodes {
		if out, code := health([]string{ca}, "--http-addr", c.Nodes[i].HTTPAddr); code != 0 || !strings.Contains(out, "ok") {
			t.Fatalf("health of ready node %d: exit %d: %s", i, code, out)
		}
	}
	if out, code := health([]string{ca, "QUOTAD_HTTP_ADDR=" + c.Nodes[1].HTTPAddr}); code != 0 || !strings.Contains(out, c.Nodes[1].HTTPAddr+": ok") {
		t.Fatalf("health from $QUOTAD_HTTP_ADDR: exit %d: %s", code, out)
	}
	if out, code := health(nil, "--http-addr", c.Nodes[0].HTTPAddr); code != 1 || !strings.Contains(out, "--cacert") {
		t.Fatalf("health without the CA: exit %d: %s", code, out)
	}
	c.Kill(1)
	c.Kill(2)
	deadline := time.Now().Add(15 * time.Second)
	for {
		out, code := health([]string{ca}, "--http-addr", c.Nodes[0].HTTPAddr, "--timeout", "2s")
		if code == 1 && strings.Contains(out, "503") && strings.Contains(out, "no leader") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("health of a node that lost quorum: exit %d: %s", code, out)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// cleanEnv is the environment without QUOTAD_* settings of the caller.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "QUOTAD_") {
			env = append(env, kv)
		}
	}
	return env
}
