package cluster

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	wal "github.com/hashicorp/raft-wal"
	"github.com/hashicorp/raft-wal/metadb"
)

// Raft log store backends (Config.LogStore, the agent's --raft-log-store).
//
// Both fsync every append before raft acknowledges it (invariant 5); neither ever runs with
// NoSync. They differ in how an append reaches the disk:
//
//   - boltdb (raft-boltdb/v2): every StoreLogs is a BoltDB write transaction — the entries'
//     B-tree pages, then the meta page, each followed by an fdatasync (two per append).
//     The same raft.db file is the stable store (term, vote).
//   - wal (hashicorp/raft-wal, what Consul runs as raft_logstore backend "wal"): every
//     StoreLogs appends the entries and a commit frame (CRC over the batch) to the tail of a
//     64 MiB preallocated segment file with one write and one fsync; the first sync of a new
//     segment file also fsyncs the directory. Segment rotation and head/tail truncation record
//     the segment list in wal/wal-meta.db (BoltDB, fsynced). On open, a torn tail (entries
//     after the last commit frame, or a last batch whose CRC does not match) is dropped: it
//     was never acknowledged. The stable store (term, vote) is a raft-boltdb file of its own,
//     stable.db, fsynced on every write like raft.db.
const (
	LogStoreBoltDB = "boltdb"
	LogStoreWAL    = "wal"
)

// Files of each backend in DataDir. A data dir holds exactly one backend's files; which one is
// how NewNode tells what an existing data dir was written with.
const (
	boltLogFile = "raft.db"   // boltdb: log and stable store
	walLogDir   = "wal"       // wal: segment files (*.wal) and wal-meta.db
	walStable   = "stable.db" // wal: raft-boltdb file holding only term and vote
)

// validateLogStore checks Config.LogStore.
func validateLogStore(backend string) error {
	switch backend {
	case LogStoreBoltDB, LogStoreWAL:
		return nil
	}
	return fmt.Errorf("cluster: LogStore (--raft-log-store) %q is not a Raft log store; use %q or %q",
		backend, LogStoreBoltDB, LogStoreWAL)
}

// ErrLogStoreMismatch is returned (wrapped) by NewNode when the data dir was written by the
// other log store backend.
var ErrLogStoreMismatch = errors.New("data dir was written by another Raft log store")

// dataDirLogStore reports which backend wrote the Raft files in dir: LogStoreBoltDB if
// raft.db exists, LogStoreWAL if wal/ or stable.db exists, "" if none (a fresh data dir).
func dataDirLogStore(dir string) (string, error) {
	exists := func(name string) (bool, error) {
		_, err := os.Stat(filepath.Join(dir, name))
		switch {
		case err == nil:
			return true, nil
		case errors.Is(err, fs.ErrNotExist):
			return false, nil
		}
		return false, fmt.Errorf("cluster: inspect data dir %q: %w", dir, err)
	}
	bolt, err := exists(boltLogFile)
	if err != nil {
		return "", err
	}
	walDir, err := exists(walLogDir)
	if err != nil {
		return "", err
	}
	stable, err := exists(walStable)
	if err != nil {
		return "", err
	}
	switch {
	case bolt && (walDir || stable):
		return "", fmt.Errorf("cluster: data dir %q holds both a %s log (%s) and a %s log (%s/, %s); "+
			"quotad never writes both, so one was put there by hand: keep the one this node ran with and move the other away",
			dir, LogStoreBoltDB, boltLogFile, LogStoreWAL, walLogDir, walStable)
	case bolt:
		return LogStoreBoltDB, nil
	case walDir || stable:
		return LogStoreWAL, nil
	}
	return "", nil
}

// logStoreFiles names a backend's files for messages.
func logStoreFiles(backend string) string {
	if backend == LogStoreWAL {
		return walLogDir + "/ and " + walStable
	}
	return boltLogFile
}

// walStore closes a raft-wal log store completely. raft-wal v0.4.0's WAL.Close closes the
// segment files but leaves its metadata DB (wal-meta.db, BoltDB) open and locked, so the same
// process could never open the data dir again (bbolt waits for the lock forever): a node
// restarted in-process would hang. We pass our own metadb.BoltMetaDB and close it after the
// WAL (raft is stopped by then, so nothing writes to it).
type walStore struct {
	wal  *wal.WAL
	meta *metadb.BoltMetaDB
}

func (w *walStore) Close() error {
	return errors.Join(w.wal.Close(), w.meta.Close())
}

