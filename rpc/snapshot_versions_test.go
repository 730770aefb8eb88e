package rpc_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/backup"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/rpc/rpctest"
)

const restoreLimits = `
domain: d
descriptors:
  - key: tenant
    concurrency: {max_in_flight: 10, lease_ttl: 60s}
`

// TestRestoreContinuesVersions (3 nodes, real Raft and gRPC): restoring a backup taken at
// limits version 1 into a cluster at version 3 installs the file's limits as version 4 on
// every replica, and the next apply is 5 — never a second, different version 2. A lease
// taken after the save is reported dropped (by --dry-run, which changes nothing, and by the
// restore), and its ID is not issued again to the next lease.
func TestRestoreContinuesVersions(t *testing.T) {
	c := rpctest.Start(t, 3, restoreLimits)
	leader := c.WaitLeader(10 * time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn := dial(t, c.Addrs()[(leader+1)%3]) // a follower: it relays
	q, admin, snap := quotadv1.NewQuotaClient(conn), quotadv1.NewAdminClient(conn), quotadv1.NewSnapshotClient(conn)
	lease := func(id uint64, tenant string) uint64 {
		t.Helper()
		d, err := acquireOne(ctx, q, "w", &quotadv1.Admission{RequestId: id, Domain: "d", Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: tenant}}})
		if err != nil || !d.Admitted || d.LeaseId == 0 {
			t.Fatalf("acquire %s: %+v %v", tenant, d, err)
		}
		return d.LeaseId
	}
	kept := lease(1, "a")
	file := filepath.Join(t.TempDir(), "s.snap")
	if _, err := backup.Save(ctx, snap, file); err != nil {
		t.Fatal(err)
	}
	dropped := lease(2, "b")
	for i := range 2 {
		if _, err := admin.ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: fmt.Sprintf("domain: e%d\nrate_limit: {unit: second, requests_per_unit: 1}\n", i)}); err != nil {
			t.Fatal(err)
		}
	}
	versions := func(want uint64) {
		t.Helper()
		clustertest.Eventually(t, 10*time.Second, func() error {
			var hashes []uint64
			for i := range 3 {
				s := c.Agent(i).State()
				if s.LimitsVersion != want {
					return fmt.Errorf("node %d at limits version %d, want %d", i, s.LimitsVersion, want)
				}
				hashes = append(hashes, c.Agent(i).FSM().Hash().Hash)
			}
			if hashes[0] != hashes[1] || hashes[1] != hashes[2] {
				return fmt.Errorf("replicas differ: %v", hashes)
			}
			return nil
		})
	}
	versions(3)

	dry, err := backup.RestoreWith(ctx, snap, file, backup.RestoreOptions{DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if !dry.DryRun || dry.Index != 0 || dry.LimitsVersionBefore != 3 || dry.FileLimitsVersion != 1 || dry.LimitsVersion != 4 ||
		dry.LeasesBefore != 2 || dry.Leases != 1 || dry.LeasesDropped != 1 || dry.LeasesAdded != 0 {
		t.Fatalf("dry run answered %+v", dry)
	}
	// The dry run changed nothing: the lease taken after the save still renews.
	if _, err := q.Renew(ctx, &quotadv1.RenewRequest{LeaseId: dropped}); err != nil {
		t.Fatalf("renew after the dry run: %v", err)
	}
	versions(3)

	resp, err := backup.RestoreWith(ctx, snap, file, backup.RestoreOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if resp.DryRun || resp.LimitsVersionBefore != 3 || resp.LimitsVersion != 4 || resp.LeasesDropped != 1 || resp.Leases != 1 {
		t.Fatalf("restore answered %+v", resp)
	}
	versions(4)
	got, err := admin.GetLimits(ctx, &quotadv1.GetLimitsRequest{})
	if err != nil || got.Version != 4 {
		t.Fatalf("limits after the restore: %+v %v", got, err)
	}
	if _, err := admin.ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: "domain: f\nrate_limit: {unit: second, requests_per_unit: 1}\n"}); err != nil {
		t.Fatal(err)
	}
	versions(5)

	// The dropped lease is gone, and its ID is not handed to the next lease.
	if _, err := q.Renew(ctx, &quotadv1.RenewRequest{LeaseId: dropped}); status.Code(err) != codes.NotFound {
		t.Fatalf("renewing the dropped lease %d: %v, want NotFound", dropped, err)
	}
	if next := lease(3, "c"); next <= dropped {
		t.Fatalf("lease after the restore got ID %d; the dropped lease had %d", next, dropped)
	}
	if _, err := q.Renew(ctx, &quotadv1.RenewRequest{LeaseId: kept}); err != nil {
		t.Fatalf("renewing the saved lease %d: %v", kept, err)
	}
}
