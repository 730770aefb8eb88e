package rpc_test

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/backup"
	"github.com/quotad/quotad/rpc/rpctest"
)

// TestRestoreSaysWhoseBackupItIs: a restore (and its dry run) says whether the file is this
// cluster's own backup or another cluster's; it said nothing, so a staging backup restored
// into production read like any other restore (user trial, session 12). Both are allowed:
// another cluster's backup is the normal case after losing every data dir.
func TestRestoreSaysWhoseBackupItIs(t *testing.T) {
	const limits = "domain: d\nrate_limit: {unit: second, requests_per_unit: 10}\n"
	a := rpctest.Start(t, 1, limits)
	b := rpctest.Start(t, 1, limits)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	aconn := dial(t, a.Addrs()[a.WaitLeader(10*time.Second)])
	bconn := dial(t, b.Addrs()[b.WaitLeader(10*time.Second)])
	file := filepath.Join(t.TempDir(), "a.snap")
	h, err := backup.Save(ctx, quotadv1.NewSnapshotClient(aconn), file)
	if err != nil {
		t.Fatal(err)
	}
	own, err := backup.RestoreWith(ctx, quotadv1.NewSnapshotClient(aconn), file, backup.RestoreOptions{DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if own.ClusterId != h.ClusterID || own.FileClusterId != h.ClusterID ||
		!strings.Contains(backup.RestoreSummary(file, own), "this cluster's own backup") {
		t.Fatalf("dry run of a cluster's own backup: %+v\n%s", own, backup.RestoreSummary(file, own))
	}
	other, err := backup.RestoreWith(ctx, quotadv1.NewSnapshotClient(bconn), file, backup.RestoreOptions{DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	sum := backup.RestoreSummary(file, other)
	if other.FileClusterId != h.ClusterID || other.ClusterId == "" || other.ClusterId == h.ClusterID ||
		!strings.Contains(sum, "ANOTHER cluster's backup") || !strings.Contains(sum, h.ClusterID) {
		t.Fatalf("dry run of another cluster's backup: %+v\n%s", other, sum)
	}
}
