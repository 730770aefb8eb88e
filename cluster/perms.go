package cluster

import (
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
)

// A data dir holds tenant names, descriptor values, token accessors and hashes, and every
// caller's recent decisions (the log, snapshots): only the agent's user may read it. The dir
// and the directories in it are 0700, the files 0600.
const (
	dataDirMode  fs.FileMode = 0o700
	dataFileMode fs.FileMode = 0o600
)

// secureDataDir creates dir with mode 0700, or, if it exists, removes the group and other
// permissions from it and from everything in it (symlinks are not followed), logging what it
// changed: a data dir from an older build (0755, files 0644) is tightened on start. What it
// cannot change (a volume root owned by root, as Docker and Kubernetes mount them; a
// lost+found it cannot read) is logged, not fatal: the files this node creates are private
// anyway. Only failing to create dir is an error.
func secureDataDir(dir string, log *slog.Logger) error {
	if err := os.MkdirAll(dir, dataDirMode); err != nil {
		return fmt.Errorf("cluster: create data dir %q: %w", dir, err)
	}
	var changed, failed []string
	var was fs.FileMode
	entries := 0
	_ = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if path != dir {
			entries++
		}
		if err != nil {
			failed = append(failed, fmt.Sprintf("%s: %v", path, err))
			if d != nil && d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		if d.Type()&fs.ModeSymlink != 0 {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			failed = append(failed, fmt.Sprintf("%s: %v", path, err))
			return nil
		}
		perm := info.Mode().Perm()
		if perm&0o077 == 0 {
			return nil
		}
		if err := os.Chmod(path, perm&^0o077); err != nil {
			failed = append(failed, fmt.Sprintf("%s (%v): %v", path, perm, err))
			return nil
		}
		if len(changed) == 0 {
			was = perm
		}
		changed = append(changed, path)
		return nil
	})
	switch {
	case len(changed) > 0 && entries == 0:
		// An empty data dir: nothing was exposed. Docker images make the volume's mount point
		// world-writable (so any --user can write it) and every new container's volume
		// starts so: not worth a warning.
		log.Info("made the empty data dir private", "data_dir", dir, "was", was.String(), "now", (was &^ 0o077).String())
	case len(changed) > 0:
		log.Warn("data dir was readable by group or other: removed their permissions (it holds tenant names and token accessors)",
			"data_dir", dir, "first", changed[0], "was", was.String(), "paths_changed", len(changed))
	}
	if len(failed) > 0 {
		log.Warn("could not restrict part of the data dir to this user; the files this node writes are private (0600) anyway. Make the data dir owned by the agent's user with mode 0700 (chmod 700 DIR)",
			"data_dir", dir, "paths", len(failed), "first", failed[0])
	}
	return nil
}

// privateSnapshotStore is raft's FileSnapshotStore with private permissions: raft creates its
// directories 0755 and files with os.Create (0666 less the umask); each new snapshot's
// directory, meta.json and state.bin are restricted as soon as raft created them, before any
// state is written to them. Nothing else changes (raft still fsyncs and renames as before).
type privateSnapshotStore struct {
	*raft.FileSnapshotStore
	dir string // DATA_DIR/snapshots
}

// openSnapshotStore opens the snapshot store in dataDir with private permissions.
func openSnapshotStore(dataDir string, retain int, logger hclog.Logger) (*privateSnapshotStore, error) {
	fss, err := raft.NewFileSnapshotStoreWithLogger(dataDir, retain, logger)
	if err != nil {
		return nil, err
	}
	s := &privateSnapshotStore{FileSnapshotStore: fss, dir: filepath.Join(dataDir, "snapshots")}
	if err := os.Chmod(s.dir, dataDirMode); err != nil {
		return nil, err
	}
	return s, nil
}

// Create implements raft.SnapshotStore.
func (s *privateSnapshotStore) Create(version raft.SnapshotVersion, index, term uint64, configuration raft.Configuration,
	configurationIndex uint64, trans raft.Transport) (raft.SnapshotSink, error) {
	sink, err := s.FileSnapshotStore.Create(version, index, term, configuration, configurationIndex, trans)
	if err != nil {
		return nil, err
	}
	tmp := filepath.Join(s.dir, sink.ID()+".tmp") // raft's name for a snapshot being written
	for _, p := range []struct {
		path string
		mode fs.FileMode
	}{{tmp, dataDirMode}, {filepath.Join(tmp, "meta.json"), dataFileMode}, {filepath.Join(tmp, "state.bin"), dataFileMode}} {
		if err := os.Chmod(p.path, p.mode); err != nil {
			_ = sink.Cancel()
			return nil, fmt.Errorf("cluster: restrict permissions of snapshot %s: %w", p.path, err)
		}
	}
	return sink, nil
}
