package rpc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/backup"
	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/fsm"
)

// snapshotChunk is the size of the data in one streamed message.
const snapshotChunk = 256 << 10

// snapshotService serves quotad.v1.Snapshot (backup and restore, admin only: auth/policy.go)
// on the leader; a follower relays the stream to the leader.
type snapshotService struct {
	quotadv1.UnimplementedSnapshotServer
	s       *Server
	node    *cluster.Node
	tempDir string // the data dir: restores are staged there (room for a snapshot is needed anyway)
}

// Save streams a snapshot taken through Raft on the leader: the header, then the state.
func (x *snapshotService) Save(req *quotadv1.SnapshotSaveRequest, stream grpc.ServerStreamingServer[quotadv1.SnapshotChunk]) error {
	ctx := stream.Context()
	conn, err := x.s.route(ctx)
	if err != nil {
		return err
	}
	if conn != nil {
		up, err := quotadv1.NewSnapshotClient(conn).Save(forwardCtx(ctx), req)
		if err != nil {
			return err
		}
		for {
			m, err := up.Recv()
			if errors.Is(err, io.EOF) {
				return nil
			}
			if err != nil {
				return err
			}
			if err := stream.Send(m); err != nil {
				return err
			}
		}
	}
	meta, rc, err := x.node.SaveSnapshot(ctx)
	if err != nil {
		if errors.Is(err, cluster.ErrNotLeader) || errors.Is(err, cluster.ErrOutcomeUnknown) {
			return x.s.applyError(err)
		}
		return status.Errorf(codes.Internal, "taking a snapshot: %v", err)
	}
	defer rc.Close()
	// The checksum goes in the header, which comes first: stage the state in a file (raft's
	// snapshot may be reaped by a newer one while it streams, so a copy is needed anyway).
	tmp, err := os.CreateTemp(x.tempDir, "snapshot-save-*.tmp")
	if err != nil {
		return status.Errorf(codes.Internal, "staging the snapshot: %v", err)
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	h := backup.Header{ClusterID: x.node.ClusterID(), Index: meta.Index, Term: meta.Term, Size: meta.Size,
		RaftSnapshotVersion: int(meta.Version), CommandVersion: fsm.CommandVersion,
		QuotadVersion: backup.BuildVersion(), CreatedAt: time.Now().UTC()}
	h.Leader, _ = x.node.Leader()
	sum := backup.NewHasher()
	if n, err := io.Copy(io.MultiWriter(tmp, sum), rc); err != nil || n != meta.Size {
		return status.Errorf(codes.Internal, "reading the snapshot: %d of %d bytes: %v", n, meta.Size, err)
	}
	h.SHA256 = sum.Hex()
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		return status.Errorf(codes.Internal, "staging the snapshot: %v", err)
	}
	if err := stream.Send(&quotadv1.SnapshotChunk{Header: h.Marshal()}); err != nil {
		return err
	}
	buf := make([]byte, snapshotChunk)
	for {
		n, err := io.ReadFull(tmp, buf)
		if n > 0 {
			if err := stream.Send(&quotadv1.SnapshotChunk{Data: buf[:n]}); err != nil {
				return err
			}
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return nil
		}
		if err != nil {
			return status.Errorf(codes.Internal, "reading the staged snapshot: %v", err)
		}
	}
}

// Restore receives a snapshot file's header and state, checks and decodes it, and installs it
// through raft.Restore on the leader. Unless the first message sets restore_tokens, the state
// installed carries the cluster's current token table instead of the file's (tokens and
// revocations are security state); the answer says which and counts the change.
func (x *snapshotService) Restore(stream grpc.ClientStreamingServer[quotadv1.SnapshotChunk, quotadv1.SnapshotRestoreResponse]) error {
	return x.restore(stream, false)
}

// PlanRestore is Restore's dry run: the same checks, and the answer says what Restore would
// change against the state now; nothing is installed.
func (x *snapshotService) PlanRestore(stream grpc.ClientStreamingServer[quotadv1.SnapshotChunk, quotadv1.SnapshotRestoreResponse]) error {
	return x.restore(stream, true)
}

