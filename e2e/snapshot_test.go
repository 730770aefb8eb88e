package e2e

import (
	"context"
	"encoding/json"
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

const snapshotLimits = `
domain: provider
rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
descriptors:
  - key: endpoint
    value: charges
    rate_limit: {unit: minute, requests_per_unit: 6, burst: 20}
  - key: endpoint
    value: reports
    concurrency: {max_in_flight: 4, lease_ttl: 10m}
---
domain: platform
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 600}
`

// runCLI runs the quotad CLI with the cluster's admin credentials and returns its output.
func runCLI(t *testing.T, c *proccluster.Cluster, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(binary, args...)
	cmd.Env = append(os.Environ(), c.ClientEnv()...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func dialNode(t *testing.T, c *proccluster.Cluster, i int) *grpc.ClientConn {
	t.Helper()
	opts, err := c.DialOptions()
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(c.Nodes[i].GRPCAddr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func acquireOn(ctx context.Context, conn *grpc.ClientConn, clientID string, reqID uint64, cost uint64, descs ...string) (*quotadv1.Decision, error) {
	adm := &quotadv1.Admission{RequestId: reqID, Domain: "provider", Cost: cost}
	for _, d := range descs {
		k, v, _ := strings.Cut(d, "=")
		adm.Descriptors = append(adm.Descriptors, &quotadv1.Entry{Key: k, Value: v})
	}
	resp, err := quotadv1.NewQuotaClient(conn).Acquire(ctx, &quotadv1.AcquireRequest{ClientId: clientID, Admissions: []*quotadv1.Admission{adm}})
	if err != nil {
		return nil, err
	}
	return resp.Decisions[0], nil
}

func bucket(ctx context.Context, t *testing.T, conn *grpc.ClientConn, endpoint, scope string) *quotadv1.BucketStatus {
	t.Helper()
	resp, err := quotadv1.NewQuotaClient(conn).Status(ctx, &quotadv1.StatusRequest{Domain: "provider",
		Descriptors: []*quotadv1.Entry{{Key: "endpoint", Value: endpoint}}})
	if err != nil {
		t.Fatalf("status %s: %v", endpoint, err)
	}
	for _, b := range resp.Buckets {
		if b.Scope == scope {
			return b
		}
	}
	t.Fatalf("status %s: no %s bucket in %v", endpoint, scope, resp.Buckets)
	return nil
}

// TestSnapshotSaveDestroyRestore: spend quota, hold leases, create a token and remember a
// decision on a 3-process cluster; `quotad snapshot save` through a follower; kill every node
// and delete every data dir; start a fresh cluster; `quotad snapshot restore` through a
// follower: limits, the balance (± refill), the leases, the token and the dedup window are as
// they were, on every node.
func TestSnapshotSaveDestroyRestore(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	a := startClusterWith(t, 3, snapshotLimits)
	leader := a.Leader(ctx)
	follower := (leader + 1) % 3
	conn := dialNode(t, a, leader)

	// State to carry over. Charges: burst 20, 6/min (one unit per 10 s): spend 15.
	for i := range 5 {
		if d, err := acquireOn(ctx, conn, "snap-test", uint64(100+i), 3, "endpoint=charges"); err != nil || !d.Admitted {
			t.Fatalf("charges %d: %v %v", i, d, err)
		}
	}
	var leases []uint64
	for i := range 2 {
		d, err := acquireOn(ctx, conn, "snap-test", uint64(200+i), 1, "endpoint=reports")
		if err != nil || !d.Admitted || d.LeaseId == 0 {
			t.Fatalf("reports %d: %v %v", i, d, err)
		}
		leases = append(leases, d.LeaseId)
	}
	// The decision a retry must get back: request 300, cost 2.
	orig, err := acquireOn(ctx, conn, "snap-test", 300, 2, "endpoint=charges")
	if err != nil || !orig.Admitted {
		t.Fatalf("request 300: %v %v", orig, err)
	}
	tok, err := quotadv1.NewAdminClient(conn).CreateToken(ctx, &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"provider"}, Description: "backup test"})
	if err != nil {
		t.Fatal(err)
	}
	before := bucket(ctx, t, conn, "charges", "endpoint")
	if before.Remaining > 3 {
		t.Fatalf("charges remaining %d before the save, want <= 3", before.Remaining)
	}

	// Save through a follower (it relays to the leader).
	file := filepath.Join(t.TempDir(), "backup.snap")
	out, err := runCLI(t, a, "snapshot", "save", "--addr", a.Nodes[follower].GRPCAddr, file)
	if err != nil || !strings.Contains(out, "saved "+file) {
		t.Fatalf("snapshot save: %v\n%s", err, out)
	}
	t.Log(strings.TrimSpace(out))
	out, err = runCLI(t, a, "snapshot", "inspect", "--json", file)
	if err != nil {
		t.Fatalf("snapshot inspect: %v\n%s", err, out)
	}
	var info struct {
		ClusterID     string   `json:"cluster_id"`
		Index         uint64   `json:"index"`
		Size          int64    `json:"size"`
		LimitsVersion uint64   `json:"limits_version"`
		Domains       []string `json:"domains"`
		Buckets       int      `json:"buckets"`
		Leases        int      `json:"leases"`
		DedupEntries  int      `json:"dedup_entries"`
		Tokens        int      `json:"tokens"`
		ChecksumOK    bool     `json:"checksum_ok"`
		FSMClockNs    int64    `json:"fsm_clock_ns"`
	}
	if err := json.Unmarshal([]byte(out), &info); err != nil {
		t.Fatalf("inspect printed %q: %v", out, err)
	}
	if !info.ChecksumOK || info.ClusterID == "" || info.Index == 0 || info.LimitsVersion != 1 || len(info.Domains) != 2 ||
		info.Leases != 2 || info.Tokens != 1 || info.DedupEntries < 8 || info.Buckets < 1 {
		t.Fatalf("inspect: %+v", info)
	}
	// A damaged copy is refused by inspect (and restore checks the same way first).
	damaged := filepath.Join(t.TempDir(), "damaged.snap")
	b, _ := os.ReadFile(file)
	b[len(b)-10] ^= 0xff
	_ = os.WriteFile(damaged, b, 0o600)
	if out, err := runCLI(t, a, "snapshot", "inspect", damaged); err == nil || !strings.Contains(out, "corrupt") {
		t.Fatalf("inspect of a damaged file: %v\n%s", err, out)
	}

	// Lose everything: every process and every data dir.
	a.KillAll()
	for _, n := range a.Nodes {
		if err := os.RemoveAll(n.DataDir); err != nil {
			t.Fatal(err)
		}
	}
	// A fresh cluster with the same credentials and no limits file.
	dir := t.TempDir()
	bc, err := proccluster.Start(proccluster.Config{Binary: binary, Dir: dir, Nodes: 3, Credentials: a.Credentials()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		bc.KillAll()
		if t.Failed() {
			for _, n := range bc.Nodes {
				if b, err := os.ReadFile(n.LogPath); err == nil {
					t.Logf("%s log:\n%s", n.ID, tail(string(b), 30))
				}
			}
		}
	})
	bl, err := bc.WaitLeader(20 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	// Let the new cluster's clock run ahead of the saved one: the restored state must keep its
	// own time (the leader re-bases its clock), or leases would expire and buckets refill by
	// the difference.
	time.Sleep(4 * time.Second)
	if out, err := runCLI(t, bc, "snapshot", "restore", "--addr", bc.Nodes[(bl+1)%3].GRPCAddr, damaged); err == nil {
		t.Fatalf("restore of a damaged file succeeded:\n%s", out)
	}
	// --dry-run says what the restore would change and restores nothing.
	out, err = runCLI(t, bc, "snapshot", "restore", "--dry-run", "--restore-tokens", "--addr", bc.Nodes[(bl+1)%3].GRPCAddr, file)
	if err != nil || !strings.Contains(out, "dry run: restoring") || !strings.Contains(out, "limits version  0 -> 2 (the file's 1") ||
		!strings.Contains(out, "nothing was restored (--dry-run)") || !strings.Contains(out, "tokens: would restore the file's 1") {
		t.Fatalf("snapshot restore --dry-run: %v\n%s", err, out)
	}
	if lim, err := quotadv1.NewAdminClient(dialNode(t, bc, bl)).GetLimits(ctx, &quotadv1.GetLimitsRequest{}); err != nil || lim.Version != 0 {
		t.Fatalf("limits after a dry run: %v %v, want none (nothing restored)", lim, err)
	}
	// A fresh cluster has no tokens of its own: --restore-tokens brings the saved one back (by
	// default a restore keeps the cluster's current tokens).
	out, err = runCLI(t, bc, "snapshot", "restore", "--restore-tokens", "--addr", bc.Nodes[(bl+1)%3].GRPCAddr, file)
	if err != nil || !strings.Contains(out, "restored ") || !strings.Contains(out, "tokens: restored the file's 1 (+1 added, -0 removed") ||
		!strings.Contains(out, "limits version  0 -> 2 (the file's 1") {
		t.Fatalf("snapshot restore: %v\n%s", err, out)
	}
	t.Log(strings.TrimSpace(out))
	restoredAt := time.Now()

	// Every node has the restored state (the followers by snapshot installation).
	deadline := time.Now().Add(20 * time.Second)
	for {
		var hashes []uint64
		var lv []uint64
		for i := range bc.Nodes {
			resp, err := bc.HTTPClient().Get(bc.URL(i, "/debug/state?hash=1"))
			if err != nil {
				continue
			}
			var s proccluster.State
			_ = json.NewDecoder(resp.Body).Decode(&s)
			resp.Body.Close()
			hashes, lv = append(hashes, s.Hash), append(lv, s.LimitsVersion)
		}
		if len(hashes) == 3 && hashes[0] == hashes[1] && hashes[1] == hashes[2] && lv[0] == 2 && lv[1] == 2 && lv[2] == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("replicas after the restore: hashes %v, limits versions %v", hashes, lv)
		}
		time.Sleep(200 * time.Millisecond)
	}

	// An entry after the restore moves the clock on (an idle tick at the latest).
	if d, err := acquireOn(ctx, dialNode(t, bc, bl), "snap-test", 999, 1, "endpoint=reports"); err != nil || !d.Admitted {
		t.Fatalf("acquire after the restore: %v %v", d, err)
	}
	st, err := bc.State(ctx, bl)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("saved FSM clock %v; restored leader's %v, %v after the restore", time.Duration(info.FSMClockNs), time.Duration(st.Clock), time.Since(restoredAt))
	if ahead := time.Duration(st.Clock - info.FSMClockNs); ahead > time.Since(restoredAt)+time.Second {
		t.Fatalf("the restored clock ran %v ahead of the saved one within %v of the restore (leader clock not re-based)", ahead, time.Since(restoredAt))
	}

	bconn := dialNode(t, bc, (bl+2)%3) // any node: followers forward
	lim, err := quotadv1.NewAdminClient(bconn).GetLimits(ctx, &quotadv1.GetLimitsRequest{})
	if err != nil || lim.Version != 2 || !strings.Contains(lim.Yaml, "platform") || !strings.Contains(lim.Yaml, "reports") {
		t.Fatalf("limits after the restore: %v %v", lim, err)
	}
	// The balance: what it was, plus at most the refill since the restore (one unit per 10 s;
	// nothing for the time between save and restore).
	after := bucket(ctx, t, bconn, "charges", "endpoint")
	refill := uint64(time.Since(restoredAt)/(10*time.Second)) + 1
	if after.Remaining < before.Remaining || after.Remaining > before.Remaining+refill {
		t.Fatalf("charges remaining %d after the restore, %d before (refill allowance %d)", after.Remaining, before.Remaining, refill)
	}
	// The leases are held, and can be released by their IDs.
	if r := bucket(ctx, t, bconn, "reports", "endpoint"); r.InFlight != 3 {
		t.Fatalf("reports in flight %d after the restore and one more acquire, want 3", r.InFlight)
	}
	rel, err := quotadv1.NewQuotaClient(bconn).Release(ctx, &quotadv1.ReleaseRequest{LeaseId: leases[0]})
	if err != nil || !rel.Released {
		t.Fatalf("release of restored lease %d: %v %v", leases[0], rel, err)
	}
	// The dedup window: a retry of request 300 gets the original decision and debits nothing.
	mid := bucket(ctx, t, bconn, "charges", "endpoint")
	again, err := acquireOn(ctx, bconn, "snap-test", 300, 2, "endpoint=charges")
	if err != nil || !again.Admitted || again.Remaining != orig.Remaining {
		t.Fatalf("retry of request 300 after the restore: %v %v; the original was %v", again, err, orig)
	}
	if end := bucket(ctx, t, bconn, "charges", "endpoint"); end.Remaining < mid.Remaining {
		t.Fatalf("the retry debited again: remaining %d -> %d", mid.Remaining, end.Remaining)
	}
	// The token created before the save still authenticates.
	cfg := client.DefaultConfig(bc.GRPCAddrs()...)
	cfg.TLSFiles = client.TLSFiles{CAFile: a.Credentials().CAFile, ServerName: auth.ServerName(proccluster.ClusterName)}
	cfg.Token = tok.Token
	opts, err := cfg.DialCredentials()
	if err != nil {
		t.Fatal(err)
	}
	wconn, err := grpc.NewClient(bc.Nodes[bl].GRPCAddr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer wconn.Close()
	if d, err := acquireOn(ctx, wconn, "worker", 1, 1, "endpoint=reports"); err != nil || !d.Admitted {
		t.Fatalf("acquire with the restored worker token: %v %v", d, err)
	}
}
