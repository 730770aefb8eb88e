package backup

import (
	"context"
	"errors"
	"fmt"
	"io"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// Save asks the cluster for a snapshot (Snapshot.Save, on the leader) and writes it to path,
// checking size and checksum as it arrives. path is written only if everything checked out.
func Save(ctx context.Context, c quotadv1.SnapshotClient, path string) (Header, error) {
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
	return h, WriteFile(path, h, &streamReader{stream: stream})
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
	if _, err := Inspect(path); err != nil {
		return nil, err
	}
	file, err := Open(path)
	if err != nil {
		return nil, err
	}
	defer file.Close()
	stream, err := c.Restore(ctx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&quotadv1.SnapshotChunk{Header: file.Header.Marshal(), RestoreTokens: restoreTokens}); err != nil {
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
		return fmt.Sprintf("tokens: restored the file's %d (+%d added, -%d removed compared with before the restore; a token revoked since the save is valid again)",
			r.Tokens, r.TokensAdded, r.TokensRemoved)
	}
	return fmt.Sprintf("tokens: kept the cluster's current %d (the file's %d were not restored; --restore-tokens restores them)", r.Tokens, r.FileTokens)
}
