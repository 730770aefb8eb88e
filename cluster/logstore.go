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

	"github.com/quotad/quotad/cluster/wal"
)

// Raft log store backends (Config.LogStore, the agent's --raft-log-store).
//
// Both fsync every append before raft acknowledges it (invariant 5); neither ever runs with
// NoSync. They differ in how an append reaches the disk:
//
//   - boltdb (raft-boltdb/v2): every StoreLogs is a BoltDB write transaction — the entries'
//     B-tree pages, then the meta page, each followed by an fdatasync (two per append).
//     The same raft.db file is the stable store (term, vote).
//   - wal (package wal, ours): every StoreLogs appends the entries and a commit record (CRC
//     over the batch and its index range) to the tail of a preallocated 64 MiB segment file
//     with one write and one fdatasync; a new segment is created under a temporary name,
//     fsynced, renamed and the directory fsynced. DeleteRange is one clamp record in the tail
//     (one write, one fdatasync), then whole segments below the first index are removed.
//     Everything a restart needs is in the segment files: no metadata DB, no background
//     goroutine. On open, a torn tail (a last record without its commit record or with a bad
//     CRC, nothing valid after it) is cut off: it was never acknowledged. The stable store
//     (term, vote) is a raft-boltdb file of its own, stable.db, fsynced on every write like
//     raft.db.
const (
	LogStoreBoltDB = "boltdb"
	LogStoreWAL    = "wal"
)

// Files of each backend in DataDir. A data dir holds exactly one backend's files; which one is
// how NewNode tells what an existing data dir was written with.
const (
	boltLogFile = "raft.db"   // boltdb: log and stable store
	walLogDir   = "wal"       // wal: segment files (<seq>-<first index>.wal, package wal)
	walStable   = "stable.db" // wal: raft-boltdb file holding only term and vote

	// hashicorpWALMeta marks a wal/ directory written by hashicorp/raft-wal, which
	// --raft-log-store wal used before it was our own (issue 17); this build refuses it.
	hashicorpWALMeta = "wal-meta.db"
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

// openLogStore opens (or creates) the Raft stable store and log store of backend in dir. With
// boltdb both are the same raft.db; with wal the log is our write-ahead log (package wal) in
// dir/wal and the stable store is raft-boltdb in dir/stable.db. walLog is the WAL to close
// after raft stopped (nil for boltdb, whose log closes with stable). An existing data dir
// written by the other backend is refused (ErrLogStoreMismatch) with what to do about it.
func openLogStore(dir, backend string, l *slog.Logger) (stable *raftboltdb.BoltStore, logs raft.LogStore, walLog *wal.Log, err error) {
	return openLogStoreWith(dir, backend, wal.Options{Logger: l.With("component", "wal")})
}

// openLogStoreWith is openLogStore with the WAL's options (tests use small segments to rotate
// often, and crash hooks).
func openLogStoreWith(dir, backend string, walOpts wal.Options) (stable *raftboltdb.BoltStore, logs raft.LogStore, walLog *wal.Log, err error) {
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
	wdir := filepath.Join(dir, walLogDir)
	if _, err := os.Stat(filepath.Join(wdir, hashicorpWALMeta)); err == nil {
		return nil, nil, nil, fmt.Errorf("cluster: %w: data dir %q holds a Raft log written by hashicorp/raft-wal (%s), "+
			"which an earlier development build used for --raft-log-store wal; this build's wal backend has its own "+
			"format and cannot read it. Replace the node: stop it, move %q away and start it again with the same --id "+
			"and an empty --data-dir (it catches up from the leader's snapshot; README, \"Raft log store\")",
			ErrLogStoreMismatch, dir, filepath.Join(walLogDir, hashicorpWALMeta), dir)
	}
	// The stable store first: its open times out if another process holds the data dir.
	path := filepath.Join(dir, walStable)
	stable, err = raftboltdb.New(boltOptions(path))
	if err != nil {
		return nil, nil, nil, fmt.Errorf("cluster: open %s: %w (is another node using this data dir?)", path, err)
	}
	w, err := wal.Open(wdir, walOpts)
	if err != nil {
		_ = stable.Close()
		return nil, nil, nil, fmt.Errorf("cluster: open the Raft log in %s: %w", wdir, err)
	}
	return stable, w, w, nil
}
