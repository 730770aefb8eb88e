package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/backup"
	"github.com/quotad/quotad/rpc/rpctest"
)

// TestSnapshotSaveRefusesExisting (a real one-node cluster): `snapshot save FILE` onto an
// existing FILE is refused, says --force and leaves the file alone (it was silently
// overwritten); --force replaces it; a new FILE is saved as before.
func TestSnapshotSaveRefusesExisting(t *testing.T) {
	c := rpctest.Start(t, 1, "domain: provider\nrate_limit: {unit: second, requests_per_unit: 10}\n")
	addr := c.Addrs()[c.WaitLeader(10*time.Second)]
	save := func(args ...string) error {
		cmd := snapshotCmd()
		cmd.SetArgs(append([]string{"save", "--addr", addr, "--timeout", "20s"}, args...))
		cmd.SilenceUsage, cmd.SilenceErrors = true, true
		return cmd.Execute()
	}
	dir := t.TempDir()
	existing := filepath.Join(dir, "backup.snap")
	if err := os.WriteFile(existing, []byte("last night's backup"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := save(existing); err == nil || !strings.Contains(err.Error(), existing+" already exists") || !strings.Contains(err.Error(), "--force") {
		t.Fatalf("snapshot save onto an existing file: %v, want it refused suggesting --force", err)
	}
	if got, _ := os.ReadFile(existing); string(got) != "last night's backup" {
		t.Fatalf("the existing file was changed: %.40q", got)
	}
	if err := save("--force", existing); err != nil {
		t.Fatalf("snapshot save --force: %v", err)
	}
	if _, err := backup.Inspect(existing); err != nil {
		t.Fatalf("after --force the file is not a snapshot: %v", err)
	}
	fresh := filepath.Join(dir, "new.snap")
	if err := save(fresh); err != nil {
		t.Fatalf("snapshot save to a new file: %v", err)
	}
	if _, err := backup.Inspect(fresh); err != nil {
		t.Fatalf("new file: %v", err)
	}
}
