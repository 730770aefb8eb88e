package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime/metrics"
	"runtime/pprof"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/config"
	"github.com/quotad/quotad/fsm"
)

// snapshotRestore builds an FSM holding n active buckets from the same commands the API would
// log (1024 admissions per entry, distinct tenant values, so the dedup table holds n records
// too), then times what a node does to ship and load its state: FSM.Snapshot, Persist into
// raft's file snapshot store (written and fsynced), and FSM.Restore from it into a fresh FSM.
// It checks that the restored replica's state hash equals the original's. Besides the time it
// reports the bytes allocated and the CPU time (all threads, GC included) of the timed part:
// on a loaded machine these move much less than the time does.
func snapshotRestore(n int, cpuProfile string) (float64, error) {
	limits, err := config.Parse("bench", []byte(benchLimits))
	if err != nil {
		return 0, err
	}
	lj, err := json.Marshal(limits)
	if err != nil {
		return 0, err
	}
	src := fsm.New(fsm.Options{})
	var index uint64
	apply := func(ts int64, ops []*fsmv1.Op) {
		data, err := fsm.Encode(&fsmv1.Command{Ts: ts, Ops: ops})
		check(err)
		index++
		src.ApplyBatch([]*raft.Log{{Index: index, Term: 1, Type: raft.LogCommand, Data: data}})
	}
	ts := int64(time.Hour)
	apply(ts, []*fsmv1.Op{{Op: &fsmv1.Op_SetLimits{SetLimits: &fsmv1.SetLimits{LimitsJson: lj}}}})
	const perEntry = 1024
	for i := 0; i < n; i += perEntry {
		ops := make([]*fsmv1.Op, 0, perEntry)
		for j := i; j < min(i+perEntry, n); j++ {
			ops = append(ops, &fsmv1.Op{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{ClientId: "bench-populate", Admission: &quotadv1.Admission{
				RequestId: uint64(j + 1), Domain: "buckets", Cost: 1, Attempt: 1,
				Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: fmt.Sprintf("t%07d", j)}},
			}}}})
		}
		ts += int64(10 * time.Microsecond)
		apply(ts, ops)
	}
	st := src.Stats()
	if st.Buckets < n {
		return 0, fmt.Errorf("snapshot: the FSM holds %d buckets, want %d", st.Buckets, n)
	}

	dir, err := os.MkdirTemp("", "quotad-snap-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	store, err := raft.NewFileSnapshotStoreWithLogger(dir, 1, hclog.NewNullLogger())
	if err != nil {
		return 0, err
	}

	if cpuProfile != "" {
		f, err := os.Create(cpuProfile)
		if err != nil {
			return 0, err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return 0, err
		}
		defer pprof.StopCPUProfile()
	}
	allocsBefore, cpuBefore := allocatedBytes(), cpuTime()
	start := time.Now()
	snap, err := src.Snapshot()
	if err != nil {
		return 0, err
	}
	sink, err := store.Create(raft.SnapshotVersionMax, index, 1, raft.Configuration{}, 1, nil)
	if err != nil {
		return 0, err
	}
	if err := snap.Persist(sink); err != nil {
		return 0, err
	}
	snap.Release()
	tookSnap := time.Since(start)
	meta, rc, err := store.Open(sink.ID())
	if err != nil {
		return 0, err
	}
	dst := fsm.New(fsm.Options{})
	if err := dst.Restore(io.NopCloser(rc)); err != nil {
		return 0, err
	}
	took := time.Since(start)
	allocated, cpu := allocatedBytes()-allocsBefore, cpuTime()-cpuBefore
	rc.Close()
	if a, b := src.Hash(), dst.Hash(); a != b {
		return 0, fmt.Errorf("snapshot: restored state hash %+v differs from the original %+v", b, a)
	}
	logf("snapshot+restore of %d buckets (%d dedup records, %.0f MB file): snapshot+persist %v, total %v; %.0f MB allocated, %v CPU",
		st.Buckets, st.DedupEntries, float64(meta.Size)/(1<<20), tookSnap.Round(time.Millisecond), took.Round(time.Millisecond),
		float64(allocated)/(1<<20), cpu.Round(time.Millisecond))
	return took.Seconds(), nil
}

// allocatedBytes is the bytes this process has allocated on the heap so far.
func allocatedBytes() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// cpuTime is the user and system CPU time this process has used so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
