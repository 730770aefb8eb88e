package cluster_test

import (
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/cluster/clustertest"
)

// TestDataDirIsPrivate: the data dir holds tenant names and token accessors. A node creates
// it 0700 and every file in it 0600 — the WAL segments, raft's snapshots (state.bin,
// meta.json), the node's own files — and tightens a data dir an older build left 0755 with
// 0644 files.
func TestDataDirIsPrivate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		existing bool
	}{{"new", false}, {"existing 0755", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := filepath.Join(t.TempDir(), "data")
			if tc.existing {
				if err := os.MkdirAll(filepath.Join(dir, "snapshots"), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(dir, "old-notes"), []byte("tenant acme\n"), 0o644); err != nil {
					t.Fatal(err)
				}
				if err := os.Chmod(dir, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			c := clustertest.Start(t, 1, newCounterFSM, clustertest.WithConfig(func(_ int, cfg *cluster.Config) {
				cfg.DataDir = dir
				cfg.LogStore = cluster.LogStoreWAL
			}))
			n := c.Node(c.WaitLeader(leaderTimeout))
			add(t, n, 1)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, rc, err := n.SaveSnapshot(ctx) // raft writes snapshots/<id>/state.bin
			if err != nil {
				t.Fatal(err)
			}
			rc.Close()

			seen := map[string]bool{}
			err = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
				if err != nil {
					return err
				}
				info, err := d.Info()
				if err != nil {
					return err
				}
				want := fs.FileMode(0o600)
				if d.IsDir() {
					want = 0o700
				}
				if got := info.Mode().Perm(); got&0o077 != 0 || (d.IsDir() && got != want) || (!d.IsDir() && path != filepath.Join(dir, "old-notes") && got != want) {
					t.Errorf("%s: mode %v, want %v", path, got, want)
				}
				switch {
				case strings.HasSuffix(path, ".wal"):
					seen["wal segment"] = true
				case filepath.Base(path) == "state.bin":
					seen["snapshot state.bin"] = true
				case filepath.Base(path) == "meta.json":
					seen["snapshot meta.json"] = true
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			for _, what := range []string{"wal segment", "snapshot state.bin", "snapshot meta.json"} {
				if !seen[what] {
					t.Errorf("no %s in %s: the test did not check one", what, dir)
				}
			}
		})
	}
}
