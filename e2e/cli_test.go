package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/internal/proccluster"
)

// cli runs the quotad binary with the cluster's admin credentials in the environment (as after
// `source dev.env`) and returns its combined output, exit code and run time.
func cli(t *testing.T, c *proccluster.Cluster, args ...string) (string, int, time.Duration) {
	t.Helper()
	cmd := exec.Command(binary, args...)
	cmd.Env = os.Environ()
	if c != nil {
		cmd.Env = append(cmd.Env, c.ClientEnv()...)
		cmd.Env = append(cmd.Env, "QUOTAD_ADDR="+strings.Join(c.GRPCAddrs(), ","))
	}
	start := time.Now()
	out, err := cmd.CombinedOutput()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return string(out), code, time.Since(start)
}

// mustCLI is cli that wants exit code 0 and returns the output.
func mustCLI(t *testing.T, c *proccluster.Cluster, args ...string) string {
	t.Helper()
	out, code, _ := cli(t, c, args...)
	if code != 0 {
		t.Fatalf("quotad %s: exit %d\n%s", strings.Join(args, " "), code, out)
	}
	return out
}

// wantCLI runs a command that must fail with exit code 1 (or 3 if code says so) and print
// every word.
func wantCLI(t *testing.T, c *proccluster.Cluster, code int, words []string, args ...string) string {
	t.Helper()
	out, got, _ := cli(t, c, args...)
	if got != code {
		t.Fatalf("quotad %s: exit %d, want %d\n%s", strings.Join(args, " "), got, code, out)
	}
	for _, w := range words {
		if !strings.Contains(out, w) {
			t.Fatalf("quotad %s: output lacks %q:\n%s", strings.Join(args, " "), w, out)
		}
	}
	return out
}

