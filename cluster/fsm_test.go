package cluster_test

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"sync"
	"sync/atomic"

	"github.com/hashicorp/raft"

	"github.com/quotad/quotad/cluster"
)

// counterFSM is a test-only state machine: a counter plus an FSM clock. Commands are
// 'a' ts(8) delta(8) (add; the response is the new count) and 't' ts(8) (tick).
type counterFSM struct {
	mu      sync.Mutex
	count   int64
	ticks   int64
	clock   atomic.Int64
	applied atomic.Uint64
}

var _ cluster.FSM = (*counterFSM)(nil)

func newCounterFSM() cluster.FSM { return &counterFSM{} }

func encodeAdd(ts, delta int64) []byte {
	b := make([]byte, 17)
	b[0] = 'a'
	binary.BigEndian.PutUint64(b[1:], uint64(ts))
	binary.BigEndian.PutUint64(b[9:], uint64(delta))
	return b
}

func (f *counterFSM) EncodeTick(ts int64, _ int) []byte {
	b := make([]byte, 9)
	b[0] = 't'
	binary.BigEndian.PutUint64(b[1:], uint64(ts))
	return b
}

func (f *counterFSM) Clock() int64         { return f.clock.Load() }
func (f *counterFSM) AppliedIndex() uint64 { return f.applied.Load() }

func (f *counterFSM) Count() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.count
}

func (f *counterFSM) Ticks() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ticks
}

func (f *counterFSM) Apply(l *raft.Log) any { return f.ApplyBatch([]*raft.Log{l})[0] }

func (f *counterFSM) ApplyBatch(logs []*raft.Log) []any {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]any, len(logs))
	for i, l := range logs {
		f.applied.Store(l.Index)
		if l.Type != raft.LogCommand {
			continue
		}
		if len(l.Data) < 9 {
			out[i] = fmt.Errorf("short command %x", l.Data)
			continue
		}
		ts := int64(binary.BigEndian.Uint64(l.Data[1:]))
		if ts > f.clock.Load() {
			f.clock.Store(ts)
		}
		switch l.Data[0] {
		case 'a':
			f.count += int64(binary.BigEndian.Uint64(l.Data[9:]))
			out[i] = f.count
		case 't':
			f.ticks++
		}
	}
	return out
}

type counterState struct {
	Count, Ticks, Clock int64
	Applied             uint64
}

func (f *counterFSM) Snapshot() (raft.FSMSnapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return counterState{f.count, f.ticks, f.clock.Load(), f.applied.Load()}, nil
}

func (f *counterFSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	var s counterState
	if err := json.NewDecoder(rc).Decode(&s); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.count, f.ticks = s.Count, s.Ticks
	f.clock.Store(s.Clock)
	f.applied.Store(s.Applied)
	return nil
}

func (s counterState) Persist(sink raft.SnapshotSink) error {
	if err := json.NewEncoder(sink).Encode(s); err != nil {
		_ = sink.Cancel()
		return err
	}
	return sink.Close()
}

func (counterState) Release() {}
