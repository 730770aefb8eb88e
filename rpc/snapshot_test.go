package rpc_test

import (
	"context"
	"path/filepath"
	"sync"
	"testing"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/backup"
	"github.com/quotad/quotad/rpc/rpctest"
)

// TestSnapshotSaveRestoreUnderLoad (in-process, for the race detector): save through a
// follower, keep admitting, restore through a follower while admissions continue, and check
// every replica ends at the restored limits with equal state.
func TestSnapshotSaveRestoreUnderLoad(t *testing.T) {
	c := rpctest.Start(t, 3, `
domain: d
rate_limit: {unit: second, requests_per_unit: 100000, burst: 100000}
`)
	leader := c.WaitLeader(10 * time.Second)
	follower := (leader + 1) % 3
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	fconn := dial(t, c.Addrs()[follower])
	lconn := dial(t, c.Addrs()[leader])

	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			q := quotadv1.NewQuotaClient(lconn)
			for i := uint64(1); ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				actx, acancel := context.WithTimeout(ctx, 2*time.Second)
				_, _ = q.Acquire(actx, &quotadv1.AcquireRequest{ClientId: "load", Admissions: []*quotadv1.Admission{{RequestId: uint64(w)<<32 | i, Domain: "d", Cost: 1}}})
				acancel()
			}
		})
	}
	time.Sleep(300 * time.Millisecond)
	file := filepath.Join(t.TempDir(), "s.snap")
	h, err := backup.Save(ctx, quotadv1.NewSnapshotClient(fconn), file)
	if err != nil {
		t.Fatal(err)
	}
	info, err := backup.Inspect(file)
	if err != nil || info.DedupEntries == 0 || info.Index != h.Index {
		t.Fatalf("inspect: %+v %v", info, err)
	}
	// Change the limits, then restore: the saved ones come back.
	if _, err := quotadv1.NewAdminClient(lconn).ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: "domain: e\nrate_limit: {unit: second, requests_per_unit: 1}\n"}); err != nil {
		t.Fatal(err)
	}
	resp, err := backup.Restore(ctx, quotadv1.NewSnapshotClient(fconn), file, false)
	if err != nil {
		t.Fatal(err)
	}
	close(stop)
	wg.Wait()
	if resp.LimitsVersion != 3 || resp.LimitsVersionBefore != 2 || resp.FileLimitsVersion != 1 || resp.Index <= h.Index {
		t.Fatalf("restore answered %+v (saved at %d)", resp, h.Index)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		var hashes []uint64
		var idx []uint64
		ok := true
		for i := range 3 {
			s := c.Agent(i).State()
			hashes, idx = append(hashes, s.Hash), append(idx, s.AppliedIndex)
			ok = ok && s.LimitsVersion == 3 // the file's limits, numbered above the current 2
		}
		if ok && idx[0] == idx[1] && idx[1] == idx[2] {
			if hashes[0] != hashes[1] || hashes[1] != hashes[2] {
				t.Fatalf("replicas differ at %d: %v", idx[0], hashes)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("replicas after the restore: indexes %v, hashes %v", idx, hashes)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The restored cluster decides again.
	if r, err := quotadv1.NewQuotaClient(fconn).Acquire(ctx, &quotadv1.AcquireRequest{ClientId: "after", Admissions: []*quotadv1.Admission{{RequestId: 1, Domain: "d", Cost: 1}}}); err != nil || !r.Decisions[0].Admitted {
		t.Fatalf("acquire after the restore: %v %v", r, err)
	}
}
