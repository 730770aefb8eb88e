// Package e2e tests quotad as its users run it: separate agent processes started from the
// built binary, killed with SIGKILL, restarted from their data dirs, driven by the CLI and by
// worker processes.
package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/proccluster"
)

const limits = `
domain: provider
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
descriptors:
  - key: endpoint
    value: charges
    rate_limit: {unit: minute, requests_per_unit: 6, burst: 10}
  - key: endpoint
    value: search
    rate_limit: {unit: second, requests_per_unit: 50, burst: 20}
`

var binary string

func TestMain(m *testing.M) {
	if os.Getenv(workerEnv) != "" {
		os.Exit(runWorker())
	}
	dir, err := os.MkdirTemp("", "quotad-e2e-")
	if err != nil {
		panic(err)
	}
	if binary = os.Getenv("QUOTAD_BIN"); binary == "" {
		if binary, err = proccluster.Build("..", dir); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func startCluster(t *testing.T, n int, extra ...string) *proccluster.Cluster {
	t.Helper()
	return startClusterWith(t, n, limits, extra...)
}

// startClusterWith is startCluster with the limits file limitsYAML.
func startClusterWith(t *testing.T, n int, limitsYAML string, extra ...string) *proccluster.Cluster {
	t.Helper()
	dir := t.TempDir()
	lf := filepath.Join(dir, "limits.yaml")
	if err := os.WriteFile(lf, []byte(limitsYAML), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := proccluster.Start(proccluster.Config{Binary: binary, Dir: dir, Nodes: n, LimitsFile: lf, ExtraArgs: extra})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.KillAll()
		if t.Failed() {
			for _, n := range c.Nodes {
				if b, err := os.ReadFile(n.LogPath); err == nil {
					t.Logf("%s log:\n%s", n.ID, tail(string(b), 40))
				}
			}
		}
	})
	if _, err := c.WaitLeader(15 * time.Second); err != nil {
		t.Fatal(err)
	}
	return c
}

func tail(s string, lines int) string {
	parts := strings.Split(s, "\n")
	if len(parts) > lines {
		parts = parts[len(parts)-lines:]
	}
	return strings.Join(parts, "\n")
}

type cliDecision struct {
	Admitted     bool   `json:"admitted"`
	Reason       string `json:"reason"`
	Scope        string `json:"scope"`
	Limit        uint64 `json:"limit"`
	Remaining    uint64 `json:"remaining"`
	ResetAfterMs int64  `json:"reset_after_ms"`
	RetryAfterMs int64  `json:"retry_after_ms"`
	LeaseID      uint64 `json:"lease_id"`
	LeaseTTLMs   int64  `json:"lease_ttl_ms"`
}

// cliAcquire runs `quotad acquire --json` and returns its decision and exit code.
// The CLI gets the admin credentials from the environment, as after `source dev.env`.
func cliAcquire(t *testing.T, c *proccluster.Cluster, descs ...string) (cliDecision, int) {
	t.Helper()
	args := []string{"acquire", "--addr", strings.Join(c.GRPCAddrs(), ","), "--domain", "provider", "--json", "--timeout", "5s"}
	for _, d := range descs {
		args = append(args, "--descriptor", d)
	}
	cmd := exec.Command(binary, args...)
	cmd.Env = append(os.Environ(), c.ClientEnv()...)
	out, err := cmd.Output()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	var d cliDecision
	if code == 0 || code == 3 {
		if err := json.Unmarshal(out, &d); err != nil {
			t.Fatalf("acquire printed %q: %v", out, err)
		}
	}
	return d, code
}

// TestCLIAcquireUntilDeniedThenKillLeader is the README tour: acquire until the burst is spent,
// denied with rate_limited by the endpoint with a correct retry_after; kill -9 the leader;
// a client listing all nodes gets decisions again within 3 s with the balance as it was.
func TestCLIAcquireUntilDeniedThenKillLeader(t *testing.T) {
	c := startCluster(t, 3)
	start := time.Now()
	for i := 1; i <= 10; i++ {
		if d, code := cliAcquire(t, c, "endpoint=charges"); code != 0 || !d.Admitted {
			t.Fatalf("acquire %d: exit %d %+v", i, code, d)
		}
	}
	d, code := cliAcquire(t, c, "endpoint=charges")
	if code != 3 {
		t.Fatalf("11th acquire %v after the first: exit %d %+v, want exit 3 (denied)", time.Since(start), code, d)
	}
	if d.Reason != "rate_limited" || d.Scope != "endpoint" || d.Limit != 6 {
		t.Fatalf("denial %+v, want rate_limited scope endpoint limit 6", d)
	}
	// 6/minute refills one unit per 10 s; the bucket holds less than one unit.
	if d.RetryAfterMs <= 0 || d.RetryAfterMs > 10000 {
		t.Fatalf("retry_after_ms %d, want in (0, 10000] for a 10 s refill", d.RetryAfterMs)
	}

	leader := c.Leader(context.Background())
	c.Kill(leader)
	killed := time.Now()
	for {
		d, code = cliAcquire(t, c, "endpoint=search")
		if code == 0 {
			break
		}
		if time.Since(killed) > 3*time.Second {
			t.Fatalf("no admission within 3 s of killing the leader: exit %d %+v", code, d)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("admitted again %v after kill -9 of the leader", time.Since(killed).Round(time.Millisecond))
	// The charges bucket held under one unit at the kill and refills one per 10 s, only while
	// a leader leads: it must still deny, with a retry_after that did not restart from 10 s.
	d, code = cliAcquire(t, c, "endpoint=charges")
	if code != 3 || d.Reason != "rate_limited" {
		t.Fatalf("charges after failover: exit %d %+v, want still denied (a debit was lost or the gap credited)", code, d)
	}
}

// TestBoundedAdmissionManyProcesses: worker processes hammer one refilling bucket of rate R
// and burst B for T seconds while the leader is killed with SIGKILL once in the middle; the
// total admitted must stay within B + R·T.
func TestBoundedAdmissionManyProcesses(t *testing.T) {
	c := startCluster(t, 3)
	const (
		workers = 4
		burst   = 20
		rate    = 50.0
	)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	duration := 4 * time.Second
	var wg sync.WaitGroup
	results := make([]workerResult, workers)
	errs := make([]error, workers)
	for w := range workers {
		cmd := exec.Command(self, "-test.run=^$")
		cmd.Env = append(append(os.Environ(), c.ClientEnv()...), workerEnv+"=1",
			"QUOTAD_WORKER_ADDRS="+strings.Join(c.GRPCAddrs(), ","),
			fmt.Sprintf("QUOTAD_WORKER_ID=w%d", w),
			"QUOTAD_WORKER_DURATION="+duration.String())
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, err := cmd.Output()
			if err != nil {
				errs[w] = fmt.Errorf("worker %d: %v: %s", w, err, out)
				return
			}
			errs[w] = json.Unmarshal(out, &results[w])
		}()
	}
	time.Sleep(duration / 2)
	leader, err := c.WaitLeader(5 * time.Second)
	if err != nil {
		t.Fatalf("in the middle of the run: %v", err)
	}
	c.Kill(leader)
	wg.Wait()
	var admitted, decided int64
	first, last := results[0].Start, results[0].End
	for w, r := range results {
		if errs[w] != nil {
			t.Fatal(errs[w])
		}
		admitted += r.Admitted
		decided += r.Decided
		if r.Start.Before(first) {
			first = r.Start
		}
		if r.End.After(last) {
			last = r.End
		}
	}
	T := last.Sub(first).Seconds()
	bound := burst + rate*T
	t.Logf("%d processes: %d admitted of %d decisions over %.2fs; bound B+R·T = %.1f", workers, admitted, decided, T, bound)
	if float64(admitted) > math.Floor(bound) {
		t.Fatalf("admitted %d > B + R·T = %.1f", admitted, bound)
	}
	if decided < 200 {
		t.Fatalf("only %d decisions: the workload did not run", decided)
	}
}

const workerEnv = "QUOTAD_E2E_WORKER"

type workerResult struct {
	Admitted int64     `json:"admitted"`
	Decided  int64     `json:"decided"`
	Start    time.Time `json:"start"`
	End      time.Time `json:"end"`
}

// runWorker is the body of a worker process: 8 goroutines acquire from "search" until the
// duration ends, retrying one request ID across nodes until it gets a decision.
func runWorker() int {
	addrs := strings.Split(os.Getenv("QUOTAD_WORKER_ADDRS"), ",")
	id := os.Getenv("QUOTAD_WORKER_ID")
	duration, err := time.ParseDuration(os.Getenv("QUOTAD_WORKER_DURATION"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	var creds client.Config // the cluster's credentials, from QUOTAD_* in the environment
	creds.LoadEnv()
	opts, err := creds.DialCredentials()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	var clients []quotadv1.QuotaClient
	for _, a := range addrs {
		conn, err := grpc.NewClient(a, opts...)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		defer conn.Close()
		clients = append(clients, quotadv1.NewQuotaClient(conn))
	}
	var admitted, decided atomic.Int64
	res := workerResult{Start: time.Now()}
	deadline := res.Start.Add(duration)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			client := fmt.Sprintf("%s-%d", id, g)
			for req := uint64(1); time.Now().Before(deadline); req++ {
				adm := &quotadv1.Admission{RequestId: req, Domain: "provider", Cost: 1,
					Descriptors: []*quotadv1.Entry{{Key: "endpoint", Value: "search"}}}
				// Keep retrying the same request ID (even past the deadline) until decided, so
				// every admission that happened is counted.
				for attempt := 0; ; attempt++ {
					ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
					resp, err := clients[(g+attempt)%len(clients)].Acquire(ctx, &quotadv1.AcquireRequest{ClientId: client, Admissions: []*quotadv1.Admission{adm}})
					cancel()
					if err == nil {
						decided.Add(1)
						if resp.Decisions[0].Admitted {
							admitted.Add(1)
						}
						break
					}
					if attempt > 60 {
						fmt.Fprintln(os.Stderr, "no decision after 60 attempts:", err)
						os.Exit(1)
					}
					time.Sleep(50 * time.Millisecond)
				}
			}
		}()
	}
	wg.Wait()
	res.End = time.Now()
	res.Admitted, res.Decided = admitted.Load(), decided.Load()
	_ = json.NewEncoder(os.Stdout).Encode(res)
	return 0
}

func members(t *testing.T, c *proccluster.Cluster, addr string) *quotadv1.MembersResponse {
	t.Helper()
	opts, err := c.DialOptions()
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	resp, err := quotadv1.NewAdminClient(conn).Members(ctx, &quotadv1.MembersRequest{})
	if err != nil {
		return &quotadv1.MembersResponse{}
	}
	return resp
}

func suffrageOf(resp *quotadv1.MembersResponse, id string) string {
	for _, m := range resp.Members {
		if m.Id == id {
			return m.Suffrage
		}
	}
	return ""
}

func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestFourthNodeJoinsThenDeadNodesAreCleanedUpNeverBelowThree: a 4th agent started with
// --join becomes a voter; killed for longer than the dead-node timeout it is removed; a dead
// node of the remaining 3 is never removed (min voters 3).
func TestFourthNodeJoinsThenDeadNodesAreCleanedUpNeverBelowThree(t *testing.T) {
	c := startCluster(t, 3, "--dead-node-timeout", "3s")
	i, err := c.AddNode()
	if err != nil {
		t.Fatal(err)
	}
	fourth := c.Nodes[i].ID
	waitFor(t, 20*time.Second, fourth+" to become a voter", func() bool {
		return suffrageOf(members(t, c, c.Nodes[0].GRPCAddr), fourth) == "voter"
	})
	c.Kill(i)
	waitFor(t, 20*time.Second, fourth+" to be removed", func() bool {
		resp := members(t, c, c.Nodes[0].GRPCAddr)
		return len(resp.Members) == 3 && suffrageOf(resp, fourth) == ""
	})
	// Kill a follower of the 3 and wait well past the timeout: it must stay a voter.
	leader, err := c.WaitLeader(5 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	victim := (leader + 1) % 3
	c.Kill(victim)
	killed := time.Now()
	for time.Since(killed) < 6*time.Second {
		if s := suffrageOf(members(t, c, c.Nodes[leader].GRPCAddr), c.Nodes[victim].ID); s != "voter" {
			t.Fatalf("%s removed from a 3-voter cluster (suffrage %q) after %v", c.Nodes[victim].ID, s, time.Since(killed))
		}
		time.Sleep(250 * time.Millisecond)
	}
	// It comes back and the cluster is whole again.
	if err := c.Start(victim); err != nil {
		t.Fatal(err)
	}
	if d, code := cliAcquire(t, c, "endpoint=search"); code != 0 {
		t.Fatalf("acquire after the node returned: exit %d %+v", code, d)
	}
}
