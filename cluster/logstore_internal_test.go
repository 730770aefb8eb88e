package cluster

import (
	"path/filepath"
	"testing"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
)

// BenchmarkStoreLogsAfterCompaction appends one 20 KB entry at a time (fsync on) to a log
// store that has held 20,000 such entries and dropped all but the last 2,048, as a snapshot's
// compaction does — the state every long-running node's log is in. default is bolt's own
// freelist handling; ours is boltOptions.
func BenchmarkStoreLogsAfterCompaction(b *testing.B) {
	for _, bc := range []struct {
		name string
		opts func(path string) raftboltdb.Options
	}{
		{"default", func(path string) raftboltdb.Options { return raftboltdb.Options{Path: path} }},
		{"ours", boltOptions},
	} {
		b.Run(bc.name, func(b *testing.B) {
			s, err := raftboltdb.New(bc.opts(filepath.Join(b.TempDir(), "raft.db")))
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			data := make([]byte, 20_000)
			var index uint64
			store := func(n int) {
				logs := make([]*raft.Log, n)
				for i := range logs {
					index++
					logs[i] = &raft.Log{Index: index, Term: 1, Type: raft.LogCommand, Data: data}
				}
				if err := s.StoreLogs(logs); err != nil {
					b.Fatal(err)
				}
			}
			for range 2000 {
				store(10)
			}
			if err := s.DeleteRange(1, index-2048); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for b.Loop() {
				store(1)
			}
		})
	}
}

// TestLogStoreReopensWithoutFreelist: with NoFreelistSync the freelist is rebuilt on open;
// entries written before a close must all be there after it, and appends continue.
func TestLogStoreReopensWithoutFreelist(t *testing.T) {
	path := filepath.Join(t.TempDir(), "raft.db")
	s, err := raftboltdb.New(boltOptions(path))
	if err != nil {
		t.Fatal(err)
	}
	data := make([]byte, 5000)
	for i := uint64(1); i <= 300; i++ {
		if err := s.StoreLog(&raft.Log{Index: i, Term: 1, Data: data}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.DeleteRange(1, 200); err != nil {
		t.Fatal(err)
	}
	if err := s.SetUint64([]byte("CurrentTerm"), 7); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s, err = raftboltdb.New(boltOptions(path))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	first, _ := s.FirstIndex()
	last, _ := s.LastIndex()
	if first != 201 || last != 300 {
		t.Fatalf("after reopen the log holds [%d, %d], want [201, 300]", first, last)
	}
	if term, err := s.GetUint64([]byte("CurrentTerm")); err != nil || term != 7 {
		t.Fatalf("CurrentTerm after reopen = %d, %v; want 7", term, err)
	}
	for i := uint64(301); i <= 400; i++ { // reuses the freed pages
		if err := s.StoreLog(&raft.Log{Index: i, Term: 1, Data: data}); err != nil {
			t.Fatal(err)
		}
	}
	var l raft.Log
	if err := s.GetLog(250, &l); err != nil || len(l.Data) != len(data) {
		t.Fatalf("GetLog(250) after appends: %v (data %d bytes)", err, len(l.Data))
	}
}

// BenchmarkCompaction is raft's log compaction after a snapshot at the default settings: one
// DeleteRange of SnapshotThreshold (16384) entries of ~6 KB (an entry of ~100 admissions),
// keeping TrailingLogs (2048). It runs as one bolt write transaction, and appends wait for it.
func BenchmarkCompaction(b *testing.B) {
	s, err := raftboltdb.New(boltOptions(filepath.Join(b.TempDir(), "raft.db")))
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	data := make([]byte, 6_000)
	var index uint64
	const threshold, trailing = 16384, 2048
	fill := func(n int) {
		for n > 0 {
			logs := make([]*raft.Log, min(n, 64))
			for i := range logs {
				index++
				logs[i] = &raft.Log{Index: index, Term: 1, Type: raft.LogCommand, Data: data}
			}
			if err := s.StoreLogs(logs); err != nil {
				b.Fatal(err)
			}
			n -= len(logs)
		}
	}
	fill(trailing)
	for b.Loop() {
		b.StopTimer()
		fill(threshold)
		first, err := s.FirstIndex()
		if err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		if err := s.DeleteRange(first, index-trailing); err != nil {
			b.Fatal(err)
		}
	}
}
