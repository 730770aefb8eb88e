package backup

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// Save asks the cluster for a snapshot (Snapshot.Save, on the leader) and writes it to path,
// checking size and checksum as it arrives. path is written only if everything checked out;
// an existing file there is replaced (SaveWith can refuse it).
func Save(ctx context.Context, c quotadv1.SnapshotClient, path string) (Header, error) {
	return SaveWith(ctx, c, path, SaveOptions{Force: true})
}

// SaveOptions are SaveWith's options.
type SaveOptions struct {
	// Force replaces an existing file at path. Without it SaveWith refuses one before it asks
	// the cluster for anything, and again if one appears while the snapshot streams.
	Force bool
}

// SaveWith is Save with options.
func SaveWith(ctx context.Context, c quotadv1.SnapshotClient, path string, o SaveOptions) (Header, error) {
	if !o.Force {
		if err := CheckNew(path); err != nil {
			return Header{}, err
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.Save(ctx, &quotadv1.SnapshotSaveRequest{})
	if err != nil {
		return Header{}, err
	}
	first, err := stream.Recv()
	if err != nil {
		return Header{}, err
	}
	h, err := ParseHeader(first.Header)
	if err != nil {
		return h, err
	}
	if o.Force {
		return h, WriteFile(path, h, &streamReader{stream: stream})
	}
	return h, writeFile(path, h, &streamReader{stream: stream}, false)
}

// streamReader reads the data of a Save stream.
type streamReader struct {
	stream interface {
		Recv() (*quotadv1.SnapshotChunk, error)
	}
	buf []byte
}

func (r *streamReader) Read(p []byte) (int, error) {
	for len(r.buf) == 0 {
		m, err := r.stream.Recv()
		if err != nil {
			return 0, err // io.EOF at the end
		}
		r.buf = m.Data
	}
	n := copy(p, r.buf)
	r.buf = r.buf[n:]
	return n, nil
}

// Restore checks the snapshot file at path (size, checksum, and that it decodes), then sends
// it to the cluster (Snapshot.Restore), which installs it on the leader and replicates it. The
// cluster keeps its current token table unless restoreTokens (the response says which).
func Restore(ctx context.Context, c quotadv1.SnapshotClient, path string, restoreTokens bool) (*quotadv1.SnapshotRestoreResponse, error) {
	return RestoreWith(ctx, c, path, RestoreOptions{RestoreTokens: restoreTokens})
}

// RestoreOptions are Restore's choices.
type RestoreOptions struct {
	// RestoreTokens installs the file's token table too (default: keep the cluster's).
	RestoreTokens bool
	// DryRun checks the file and compares it with the cluster's state: the answer says what a
	// restore would change, and nothing is installed.
	DryRun bool
}

// RestoreWith is Restore with options.
func RestoreWith(ctx context.Context, c quotadv1.SnapshotClient, path string, o RestoreOptions) (*quotadv1.SnapshotRestoreResponse, error) {
	resp, err := restore(ctx, c, path, o)
	if o.DryRun && status.Code(err) == codes.Unimplemented {
		return nil, fmt.Errorf("the cluster's build has no restore --dry-run (PlanRestore: %w); nothing was restored — upgrade it first, or compare `quotad snapshot inspect FILE` with `quotad limits get` and `quotad status` by hand", err)
	}
	return resp, err
}

func restore(ctx context.Context, c quotadv1.SnapshotClient, path string, o RestoreOptions) (*quotadv1.SnapshotRestoreResponse, error) {
	if _, err := Inspect(path); err != nil {
		return nil, err
	}
	file, err := Open(path)
	if err != nil {
		return nil, err
	}
	defer file.Close()
	open := c.Restore
	if o.DryRun {
		open = c.PlanRestore
	}
	stream, err := open(ctx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&quotadv1.SnapshotChunk{Header: file.Header.Marshal(), RestoreTokens: o.RestoreTokens}); err != nil {
		_, rerr := stream.CloseAndRecv()
		return nil, errors.Join(err, rerr)
	}
	buf := make([]byte, 256<<10)
	for {
		n, err := file.State().Read(buf)
		if n > 0 {
			if serr := stream.Send(&quotadv1.SnapshotChunk{Data: buf[:n]}); serr != nil {
				// The server ended the call; its answer says why.
				_, rerr := stream.CloseAndRecv()
				if rerr != nil {
					return nil, rerr
				}
				return nil, serr
			}
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
	}
	return stream.CloseAndRecv()
}

// TokensSummary says what a restore did to the token table, for the operator.
func TokensSummary(r *quotadv1.SnapshotRestoreResponse) string {
	if r.TokensRestored {
		verb := "restored"
		if r.DryRun {
			verb = "would restore"
		}
		return fmt.Sprintf("tokens: %s the file's %d (+%d added, -%d removed compared with before the restore; a token revoked since the save is valid again)",
			verb, r.Tokens, r.TokensAdded, r.TokensRemoved)
	}
	if r.DryRun {
		return fmt.Sprintf("tokens: would keep the cluster's current %d (the file's %d would not be restored; --restore-tokens restores them)", r.Tokens, r.FileTokens)
	}
	return fmt.Sprintf("tokens: kept the cluster's current %d (the file's %d were not restored; --restore-tokens restores them)", r.Tokens, r.FileTokens)
}

// RestoreSummary says what a restore changed (or, for a dry run, would change), for the
// operator: limits version before and after, leases and pauses dropped and added, tokens.
func RestoreSummary(path string, r *quotadv1.SnapshotRestoreResponse) string {
	var b strings.Builder
	if r.DryRun {
		fmt.Fprintf(&b, "dry run: restoring %s would change:\n", path)
	} else {
		fmt.Fprintf(&b, "restored %s at index %d:\n", path, r.Index)
	}
	switch {
	case r.ClusterId == "" || r.FileClusterId == "":
	case r.ClusterId != r.FileClusterId:
		fmt.Fprintf(&b, "  cluster         the file was saved by cluster %s; this is cluster %s: ANOTHER cluster's backup (expected when restoring into a new cluster after losing every data dir; otherwise check you named the right file and cluster)\n",
			r.FileClusterId, r.ClusterId)
	default:
		fmt.Fprintf(&b, "  cluster         %s (the file is this cluster's own backup)\n", r.ClusterId)
	}
	fmt.Fprintf(&b, "  limits version  %d -> %d (the file's %d, numbered above the current one so no version names two sets of limits)\n",
		r.LimitsVersionBefore, r.LimitsVersion, r.FileLimitsVersion)
	fmt.Fprintf(&b, "  leases          %d -> %d: %d dropped (held now, not in the file: their holders lose their permits), %d added (from the file, held until their TTL)\n",
		r.LeasesBefore, r.Leases, r.LeasesDropped, r.LeasesAdded)
	fmt.Fprintf(&b, "  pauses          %d -> %d: %d dropped (lifted), %d added\n", r.PausesBefore, r.Pauses, r.PausesDropped, r.PausesAdded)
	fmt.Fprintf(&b, "  buckets         %d -> %d\n", r.BucketsBefore, r.Buckets)
	fmt.Fprintf(&b, "  dedup entries   %d -> %d (decisions made since the save are forgotten)\n", r.DedupEntriesBefore, r.DedupEntries)
	b.WriteString("  " + TokensSummary(r))
	if r.DryRun {
		b.WriteString("\nnothing was restored (--dry-run)")
	}
	return b.String()
}
