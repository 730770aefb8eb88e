package backup

import (
	"bytes"
	"context"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// oldBuild serves quotad.v1.Snapshot as a build before PlanRestore did: Restore would
// restore (counted here), PlanRestore is unknown.
type oldBuild struct {
	quotadv1.UnimplementedSnapshotServer
	restores atomic.Int32
}

func (o *oldBuild) Restore(stream grpc.ClientStreamingServer[quotadv1.SnapshotChunk, quotadv1.SnapshotRestoreResponse]) error {
	o.restores.Add(1)
	return stream.SendAndClose(&quotadv1.SnapshotRestoreResponse{Index: 99})
}

// TestDryRunAgainstAnOldBuildRestoresNothing (gRPC over loopback): --dry-run calls
// PlanRestore, which a build without it refuses UNIMPLEMENTED — never Restore with a flag the
// old build would ignore (it would restore); the error says nothing was restored.
func TestDryRunAgainstAnOldBuildRestoresNothing(t *testing.T) {
	b := state(t)
	file := filepath.Join(t.TempDir(), "s.snap")
	if err := WriteFile(file, header(b), bytes.NewReader(b)); err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	old := &oldBuild{}
	quotadv1.RegisterSnapshotServer(srv, old)
	go srv.Serve(lis)
	defer srv.Stop()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = RestoreWith(ctx, quotadv1.NewSnapshotClient(conn), file, RestoreOptions{DryRun: true})
	if err == nil || !strings.Contains(err.Error(), "nothing was restored") || old.restores.Load() != 0 {
		t.Fatalf("dry run against an old build: %v (restores: %d), want an error saying nothing was restored and no Restore call", err, old.restores.Load())
	}
}
