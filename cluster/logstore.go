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
//
// Config.LogStore may also be LogStoreAuto (empty, the default): the backend the data dir was
// written with, and LogStoreWAL for a data dir without a Raft log. So an upgraded node keeps
// its BoltDB log, a new node gets the WAL, and moving a node to the other backend is replacing
// it (README, "Raft log store").
const (
	LogStoreBoltDB = "boltdb"
	LogStoreWAL    = "wal"
	LogStoreAuto   = ""

	// logStoreNew is what LogStoreAuto picks for a data dir without a Raft log.
	logStoreNew = LogStoreWAL
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
	case LogStoreBoltDB, LogStoreWAL, LogStoreAuto:
		return nil
	}
	return fmt.Errorf("cluster: LogStore %q is not a Raft log store; use %q or %q, "+
		"or leave it unset (the data dir's own, %s for a new data dir)",
		backend, LogStoreBoltDB, LogStoreWAL, logStoreNew)
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

// chooseLogStore decides which backend opens dir, given Config.LogStore (requested), and says
// why in a few words for the startup log. An explicit backend that is not the one the data dir
// was written with is refused (ErrLogStoreMismatch) with what to do about it; nothing in dir
// is touched.
func chooseLogStore(dir, requested string) (backend, why string, err error) {
	if err := validateLogStore(requested); err != nil {
		return "", "", err
	}
	have, err := dataDirLogStore(dir)
	if err != nil {
		return "", "", err
	}
	switch {
	case requested == LogStoreAuto && have == "":
		return logStoreNew, "the data dir has no Raft log yet and --raft-log-store is not set: " + logStoreNew + " is the default for new data dirs", nil
	case requested == LogStoreAuto:
		return have, fmt.Sprintf("the data dir's Raft log was written by %s (%s) and --raft-log-store is not set", have, logStoreFiles(have)), nil
	case have == "":
		return requested, "set by --raft-log-store; new data dir", nil
	case have == requested:
		return requested, fmt.Sprintf("set by --raft-log-store; the data dir's Raft log was written by it (%s)", logStoreFiles(have)), nil
	}
	return "", "", fmt.Errorf("cluster: %w: data dir %q holds a %s Raft log (%s) but this node is "+
		"configured with LogStore %q. A node cannot convert its log in place. Either start it "+
		"with --raft-log-store %s or without --raft-log-store (a data dir keeps the backend it was written with), or (in a cluster of 3 or more nodes) "+
		"replace it with a %s node, one node at a time: stop it, move %q away, start it "+
		"again with the same --id, an empty --data-dir and --raft-log-store %s (it catches up from the leader's "+
		"snapshot), and wait until it has caught up before replacing the next node (README, \"Raft log store\")",
		ErrLogStoreMismatch, dir, have, logStoreFiles(have), requested, have, requested, dir, requested)
}

// openLogStore opens (or creates) the Raft stable store and log store in dir, of the backend
// chooseLogStore picks for requested (Config.LogStore). With boltdb both are the same raft.db;
// with wal the log is our write-ahead log (package wal) in dir/wal and the stable store is
// raft-boltdb in dir/stable.db. walLog is the WAL to close after raft stopped (nil for boltdb,
// whose log closes with stable). The chosen backend and why are logged.
func openLogStore(dir, requested string, l *slog.Logger) (backend string, stable *raftboltdb.BoltStore, logs raft.LogStore, walLog *wal.Log, err error) {
	backend, why, err := chooseLogStore(dir, requested)
	if err != nil {
		return "", nil, nil, nil, err
	}
	l.Info("raft log store", "backend", backend, "why", why)
	stable, logs, walLog, err = openLogStoreWith(dir, backend, wal.Options{Logger: l.With("component", "wal")})
	return backend, stable, logs, walLog, err
}

// openLogStoreWith opens backend's stores in dir (backend as chooseLogStore picked it, or
// explicit), with the WAL's options (tests use small segments to rotate often, and crash hooks).
func openLogStoreWith(dir, backend string, walOpts wal.Options) (stable *raftboltdb.BoltStore, logs raft.LogStore, walLog *wal.Log, err error) {
	if backend, _, err = chooseLogStore(dir, backend); err != nil {
		return nil, nil, nil, err
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