// TestCLIRefusesBadInputAndDeadAddresses: the sharp edges of issue 15, tried as written there,
// without a cluster: every refusal names the flag and says what to do, and a list of dead
// addresses fails within 2 s naming each address and why.
func TestCLIRefusesBadInputAndDeadAddresses(t *testing.T) {
	ports, err := proccluster.FreePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	dead := []string{"127.0.0.1:" + strconv.Itoa(ports[0]), "127.0.0.1:" + strconv.Itoa(ports[1])}
	for _, tc := range []struct {
		args  []string
		words []string
	}{
		{[]string{"acquire", "--addr", dead[0]}, []string{"--domain is required"}},
		{[]string{"acquire", "--addr", dead[0], "--domain", "provider", "--cost", "0"}, []string{"--cost 0", "1 or more"}},
		{[]string{"release", "--addr", dead[0]}, []string{"--lease-id is required"}},
		{[]string{"status", "--addr", "127.0.0.1"}, []string{"--addr", `"127.0.0.1" has no port`, "host:port"}},
		{[]string{"status", "--addr", dead[0], "extra"}, []string{`"quotad status" takes no arguments; got the argument "extra"`}},
		{[]string{"acquire", "--addr", dead[0], "--domain", "p", "stray"}, []string{`"quotad acquire" takes no arguments; got the argument "stray"`}},
		{[]string{"limits", "apply", "--addr", dead[0]}, []string{"no limits file"}},
		{[]string{"agent", "--id", "n1"}, []string{"--data-dir is required"}},
		{[]string{"agent", "--data-dir", t.TempDir()}, []string{"--id is required"}},
		{[]string{"agent", "--insecure", "--id", "n1", "--data-dir", t.TempDir(), "--http-addr", "",
			"--raft-leader-lease-timeout", "300ms", "--raft-heartbeat-timeout", "5ms"},
			[]string{"--raft-leader-lease-timeout 300ms must be <= --raft-heartbeat-timeout 5ms"}},
	} {
		out := wantCLI(t, nil, 1, tc.words, tc.args...)
		for _, goName := range []string{"Request.Domain", "DataDir", "LeaderLeaseTimeout", "HeartbeatTimeout"} {
			if strings.Contains(out, goName) {
				t.Fatalf("quotad %v names the Go field %s:\n%s", tc.args, goName, out)
			}
		}
	}
	empty := filepath.Join(t.TempDir(), "empty.yaml")
	if err := os.WriteFile(empty, []byte("# no domains\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	wantCLI(t, nil, 1, []string{"empty.yaml", "no domains"}, "limits", "apply", "--addr", dead[0], empty)

	for _, args := range [][]string{
		{"status", "--addr", strings.Join(dead, ",")},
		{"acquire", "--addr", strings.Join(dead, ","), "--domain", "provider"},
		{"limits", "get", "--addr", strings.Join(dead, ",")},
	} {
		out, code, took := cli(t, nil, args...)
		if code != 1 || took > 2*time.Second {
			t.Fatalf("quotad %v against dead addresses: exit %d after %v, want 1 within 2s\n%s", args, code, took, out)
		}
		for _, a := range dead {
			if !regexp.MustCompile(regexp.QuoteMeta(a) + `: connection refused`).MatchString(out) {
				t.Fatalf("quotad %v: output does not say why %s failed:\n%s", args, a, out)
			}
		}
	}
	// The version, both ways.
	v1, v2 := mustCLI(t, nil, "version"), mustCLI(t, nil, "--version")
	if v1 != v2 || !strings.HasPrefix(v1, "quotad ") || !strings.Contains(v1, "go1.") {
		t.Fatalf("quotad version %q, --version %q", v1, v2)
	}
}

const concurrencyDomain = `
domain: jobs
descriptors:
  - key: kind
    value: report
    concurrency: {max_in_flight: 1, lease_ttl: 20s}
`

// TestCLIOperatorCommands drives a 3-process secure cluster through the CLI as an operator:
// limits apply (positional, dry run, upsert, -f DIR, replace-all, delete, empty refused),
// strict_keys against the endpont typo, a concurrency denial's retry_after, bucket status,
// feedback, leadership transfer, member removal, and quotad_build_info on /metrics.
func TestCLIOperatorCommands(t *testing.T) {
	c := startCluster(t, 3)
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	jobs := write("jobs.yaml", concurrencyDomain)

	// Dry run: the change is printed, nothing applied.
	out := mustCLI(t, c, "limits", "apply", jobs, "--dry-run")
	if !strings.Contains(out, "+ domain jobs") || !strings.Contains(out, "nothing applied") {
		t.Fatalf("dry run:\n%s", out)
	}
	if got := mustCLI(t, c, "limits", "get"); strings.Contains(got, "domain: jobs") {
		t.Fatalf("a dry run applied:\n%s", got)
	}
	// Upsert, the file positional: provider stays.
	out = mustCLI(t, c, "limits", "apply", jobs)
	if !strings.Contains(out, "+ domain jobs") || !strings.Contains(out, "domains: jobs, provider") {
		t.Fatalf("upsert:\n%s", out)
	}
	// A concurrency denial says when the lease on that level expires.
	// Limits above a node's message cap (1 MiB) say what to do (user trial: the raw "grpc:
	// received message larger than max").
	big := write("big.yaml", concurrencyDomain+strings.Repeat("# padding to 1.2 MB of comments\n", 40000))
	wantCLI(t, c, 1, []string{"larger than max", "split them into several files", "--max-request-bytes on every agent"}, "limits", "apply", big)
	// The granted TTL is shown: --lease-ttl 10h is capped by the limit's lease_ttl 20s.
	acq := []string{"acquire", "--domain", "jobs", "--descriptor", "kind=report", "--json"}
	var d cliDecision
	out = mustCLI(t, c, append(acq, "--lease-ttl", "10h")...)
	if err := json.Unmarshal([]byte(out), &d); err != nil || d.LeaseID == 0 || d.LeaseTTLMs != 20000 {
		t.Fatalf("acquire --lease-ttl 10h: %v, want lease_ttl_ms 20000 (the limit's lease_ttl)\n%s", err, out)
	}
	// Releasing a lease nobody holds says why and fails (user trial: released=false, exit 0).
	// It never says "another caller's" (that lease is refused PermissionDenied and stays held)
	// nor that permits are free "either way" (user trial).
	if out := wantCLI(t, c, 1, []string{"lease 999999 was not released", "expired", "holds no permits"}, "release", "--lease-id", "999999"); strings.Contains(out, "either way") || strings.Contains(out, "another caller's, or") {
		t.Fatalf("release of an unknown lease:\n%s", out)
	}
	out = wantCLI(t, c, 3, []string{`"concurrency_limited"`}, acq...)
	if err := json.Unmarshal([]byte(out), &d); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if d.RetryAfterMs < 15000 || d.RetryAfterMs > 20000 {
		t.Fatalf("concurrency denial retry_after_ms %d, want the 20 s lease's remaining time", d.RetryAfterMs)
	}
	// bucket status shows the permit held.
	var st struct {
		Buckets []struct {
			Scope       string `json:"scope"`
			InFlight    uint64 `json:"in_flight"`
			MaxInFlight uint64 `json:"max_in_flight"`
		} `json:"buckets"`
	}
	out = mustCLI(t, c, "bucket", "status", "--domain", "jobs", "--descriptor", "kind=report", "--json")
	if err := json.Unmarshal([]byte(out), &st); err != nil || len(st.Buckets) != 2 || st.Buckets[1].InFlight != 1 || st.Buckets[1].MaxInFlight != 1 {
		t.Fatalf("bucket status: %v\n%s", err, out)
	}
	// -f DIR of per-domain files, with strict_keys on provider: the endpont typo is refused.
	strict := strings.Replace(limits, "descriptors:", "strict_keys: true\ndescriptors:", 1)
	write("limits.d/provider.yaml", strict)
	write("limits.d/jobs.yaml", concurrencyDomain)
	out = mustCLI(t, c, "limits", "apply", "-f", filepath.Join(dir, "limits.d"))
	if !strings.Contains(out, "~ provider: strict_keys false -> true") {
		t.Fatalf("apply -f DIR:\n%s", out)
	}
	wantCLI(t, c, 4, []string{"reason=invalid", `"endpont"`, "strict_keys"}, "acquire", "--domain", "provider", "--descriptor", "endpont=charges")
	// bucket status refuses the typo as acquire does (user trial: it listed only the domain
	// bucket, exit 0).
	wantCLI(t, c, 1, []string{"InvalidArgument", `"endpont"`, "strict_keys"}, "bucket", "status", "--domain", "provider", "--descriptor", "endpont=charges")
	// Feedback pauses the scope named.
	mustCLI(t, c, "feedback", "--domain", "provider", "--descriptor", "endpoint=search", "--status", "429", "--retry-after", "30s")
	// A Retry-After above max_pause says it was clamped, naming max_pause (user trial).
	if out := mustCLI(t, c, "feedback", "--domain", "provider", "--descriptor", "endpoint=charges", "--status", "429", "--retry-after", "2h"); !strings.Contains(out, "for 300000ms") ||
		!strings.Contains(out, "--retry-after 2h0m0s was clamped to the domain's max_pause 5m0s") {
		t.Fatalf("feedback --retry-after 2h:\n%s", out)
	}
	// Lifted at once: the check below wants endpoint=charges without a pause (both were
	// added in one session by different branches; together they failed every run).
	mustCLI(t, c, "pause", "lift", "--domain", "provider", "--descriptor", "endpoint=charges")
	if out := mustCLI(t, c, "feedback", "--domain", "provider", "--descriptor", "endpoint=search", "--status", "429", "--retry-after", "1m"); strings.Contains(out, "clamped") {
		t.Fatalf("feedback --retry-after 1m says clamped:\n%s", out)
	}
	// A cost above the maximum says what to do.
	wantCLI(t, c, 4, []string{"cost 2000000000000 is above the maximum", "split the work"}, "acquire", "--domain", "provider", "--cost", "2000000000000")
	// Token messages: "a token of role admin", not "a admin token"; a second revoke says the
	// token is already revoked (or unknown), not just "no token".
	if out := wantCLI(t, c, 1, []string{"a token of role admin may not have them"}, "token", "create", "--role", "admin", "--domain", "provider"); strings.Contains(out, "a admin") {
		t.Fatalf("token create --role admin --domain:\n%s", out)
	}
	out = mustCLI(t, c, "token", "create", "--role", "reader")
	acc := ""
	for _, l := range strings.Split(out, "\n") {
		if v, ok := strings.CutPrefix(l, "accessor: "); ok {
			acc = strings.TrimSpace(v)
		}
	}
	mustCLI(t, c, "token", "revoke", acc)
	wantCLI(t, c, 1, []string{"already revoked", acc}, "token", "revoke", acc)
	wantCLI(t, c, 3, []string{"reason=paused", "scope=endpoint"}, "acquire", "--domain", "provider", "--descriptor", "endpoint=search")
	// Lifting a pause on a path that has none (the wrong value, or a typo in a value of a key
	// without one, names another valid bucket) fails naming the path it looked at (user
	// trial: "no pause was active on that scope of provider (scope endpoint)", exit 0, while
	// the endpoint meant stayed paused).
	wantCLI(t, c, 1, []string{"no pause is active on provider endpoint=charges", "nothing was lifted", "bucket status --domain provider --descriptor endpoint=charges"},
		"pause", "lift", "--domain", "provider", "--descriptor", "endpoint=charges")
	wantCLI(t, c, 3, []string{"reason=paused"}, "acquire", "--domain", "provider", "--descriptor", "endpoint=search")
	if out := mustCLI(t, c, "pause", "lift", "--domain", "provider", "--descriptor", "endpoint=search"); !strings.Contains(out, "lifted the pause on provider endpoint=search (scope endpoint)") {
		t.Fatalf("pause lift:\n%s", out)
	}
	mustCLI(t, c, "acquire", "--domain", "provider", "--descriptor", "endpoint=search")
	// Delete, and the refusals.
	wantCLI(t, c, 1, []string{`"nope" is not in force`, "jobs, provider"}, "limits", "delete", "nope")
	out = mustCLI(t, c, "limits", "delete", "jobs")
	if !strings.Contains(out, "- domain jobs") || !strings.Contains(out, "domains: provider") {
		t.Fatalf("delete:\n%s", out)
	}
	wantCLI(t, c, 1, []string{"no domains"}, "limits", "apply", "--replace-all", write("empty.yaml", "---\n"))
	out = mustCLI(t, c, "limits", "apply", "--replace-all", jobs)
	if !strings.Contains(out, "- domain provider") || !strings.Contains(out, "domains: jobs)") {
		t.Fatalf("replace-all:\n%s", out)
	}

	// Leadership transfer to a named follower.
	leader := c.Leader(context.Background())
	to := c.Nodes[(leader+1)%3].ID
	out = mustCLI(t, c, "operator", "transfer-leadership", "--to", to)
	if !strings.Contains(out, "leader: "+to) {
		t.Fatalf("transfer-leadership:\n%s", out)
	}
	// To the leader itself: a no-op that succeeds (user trial: "cannot transfer leadership to
	// itself", exit 1).
	out = mustCLI(t, c, "operator", "transfer-leadership", "--to", to)
	if !strings.Contains(out, to+" already leads; nothing to transfer") {
		t.Fatalf("transfer-leadership to the leader:\n%s", out)
	}
	// Member removal: stop a follower for good, remove it.
	gone := (c.Leader(context.Background()) + 1) % 3
	c.Stop(gone)
	// The stopped node's applied index is unknown, not the last one gossip carried (user trial).
	goneLine := func(out string) string {
		for _, l := range strings.Split(out, "\n") {
			if f := strings.Fields(l); len(f) > 0 && f[0] == c.Nodes[gone].ID {
				return l
			}
		}
		return ""
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		l := goneLine(mustCLI(t, c, "status"))
		if strings.Contains(l, "applied=unknown") {
			break
		}
		if time.Now().After(deadline) || (!strings.Contains(l, "follower") && strings.Contains(l, "applied=")) {
			t.Fatalf("status of the stopped %s: %q, want applied=unknown", c.Nodes[gone].ID, l)
		}
	}
	wantCLI(t, c, 1, []string{"NotFound", `"nodeX" is not in the Raft configuration`}, "members", "remove", "nodeX")
	out = mustCLI(t, c, "members", "remove", c.Nodes[gone].ID)
	if strings.Contains(strings.SplitN(out, "members:", 2)[1], c.Nodes[gone].ID) || strings.Contains(out, "still running") {
		t.Fatalf("members remove of a stopped node (no note that it still runs):\n%s", out)
	}
	var members struct {
		CommandVersion int `json:"command_version"`
		Members        []struct {
			ID             string
			CommandVersion int `json:"command_version"`
		} `json:"members"`
	}
	out = mustCLI(t, c, "status", "--json")
	if err := json.Unmarshal([]byte(out), &members); err != nil || len(members.Members) != 2 {
		t.Fatalf("status after removing %s: %v %+v", c.Nodes[gone].ID, err, members)
	}
	// The effective command version (what entries are written at) and each node's: all one build.
	if members.CommandVersion != fsm.CommandVersion || members.Members[0].CommandVersion != fsm.CommandVersion {
		t.Fatalf("status --json: command versions %+v, want %d everywhere\n%s", members, fsm.CommandVersion, out)
	}
	if out = mustCLI(t, c, "status"); !strings.Contains(out, fmt.Sprintf("command version: %d ", fsm.CommandVersion)) ||
		!strings.Contains(out, fmt.Sprintf(" cmd=%d", fsm.CommandVersion)) {
		t.Fatalf("status does not show the command versions:\n%s", out)
	}

	// Removing a node that still runs says it will come back and what to do (user trial: it
	// rejoined unannounced). The last follower: the leader alone is a live majority.
	running := (c.Leader(context.Background()) + 1) % 3
	if running == gone {
		running = (running + 1) % 3
	}
	out = mustCLI(t, c, "members", "remove", c.Nodes[running].ID)
	if !strings.Contains(out, "note: "+c.Nodes[running].ID+" is still running") || !strings.Contains(out, "stop its agent first") || !strings.Contains(out, "--rejoin-delay") {
		t.Fatalf("members remove of a running node does not warn that it rejoins:\n%s", out)
	}

	// quotad_build_info says what `quotad version` says.
	var vi struct{ Version, Commit string }
	if err := json.Unmarshal([]byte(mustCLI(t, nil, "version", "--json")), &vi); err != nil {
		t.Fatal(err)
	}
	resp, err := c.HTTPClient().Get(c.URL(c.Leader(context.Background()), "/metrics"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if !regexp.MustCompile(`quotad_build_info\{[^}]*version="` + regexp.QuoteMeta(vi.Version) + `"[^}]*\} 1`).Match(body) {
		t.Fatalf("/metrics has no quotad_build_info with version %q", vi.Version)
	}
}
