package deploy

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/proccluster"
)

// composeLabel marks the image the test builds; compose labels its own containers, network
// and volumes with the project name, which is unique per run.
const composeLabel = "io.quotad.test"

func dockerOK(t *testing.T) {
	t.Helper()
	if os.Getenv("QUOTAD_COMPOSE") == "" {
		t.Skip("set QUOTAD_COMPOSE=1 (make test-compose) to run the compose test")
	}
	for _, tool := range []string{"docker", "docker-compose"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("no %s in PATH: skipping the compose test", tool)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "docker", "version", "--format", "{{.Server.Version}}").CombinedOutput(); err != nil {
		t.Skipf("docker daemon unreachable: %v: %s", err, bytes.TrimSpace(out))
	}
}

func run(t *testing.T, env []string, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// staleAfter: a compose test project older than this was left by a run that was killed (the
// test's own timeout is 10 minutes).
const staleAfter = 15 * time.Minute

// removeStale takes down compose test projects and images that killed runs left behind.
func removeStale(t *testing.T) {
	t.Helper()
	out, _ := run(t, nil, "docker", "ps", "-a", "--filter", "label=io.quotad.deploy=compose",
		"--format", `{{.ID}} {{.Label "com.docker.compose.project"}}`)
	projects := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		id, project, ok := strings.Cut(line, " ")
		if !ok || !strings.HasPrefix(project, "quotadtest") || projects[project] {
			continue
		}
		created, err := run(t, nil, "docker", "inspect", "-f", "{{.Created}}", id)
		ts, perr := time.Parse(time.RFC3339Nano, strings.TrimSpace(created))
		if err != nil || perr != nil || time.Since(ts) < staleAfter {
			continue
		}
		projects[project] = true
		t.Logf("removing stale compose project %s (created %v)", project, ts)
		_, _ = run(t, nil, "docker-compose", "-p", project, "-f", "compose.yaml", "down", "-v", "--remove-orphans", "-t", "1")
	}
	out, _ = run(t, nil, "docker", "images", "--filter", "label="+composeLabel, "--format", "{{.ID}} {{.CreatedAt}}")
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		id, created, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		ts, err := time.Parse("2006-01-02 15:04:05 -0700 MST", created)
		if err == nil && time.Since(ts) > staleAfter {
			_, _ = run(t, nil, "docker", "rmi", "-f", id)
		}
	}
}