func (x *snapshotService) restore(stream grpc.ClientStreamingServer[quotadv1.SnapshotChunk, quotadv1.SnapshotRestoreResponse], dryRun bool) error {
	ctx := stream.Context()
	conn, err := x.s.route(ctx)
	if err != nil {
		return err
	}
	if conn != nil {
		c := quotadv1.NewSnapshotClient(conn)
		open := c.Restore
		if dryRun {
			open = c.PlanRestore
		}
		up, err := open(forwardCtx(ctx))
		if err != nil {
			return err
		}
		for {
			m, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return err
			}
			if err := up.Send(m); err != nil {
				break // the leader ended the call: CloseAndRecv has its answer
			}
		}
		resp, err := up.CloseAndRecv()
		if err != nil {
			return err
		}
		return stream.SendAndClose(resp)
	}
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	h, err := backup.ParseHeader(first.Header)
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "the first message must carry the snapshot file's header: %v", err)
	}
	if h.CommandVersion > fsm.CommandVersion {
		return status.Errorf(codes.FailedPrecondition, "the snapshot was saved by a newer quotad (%s, command version %d; this node applies up to %d): upgrade the cluster first", h.QuotadVersion, h.CommandVersion, fsm.CommandVersion)
	}
	tmp, err := os.CreateTemp(x.tempDir, "snapshot-restore-*.tmp")
	if err != nil {
		return status.Errorf(codes.Internal, "staging the snapshot: %v", err)
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	v := backup.NewVerifier(h)
	w := io.MultiWriter(tmp, v)
	for {
		m, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		if _, err := w.Write(m.Data); err != nil {
			return status.Error(codes.InvalidArgument, err.Error())
		}
	}
	if err := v.Check(); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	// raft stops the node if its FSM cannot restore what it installed: decode it here first.
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		return status.Errorf(codes.Internal, "staging the snapshot: %v", err)
	}
	decoded, err := backup.Decode(h, tmp)
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	info := backup.Describe(h, decoded)
	// As for ApplyLimits: a node before command version 6 would drop max_keys_per_parent from
	// the restored limits and decide differently from the others.
	if l := decoded.Limits(); l != nil && l.UsesMaxKeysPerParent() {
		if err := x.s.everyNodeApplies(fsm.MaxKeysPerParentVersion, "max_keys_per_parent"); err != nil {
			return err
		}
	}
	// A file with revoked certificates is snapshot format 3, which a node before command
	// version 8 cannot restore (raft would stop it).
	if decoded.AnyCertRevoked() {
		if err := x.s.certRevokeAllowed("restoring a snapshot that holds revoked certificates"); err != nil {
			return err
		}
	}
	fileTokens := accessorSet(decoded.Tokens())
	file := decoded.RestoreView()
	decoded = nil // garbage from here
	resp := &quotadv1.SnapshotRestoreResponse{Buckets: uint64(info.Buckets), Leases: uint64(info.Leases), Pauses: uint64(info.Pauses),
		DedupEntries: uint64(info.DedupEntries), FileTokens: uint64(len(fileTokens)), TokensRestored: first.RestoreTokens,
		FileLimitsVersion: file.LimitsVersion, DryRun: dryRun, ClusterId: x.node.ClusterID(), FileClusterId: h.ClusterID}
	// compare fills in what the restore changes, against the state it replaces, and returns
	// how the file is rewritten: the limits version and lease counter continue above the
	// current ones (fsm.FSM.RestoreVersions) — decided here, on the leader, once: every
	// replica restores the rewritten bytes.
	compare := func() fsm.RestoreRewrite {
		cur := x.s.fsm.RestoreView()
		rw := x.s.fsm.RestoreVersions(file.LimitsVersion, file.LeaseSeq)
		rw.KeepTokens = !first.RestoreTokens
		resp.LimitsVersion, resp.LimitsVersionBefore = rw.LimitsVersion, cur.LimitsVersion
		resp.LeasesBefore, resp.PausesBefore = uint64(len(cur.LeaseIDs)), uint64(len(cur.PauseKeys))
		resp.BucketsBefore, resp.DedupEntriesBefore = uint64(cur.Buckets), uint64(cur.DedupEntries)
		resp.LeasesDropped, resp.LeasesAdded = countMissing(setOf(cur.LeaseIDs), setOf(file.LeaseIDs)), countMissing(setOf(file.LeaseIDs), setOf(cur.LeaseIDs))
		resp.PausesDropped, resp.PausesAdded = countMissing(setOf(cur.PauseKeys), setOf(file.PauseKeys)), countMissing(setOf(file.PauseKeys), setOf(cur.PauseKeys))
		current := accessorSet(x.s.fsm.Tokens())
		if first.RestoreTokens {
			resp.Tokens = uint64(len(fileTokens))
			resp.TokensAdded, resp.TokensRemoved = countMissing(fileTokens, current), countMissing(current, fileTokens)
		} else {
			resp.Tokens = uint64(len(current))
		}
		return rw
	}
	if dryRun {
		if err := x.node.VerifyRead(ctx); err != nil {
			return x.s.applyError(err)
		}
		compare()
		return stream.SendAndClose(resp)
	}
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		return status.Errorf(codes.Internal, "staging the snapshot: %v", err)
	}
	meta := &raft.SnapshotMeta{Version: raft.SnapshotVersion(h.RaftSnapshotVersion), Index: h.Index, Term: h.Term, Size: h.Size}
	var staged *os.File // the rewritten state
	// The token table and the counters are read at the moment of the restore: prepare runs
	// after every command stamped before the restore has been applied and while new ones wait
	// (cluster.Node.RestoreSnapshotPrepared), so no token op or SetLimits commits between the
	// read and the restore. Tokens and revocations are security state: unless asked, the
	// restored state carries the cluster's current token table, not the file's. Commands wait
	// while it copies, so the copy stops when ctx (the restore's timeout or the caller
	// leaving) ends.
	prepare := func(ctx context.Context) (*raft.SnapshotMeta, io.Reader, error) {
		rw := compare()
		out, err := os.CreateTemp(x.tempDir, "snapshot-restore-rewritten-*.tmp")
		if err != nil {
			return nil, nil, fmt.Errorf("staging the rewritten snapshot: %w", err)
		}
		staged = out
		n, err := x.s.fsm.WriteRestoreSnapshot(out, ctxReader{ctx, tmp}, rw)
		if err != nil {
			return nil, nil, fmt.Errorf("rewriting the snapshot (tokens, limits version): %w", err)
		}
		if h := restoreCopiedHook.Load(); h != nil {
			(*h)()
		}
		if _, err := out.Seek(0, io.SeekStart); err != nil {
			return nil, nil, fmt.Errorf("staging the rewritten snapshot: %w", err)
		}
		m := *meta
		m.Size = n
		return &m, out, nil
	}
	defer func() {
		if staged != nil {
			staged.Close()
			os.Remove(staged.Name())
		}
	}()
	if err := x.node.RestoreSnapshotPrepared(stream.Context(), prepare, time.Minute); err != nil {
		if errors.Is(err, cluster.ErrNotLeader) {
			return x.s.applyError(err)
		}
		if errors.Is(err, fsm.ErrCertDenyListFull) {
			return denyListFullError(err)
		}
		return status.Errorf(codes.Internal, "restoring: %v", err)
	}
	resp.Index = x.node.Raft().LastIndex()
	return stream.SendAndClose(resp)
}

// restoreCopiedHook, if set (tests only), runs in a restore right after the snapshot was
// rewritten (current tokens, renumbered limits version).
var restoreCopiedHook atomic.Pointer[func()]

// ctxReader is r that fails with ctx's error once ctx has ended.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

// setOf returns the set of xs.
func setOf[T comparable](xs []T) map[T]bool {
	out := make(map[T]bool, len(xs))
	for _, x := range xs {
		out[x] = true
	}
	return out
}

// accessorSet returns the tokens' accessors.
func accessorSet(ts []fsm.Token) map[string]bool {
	out := make(map[string]bool, len(ts))
	for _, t := range ts {
		out[t.Accessor] = true
	}
	return out
}

// countMissing counts the members of a that b lacks.
func countMissing[T comparable](a, b map[T]bool) uint64 {
	var n uint64
	for k := range a {
		if !b[k] {
			n++
		}
	}
	return n
}
