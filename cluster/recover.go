package cluster

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"

	"github.com/quotad/quotad/cluster/wal"
)

// Offline recovery of a cluster that lost its majority (`quotad recover`; Consul's
// peers.json, etcd's --force-new-cluster).
//
// Raft cannot elect a leader while a majority of its voters is gone for good (disks lost,
// machines replaced): the survivors keep voting for a configuration whose majority no longer
// exists. Recovery rewrites one stopped survivor's data dir so that it is the only voter: the FSM is rebuilt from the newest snapshot and every entry
// in the node's log (hashicorp/raft's RecoverCluster), saved as a new snapshot carrying the
// new configuration, and the log is compacted. Started again, the survivor elects itself;
// the other survivors and replacement nodes join with empty data dirs and catch up from its
// snapshot. Only one: each named voter would be rebuilt from its own log, and a less complete
// one could then win an election and make the most complete drop entries only it held.
//
// What it can lose, and why it is an operator's decision: an entry a majority acknowledged
// may live only on the lost nodes; the survivor with the highest last index (InspectDataDir,
// `quotad recover --dry-run` on each) holds every entry any survivor has. Entries in its log
// that never committed are applied as if they had — for a quota that is a spend counted that
// its caller saw fail or time out, never a spend forgotten.

// DataDirState is what a stopped node's data dir holds.
type DataDirState struct {
	Dir       string `json:"data_dir"`
	NodeID    string `json:"node_id"`
	ClusterID string `json:"cluster_id,omitempty"`
	LogStore  string `json:"log_store"`
	// Recovering: the node started without Raft state and had not caught up with a leader
	// when it stopped (recovery.go); its log may lack committed entries.
	Recovering    bool   `json:"recovering"`
	CurrentTerm   uint64 `json:"current_term"`
	FirstIndex    uint64 `json:"first_index"`
	LastIndex     uint64 `json:"last_index"`
	LastTerm      uint64 `json:"last_term"`
	SnapshotIndex uint64 `json:"snapshot_index"`
	SnapshotTerm  uint64 `json:"snapshot_term"`
	// Servers is the newest Raft configuration the data dir holds (its last configuration
	// entry, or its newest snapshot's).
	Servers []raft.Server `json:"servers"`
}

// ErrNotDataDir: a directory without a node ID is not a quotad data dir.
var ErrNotDataDir = errors.New("not a quotad data dir")

// offlineStores are a stopped node's Raft stores, opened for inspection or recovery.
type offlineStores struct {
	state  DataDirState
	stable *raftboltdb.BoltStore
	logs   raft.LogStore
	walLog *wal.Log
	snaps  *privateSnapshotStore
}

func (s *offlineStores) Close() {
	if s.walLog != nil {
		_ = s.walLog.Close()
	}
	if s.stable != nil {
		_ = s.stable.Close()
	}
}