// TestComposeClusterSurvivesLeaderKill follows docs/operations.md "Containers": build the
// image FROM scratch, make the credentials with deploy/compose/init.sh, `docker-compose up`
// the 3 nodes, acquire through the CLI, kill the leader's container, acquire again, start
// the container again from its volume, and tear everything down (also on failure).
func TestComposeClusterSurvivesLeaderKill(t *testing.T) {
	dockerOK(t)
	removeStale(t)
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	run4 := hex.EncodeToString(rnd[:])
	project := "quotadtest" + run4
	image := "quotad-compose-test:" + run4

	// The image, as `make image` builds it.
	ctxDir := t.TempDir()
	if err := os.Mkdir(filepath.Join(ctxDir, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	_ = os.Chmod(filepath.Join(ctxDir, "data"), 0o1777)
	// A static build (CGO_ENABLED=0) of this tree, whatever $QUOTAD_BIN is.
	if _, err := proccluster.Build("..", ctxDir); err != nil {
		t.Fatal(err)
	}
	df, _ := os.ReadFile("Dockerfile")
	_ = os.WriteFile(filepath.Join(ctxDir, "Dockerfile"), df, 0o644)
	if _, err := run(t, nil, "docker", "build", "-q", "--label", composeLabel+"="+project, "-t", image, ctxDir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = run(t, nil, "docker", "rmi", "-f", image) })

	// Credentials, with the documented script.
	base := t.TempDir()
	secrets := filepath.Join(base, "secrets")
	if out, err := run(t, []string{"QUOTAD=" + binary, "SECRETS=" + secrets, "NO_ENV_FILE=1"}, "./compose/init.sh"); err != nil {
		t.Fatal(err)
	} else if !strings.Contains(out, "docker-compose -f deploy/compose.yaml up -d") {
		t.Fatalf("init.sh printed:\n%s", out)
	}
	ports, err := proccluster.FreePorts(6)
	if err != nil {
		t.Fatal(err)
	}
	env := []string{"QUOTAD_IMAGE=" + image, "QUOTAD_SECRETS=" + secrets,
		fmt.Sprintf("QUOTAD_UID=%d", os.Getuid()), fmt.Sprintf("QUOTAD_GID=%d", os.Getgid())}
	var addrs []string
	for i := range 3 {
		env = append(env, fmt.Sprintf("QUOTAD_N%d_GRPC_PORT=%d", i+1, ports[i]), fmt.Sprintf("QUOTAD_N%d_HTTP_PORT=%d", i+1, ports[3+i]))
		addrs = append(addrs, fmt.Sprintf("127.0.0.1:%d", ports[i]))
	}
	compose := func(args ...string) (string, error) {
		return run(t, env, "docker-compose", append([]string{"-p", project, "-f", "compose.yaml"}, args...)...)
	}
	t.Cleanup(func() {
		if t.Failed() {
			out, _ := compose("logs", "--no-color", "--tail", "40")
			t.Logf("container logs:\n%s", out)
		}
		if out, err := compose("down", "-v", "--remove-orphans", "-t", "5"); err != nil {
			t.Errorf("docker-compose down: %v\n%s", err, out)
		}
	})
	if _, err := compose("up", "-d"); err != nil {
		t.Fatal(err)
	}

	clientDir := filepath.Join(base, "client")
	cliEnv := []string{"QUOTAD_ADDR=" + strings.Join(addrs, ","), "QUOTAD_CACERT=" + filepath.Join(clientDir, "quotad-ca.pem"),
		"QUOTAD_CLIENT_CERT=" + filepath.Join(clientDir, "admin.pem"), "QUOTAD_CLIENT_KEY=" + filepath.Join(clientDir, "admin-key.pem")}
	cfg := client.DefaultConfig(addrs...)
	cfg.TLSFiles = client.TLSFiles{CAFile: filepath.Join(clientDir, "quotad-ca.pem"), CertFile: filepath.Join(clientDir, "admin.pem"),
		KeyFile: filepath.Join(clientDir, "admin-key.pem"), ServerName: auth.ServerName("quotad")}
	opts, err := cfg.DialCredentials()
	if err != nil {
		t.Fatal(err)
	}
	members := func(addr string) (*quotadv1.MembersResponse, error) {
		conn, err := grpc.NewClient(addr, opts...)
		if err != nil {
			return nil, err
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		return quotadv1.NewAdminClient(conn).Members(ctx, &quotadv1.MembersRequest{})
	}
	waitLeader := func(skip string, timeout time.Duration) string {
		t.Helper()
		deadline := time.Now().Add(timeout)
		for {
			for _, a := range addrs {
				if m, err := members(a); err == nil && m.Leader != nil && m.Leader.Id != skip {
					return m.Leader.Id
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("no leader (other than %q) within %v", skip, timeout)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	acquire := func(timeout time.Duration) (time.Duration, string) {
		t.Helper()
		start := time.Now()
		var last string
		for time.Since(start) < timeout {
			out, err := run(t, cliEnv, binary, "acquire", "--domain", "provider", "--descriptor", "endpoint=search", "--json", "--timeout", "3s")
			var d struct{ Admitted bool }
			if err == nil && json.Unmarshal([]byte(out), &d) == nil && d.Admitted {
				return time.Since(start), out
			}
			last = out
			time.Sleep(100 * time.Millisecond)
		}
		t.Fatalf("no admission within %v: %s", timeout, last)
		return 0, ""
	}

	leader := waitLeader("", 60*time.Second)
	took, _ := acquire(30 * time.Second) // the limits file is applied by the first leader
	t.Logf("leader %s; first admission after %v", leader, took.Round(time.Millisecond))

	killed := time.Now()
	if _, err := compose("kill", leader); err != nil {
		t.Fatal(err)
	}
	killTook := time.Since(killed)
	acquire(20 * time.Second)
	next := waitLeader(leader, 10*time.Second)
	t.Logf("killed %s's container (docker-compose kill took %v); admitted again %v after the kill started, new leader %s",
		leader, killTook.Round(time.Millisecond), time.Since(killed).Round(time.Millisecond), next)
	if time.Since(killed) > 15*time.Second {
		t.Fatalf("failover took %v", time.Since(killed))
	}

	// The killed node comes back from its volume and catches up as a voter.
	if _, err := compose("start", leader); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		m, err := members(addrs[0])
		ok := false
		if err == nil && m.Leader != nil {
			for _, x := range m.Members {
				if x.Id == leader && x.Suffrage == "voter" && x.State == "follower" && x.AppliedIndex+20 >= m.Leader.AppliedIndex {
					ok = true
				}
			}
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not rejoin as a caught-up voter: %v %v", leader, m, err)
		}
		time.Sleep(300 * time.Millisecond)
	}
	logs, _ := compose("logs", "--no-color", leader)
	if !strings.Contains(logs, `"existing_state":true`) {
		t.Fatalf("%s restarted without its data (no existing_state:true in its log)", leader)
	}
	acquire(10 * time.Second)
}
