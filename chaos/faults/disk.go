package faults

import (
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
)

// Disk slows down the Raft log's writes, as a saturated or failing disk makes fsync slow. The
// zero value adds no delay. Safe for concurrent use.
type Disk struct {
	delay   atomic.Int64 // ns added before each StoreLog/StoreLogs
	delayed atomic.Uint64
}

// SetDelay sets the delay added to every log append (0: none).
func (d *Disk) SetDelay(delay time.Duration) { d.delay.Store(int64(max(delay, 0))) }

// Delay returns the current delay.
func (d *Disk) Delay() time.Duration { return time.Duration(d.delay.Load()) }

// DiskState is a Disk's settings and counters, as the HTTP handler reports them.
type DiskState struct {
	Delay   string `json:"delay"`
	Delayed uint64 `json:"delayed_writes"`
}

// State returns the delay and the number of writes delayed so far.
func (d *Disk) State() DiskState {
	return DiskState{Delay: d.Delay().String(), Delayed: d.delayed.Load()}
}

func (d *Disk) wait() {
	if ns := d.delay.Load(); ns > 0 {
		d.delayed.Add(1)
		time.Sleep(time.Duration(ns))
	}
}

// WrapLogStore returns s with the delay added before every append. Wrap the durable store
// (BoltDB), below raft.NewLogCache, so that the delay sits where the fsync is. Pass it as
// cluster.Config.WrapLogStore. The wrapper keeps s's MonotonicLogStore answer.
func (d *Disk) WrapLogStore(s raft.LogStore) raft.LogStore {
	ls := &logStore{LogStore: s, disk: d}
	if m, ok := s.(raft.MonotonicLogStore); ok {
		return &monotonicLogStore{logStore: ls, mono: m}
	}
	return ls
}

type logStore struct {
	raft.LogStore
	disk *Disk
}

func (s *logStore) StoreLog(l *raft.Log) error {
	s.disk.wait()
	return s.LogStore.StoreLog(l)
}

func (s *logStore) StoreLogs(ls []*raft.Log) error {
	s.disk.wait()
	return s.LogStore.StoreLogs(ls)
}

type monotonicLogStore struct {
	*logStore
	mono raft.MonotonicLogStore
}

func (s *monotonicLogStore) IsMonotonic() bool { return s.mono.IsMonotonic() }
