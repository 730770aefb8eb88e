package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestDevRestartsNodesAndCleansUp is the README tour's "kill the leader" step with `make run`
// (quotad dev): dev prints each node's pid and keeps it in DATA_DIR/NODE.pid; kill -9 of the
// leader's pid fails over; Enter on dev's stdin restarts it; with every node killed dev keeps
// running and SIGHUP restarts them all; Ctrl-C stops the nodes and removes the temp dir.
func TestDevRestartsNodesAndCleansUp(t *testing.T) {
	// dev binds base+1+i (gRPC), +101+i (Raft), +201+i (gossip), +301+i (HTTP) for node i:
	// reserve exactly those ports.
	base, err := devPortBase(3)
	if err != nil {
		t.Fatal(err)
	}
	dev := exec.Command(binary, "dev", "--nodes", "3", "--port-base", strconv.Itoa(base),
		"--limits", filepath.Join("..", "examples", "limits.yaml"))
	stdin, err := dev.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := dev.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr lockedBuffer
	dev.Stderr = &stderr
	if err := dev.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = dev.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = dev.Process.Signal(syscall.SIGINT)
		select {
		case <-exited:
		case <-time.After(15 * time.Second):
			_ = dev.Process.Kill()
		}
		if t.Failed() {
			t.Logf("dev stderr (tail):\n%s", tail(stderr.String(), 30))
		}
	})
	var out lockedBuffer
	lines := make(chan string, 100)
	go func() {
		sc := bufio.NewScanner(io.TeeReader(stdout, &out))
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	// "node1  pid 123  grpc ..." per node, then "source DIR/dev.env".
	pids := map[string]int{}
	var dir string
	deadline := time.After(30 * time.Second)
	for dir == "" {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("dev exited early:\n%s\n%s", out.String(), stderr.String())
			}
			if m := regexp.MustCompile(`^(node\d)  pid (\d+) `).FindStringSubmatch(l); m != nil {
				pids[m[1]], _ = strconv.Atoi(m[2])
			}
			if d, ok := strings.CutPrefix(strings.TrimSpace(l), "source "); ok {
				dir = filepath.Dir(d)
			}
		case <-deadline:
			t.Fatalf("dev printed no dev.env line:\n%s", out.String())
		}
	}
	go func() { // keep draining stdout
		for range lines {
		}
	}()
	if len(pids) != 3 || !strings.HasPrefix(filepath.Base(dir), "quotad-dev-") {
		t.Fatalf("pids %v, dir %q from:\n%s", pids, dir, out.String())
	}
	pidFile := func(id string) int {
		b, err := os.ReadFile(filepath.Join(dir, id+".pid")) // = $QUOTAD_DEV_DIR/ID.pid
		if err != nil {
			return 0
		}
		p, _ := strconv.Atoi(strings.TrimSpace(string(b)))
		return p
	}
	for id, p := range pids {
		if pidFile(id) != p {
			t.Fatalf("%s.pid holds %d, dev printed %d", id, pidFile(id), p)
		}
	}
	env := devEnv(t, filepath.Join(dir, "dev.env"))
	if !slices.Contains(env, "QUOTAD_DEV_DIR="+dir) {
		t.Fatalf("dev.env does not set QUOTAD_DEV_DIR=%s: %v", dir, env)
	}
	run := func(args ...string) (string, error) {
		cmd := exec.Command(binary, args...)
		cmd.Env = append(os.Environ(), env...)
		b, err := cmd.CombinedOutput()
		return string(b), err
	}
	type status struct {
		Leader  *struct{ ID string } `json:"leader"`
		Members []struct {
			ID       string `json:"id"`
			Suffrage string `json:"suffrage"`
		} `json:"members"`
	}
	leader := func() string {
		s, err := run("status", "--json")
		var st status
		if err != nil || json.Unmarshal([]byte(s), &st) != nil || st.Leader == nil {
			return ""
		}
		return st.Leader.ID
	}
	waitFor(t, 30*time.Second, "a leader", func() bool { return leader() != "" })

	// Kill the leader by the pid dev printed: another node takes over, dev keeps running.
	l := leader()
	if err := syscall.Kill(pidFile(l), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	waitFor(t, 10*time.Second, "an admission after killing the leader", func() bool {
		_, err := run("acquire", "--domain", "provider", "--descriptor", "endpoint=search", "--timeout", "2s")
		return err == nil
	})
	t.Logf("admitted %v after kill -9 of leader %s", time.Since(killed).Round(time.Millisecond), l)
	waitFor(t, 5*time.Second, "dev to report the exit", func() bool { return strings.Contains(stderr.String(), l+" exited") })
	// Enter restarts it, with a new pid.
	old := pidFile(l)
	if _, err := io.WriteString(stdin, "\n"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, l+" restarted", func() bool { p := pidFile(l); return p != 0 && p != old && alive(p) })
	waitFor(t, 30*time.Second, "the restarted node to answer", func() bool {
		_, err := run("status", "--addr", nodeAddr(base, l))
		return err == nil
	})
	waitFor(t, 30*time.Second, "three voters again", func() bool { return voters(run) == 3 })

	// Kill every node: dev keeps running (the old dev exited "every node exited"), SIGHUP
	// restarts them all.
	for _, id := range []string{"node1", "node2", "node3"} {
		_ = syscall.Kill(pidFile(id), syscall.SIGKILL)
	}
	waitFor(t, 5*time.Second, "dev to see no node running", func() bool { return strings.Contains(stderr.String(), "no node is running") })
	select {
	case <-exited:
		t.Fatalf("dev exited when its nodes were killed:\n%s", tail(stderr.String(), 10))
	case <-time.After(500 * time.Millisecond):
	}
	if err := dev.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the cluster to answer after SIGHUP", func() bool { return voters(run) == 3 && leader() != "" })

	// Ctrl-C: nodes stopped, the temp dir removed.
	final := []int{pidFile("node1"), pidFile("node2"), pidFile("node3")}
	if err := dev.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case <-exited:
	case <-time.After(20 * time.Second):
		t.Fatal("dev did not exit on SIGINT")
	}
	for _, p := range final {
		if alive(p) {
			t.Fatalf("node pid %d still runs after dev exited", p)
		}
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("dev left its temp dir %s: %v", dir, err)
	}
}

// nodeAddr is dev's gRPC address of node id (nodeN listens on base+N).
func nodeAddr(base int, id string) string {
	n, _ := strconv.Atoi(strings.TrimPrefix(id, "node"))
	return fmt.Sprintf("127.0.0.1:%d", base+n)
}

func voters(run func(...string) (string, error)) int {
	s, err := run("status", "--json")
	if err != nil {
		return 0
	}
	var st struct {
		Members []struct {
			Suffrage string `json:"suffrage"`
			State    string `json:"state"`
		} `json:"members"`
	}
	if json.Unmarshal([]byte(s), &st) != nil {
		return 0
	}
	n := 0
	for _, m := range st.Members {
		if m.Suffrage == "voter" && (m.State == "leader" || m.State == "follower") {
			n++
		}
	}
	return n
}

// alive reports whether pid is a running (not zombie) process.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	f := strings.Fields(string(b))
	return len(f) > 2 && f[2] != "Z"
}

type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