// openOffline opens dir's stores without starting Raft. It fails, after BoltDB's 2 s lock
// timeout, if a running node holds the data dir.
func openOffline(dir string, log *slog.Logger) (*offlineStores, error) {
	b, err := os.ReadFile(filepath.Join(dir, nodeIDFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("cluster: %q: %w (no %s file); give the --data-dir of the stopped node to recover", dir, ErrNotDataDir, nodeIDFile)
	}
	if err != nil {
		return nil, fmt.Errorf("cluster: read the node ID in %q: %w", dir, err)
	}
	st := DataDirState{Dir: dir, NodeID: strings.TrimSpace(string(b))}
	if st.ClusterID, err = readClusterID(dir); err != nil {
		return nil, err
	}
	if _, err := os.Stat(filepath.Join(dir, recoveringFile)); err == nil {
		st.Recovering = true
	}
	if st.LogStore, err = dataDirLogStore(dir); err != nil {
		return nil, err
	}
	if st.LogStore == LogStoreAuto {
		return nil, fmt.Errorf("cluster: data dir %q of node %q holds no Raft log (no %s, no %s/): nothing to recover from; recover a survivor that has one", dir, st.NodeID, boltLogFile, walLogDir)
	}
	s := &offlineStores{state: st}
	if s.stable, s.logs, s.walLog, err = openLogStoreWith(dir, st.LogStore, wal.Options{Logger: log.With("component", "wal")}); err != nil {
		return nil, fmt.Errorf("%w; stop the node's agent before recovering its data dir", err)
	}
	if s.snaps, err = openSnapshotStore(dir, DefaultConfig().SnapshotRetain, newHCLog(log, "snapshots", slog.LevelWarn)); err != nil {
		s.Close()
		return nil, fmt.Errorf("cluster: snapshot store in %q: %w", dir, err)
	}
	if err := s.read(); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// read fills in the indexes, terms and newest configuration.
func (s *offlineStores) read() error {
	st := &s.state
	var err error
	if st.CurrentTerm, err = s.stable.GetUint64([]byte("CurrentTerm")); err != nil && !errors.Is(err, raftboltdb.ErrKeyNotFound) {
		return fmt.Errorf("cluster: read the current term: %w", err)
	}
	snaps, err := s.snaps.List()
	if err != nil {
		return fmt.Errorf("cluster: list snapshots: %w", err)
	}
	if len(snaps) > 0 {
		st.SnapshotIndex, st.SnapshotTerm = snaps[0].Index, snaps[0].Term
		st.Servers = snaps[0].Configuration.Servers
		st.LastIndex, st.LastTerm = snaps[0].Index, snaps[0].Term
	}
	if st.FirstIndex, err = s.logs.FirstIndex(); err != nil {
		return fmt.Errorf("cluster: first log index: %w", err)
	}
	last, err := s.logs.LastIndex()
	if err != nil {
		return fmt.Errorf("cluster: last log index: %w", err)
	}
	from := max(st.FirstIndex, st.SnapshotIndex+1)
	for i := from; last > 0 && i <= last; i++ {
		var e raft.Log
		if err := s.logs.GetLog(i, &e); err != nil {
			return fmt.Errorf("cluster: read log entry %d of %d–%d: %w", i, from, last, err)
		}
		st.LastIndex, st.LastTerm = e.Index, e.Term
		if e.Type == raft.LogConfiguration {
			st.Servers = raft.DecodeConfiguration(e.Data).Servers
		}
	}
	return nil
}

// InspectDataDir reads a stopped node's data dir: the node, its log's extent and its newest
// Raft configuration. Compare the survivors' LastTerm, then LastIndex, to pick the one to
// recover (the greatest holds every entry any of them has).
func InspectDataDir(dir string, log *slog.Logger) (DataDirState, error) {
	s, err := openOffline(dir, log)
	if err != nil {
		return DataDirState{}, err
	}
	defer s.Close()
	return s.state, nil
}

// RecoverDataDir makes the stopped node whose data dir is dir the only voter of its Raft
// configuration (voters: that node alone, with its Raft address), rebuilding f (a new, empty
// FSM of the kind the agent runs) from its snapshot and log (see the comment at the top of
// this file). It returns the state after recovery.
func RecoverDataDir(dir string, voters []raft.Server, f raft.FSM, log *slog.Logger) (DataDirState, error) {
	if len(voters) != 1 {
		// Each survivor would be rebuilt from its own log; with two or more named, a less
		// complete one can win the first election with another's vote (a voter only checks that
		// the candidate's log is as up to date as its own) and the most complete one would then
		// drop the entries only it had. One voter, the most complete survivor, leads alone; the
		// others rejoin with empty data dirs and catch up from it.
		return DataDirState{}, fmt.Errorf("cluster: %d voters given; recover exactly one, this node (ID=RAFT_ADDR): the survivor with the most log leads alone, and the other survivors rejoin with empty data dirs (docs/operations.md, \"Lost majority\")", len(voters))
	}
	v := voters[0]
	if v.ID == "" || v.Address == "" || v.Suffrage != raft.Voter {
		return DataDirState{}, fmt.Errorf("cluster: voter %q=%q needs an ID and a Raft address (ID=HOST:PORT)", v.ID, v.Address)
	}
	s, err := openOffline(dir, log)
	if err != nil {
		return DataDirState{}, err
	}
	defer s.Close()
	st := s.state
	if st.Recovering {
		return st, fmt.Errorf("cluster: node %q in %q was recovering (it started without Raft state and had not caught up with a leader), so its log may lack committed entries; recover another survivor and let this one catch up from it", st.NodeID, dir)
	}
	if string(v.ID) != st.NodeID {
		return st, fmt.Errorf("cluster: the voter %q is not this data dir's node %q; name it with its Raft address (%s=HOST:PORT)", v.ID, st.NodeID, st.NodeID)
	}
	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(st.NodeID)
	rc.Logger = newHCLog(log, "raft", slog.LevelWarn)
	// The snapshot's peers are encoded with the transport's EncodePeer; the network transport
	// encodes an address as its bytes, as the in-memory one does, so no socket is needed.
	_, trans := raft.NewInmemTransport("")
	defer func() { _ = trans.Close() }()
	conf := raft.Configuration{Servers: voters}
	if err := raft.RecoverCluster(rc, f, s.logs, s.stable, s.snaps, trans, conf); err != nil {
		return st, fmt.Errorf("cluster: recover %q: %w", dir, err)
	}
	// The snapshot now carries the configuration; read the result back.
	s.state = DataDirState{Dir: st.Dir, NodeID: st.NodeID, ClusterID: st.ClusterID, LogStore: st.LogStore}
	if err := s.read(); err != nil {
		return st, err
	}
	return s.state, nil
}

// ParseVoters reads `quotad recover --voter` values: ID=HOST:PORT, the node's --id and its
// Raft address (--raft-addr, as the other nodes dial it).
func ParseVoters(specs []string) ([]raft.Server, error) {
	var out []raft.Server
	for _, s := range specs {
		id, addr, ok := strings.Cut(s, "=")
		if !ok || id == "" {
			return nil, fmt.Errorf("cluster: --voter %q is not ID=HOST:PORT (the node's --id and its Raft address), e.g. node1=10.0.0.1:7100", s)
		}
		if err := validateHostPort("--voter "+id, addr, false); err != nil {
			return nil, err
		}
		out = append(out, raft.Server{ID: raft.ServerID(id), Address: raft.ServerAddress(addr), Suffrage: raft.Voter})
	}
	return out, nil
}