// walLogStore is raft-wal's log store with GetLog refusing indexes below FirstIndex, as the
// raft.LogStore contract and raft-boltdb do. raft-wal v0.4.0 keeps serving entries of its tail
// segment after a head truncation (compaction) removed them: the tail writer checks only its
// own copy of the segment's MinIndex, which DeleteRange does not update, so until the segment
// rotates (64 MiB) "deleted" entries stay readable. They are committed entries, so raft would
// not go wrong with them, but a lagging follower would then be caught up from the compacted
// log instead of the snapshot, differently from BoltDB and from what TrailingLogs promises.
// IsMonotonic (true) and the rest are the WAL's.
type walLogStore struct {
	*wal.WAL
}

func (s walLogStore) GetLog(index uint64, l *raft.Log) error {
	first, err := s.WAL.FirstIndex()
	if err != nil {
		return err
	}
	if index < first {
		return raft.ErrLogNotFound
	}
	return s.WAL.GetLog(index, l)
}

// openLogStore opens (or creates) the Raft stable store and log store of backend in dir. With
// boltdb both are the same raft.db; with wal the log is a raft-wal in dir/wal and the stable
// store is raft-boltdb in dir/stable.db. walLog is the WAL to close after raft stopped (nil
// for boltdb, whose log closes with stable). An existing data dir written by the other
// backend is refused (ErrLogStoreMismatch) with what to do about it.
func openLogStore(dir, backend string, l *slog.Logger, libLevel slog.Level) (stable *raftboltdb.BoltStore, logs raft.LogStore, walLog *walStore, err error) {
	return openLogStoreSized(dir, backend, l, libLevel, wal.DefaultSegmentSize)
}

// openLogStoreSized is openLogStore with the WAL's segment size (tests use small segments to
// rotate often).
func openLogStoreSized(dir, backend string, l *slog.Logger, libLevel slog.Level, segmentSize int) (stable *raftboltdb.BoltStore, logs raft.LogStore, walLog *walStore, err error) {
	if err := validateLogStore(backend); err != nil {
		return nil, nil, nil, err
	}
	have, err := dataDirLogStore(dir)
	if err != nil {
		return nil, nil, nil, err
	}
	if have != "" && have != backend {
		return nil, nil, nil, fmt.Errorf("cluster: %w: data dir %q holds a %s Raft log (%s) but this node is "+
			"configured with LogStore (--raft-log-store) %q. A node cannot convert its log in place. Either start it "+
			"with --raft-log-store %s, or (in a cluster of 3 or more nodes) replace it with a %s node, one node at a time: stop it, move %q away, start it "+
			"again with the same --id, an empty --data-dir and --raft-log-store %s (it catches up from the leader's "+
			"snapshot), and wait until it has caught up before replacing the next node (README, \"Raft log store\")",
			ErrLogStoreMismatch, dir, have, logStoreFiles(have), backend, have, backend, dir, backend)
	}
	if backend == LogStoreBoltDB {
		path := filepath.Join(dir, boltLogFile)
		bolt, err := raftboltdb.New(boltOptions(path))
		if err != nil {
			return nil, nil, nil, fmt.Errorf("cluster: open %s: %w (is another node using this data dir?)", path, err)
		}
		return bolt, bolt, nil, nil
	}
	// The stable store first: its open times out if another process holds the data dir
	// (raft-wal's own wal-meta.db would wait for the lock forever).
	path := filepath.Join(dir, walStable)
	stable, err = raftboltdb.New(boltOptions(path))
	if err != nil {
		return nil, nil, nil, fmt.Errorf("cluster: open %s: %w (is another node using this data dir?)", path, err)
	}
	wdir := filepath.Join(dir, walLogDir)
	if err := os.MkdirAll(wdir, 0o755); err != nil {
		_ = stable.Close()
		return nil, nil, nil, fmt.Errorf("cluster: create %s: %w", wdir, err)
	}
	meta := &metadb.BoltMetaDB{}
	w, err := wal.Open(wdir, wal.WithMetaStore(meta), wal.WithSegmentSize(segmentSize),
		wal.WithLogger(newHCLog(l, "raft.wal", libLevel)))
	if err != nil {
		_ = meta.Close()
		_ = stable.Close()
		return nil, nil, nil, fmt.Errorf("cluster: open the Raft WAL in %s: %w", wdir, err)
	}
	return stable, walLogStore{w}, &walStore{wal: w, meta: meta}, nil
}
