package fsm

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"

	"github.com/hashicorp/raft"
)

// Snapshot file layout (all little endian):
//
//	magic "QSNP" | format u32 | applied u64 | lastSweep i64 | len(engine) u64 | engine |
//	len(dedup) u64 | dedup | crc32c of everything before it u32
const (
	snapshotMagic  = "QSNP"
	snapshotFormat = 1
)

var crcTable = crc32.MakeTable(crc32.Castagnoli)

type snapshot struct {
	engine    []byte
	dedup     []byte
	applied   uint64
	lastSweep int64
}

func (s *snapshot) encode() []byte {
	b := make([]byte, 0, 40+len(s.engine)+len(s.dedup))
	b = append(b, snapshotMagic...)
	b = binary.LittleEndian.AppendUint32(b, snapshotFormat)
	b = binary.LittleEndian.AppendUint64(b, s.applied)
	b = binary.LittleEndian.AppendUint64(b, uint64(s.lastSweep))
	b = binary.LittleEndian.AppendUint64(b, uint64(len(s.engine)))
	b = append(b, s.engine...)
	b = binary.LittleEndian.AppendUint64(b, uint64(len(s.dedup)))
	b = append(b, s.dedup...)
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, crcTable))
}

func decodeSnapshot(b []byte) (*snapshot, error) {
	const header = 4 + 4 + 8 + 8
	if len(b) < header+8+8+4 || string(b[:4]) != snapshotMagic {
		return nil, fmt.Errorf("fsm: not a quotad snapshot (%d bytes)", len(b))
	}
	body, sum := b[:len(b)-4], binary.LittleEndian.Uint32(b[len(b)-4:])
	if got := crc32.Checksum(body, crcTable); got != sum {
		return nil, fmt.Errorf("fsm: snapshot checksum %08x, want %08x: the file is corrupt", got, sum)
	}
	if f := binary.LittleEndian.Uint32(b[4:]); f != snapshotFormat {
		return nil, fmt.Errorf("fsm: snapshot format %d unknown (this build reads %d)", f, snapshotFormat)
	}
	s := &snapshot{
		applied:   binary.LittleEndian.Uint64(b[8:]),
		lastSweep: int64(binary.LittleEndian.Uint64(b[16:])),
	}
	rest := body[header:]
	var ok bool
	if s.engine, rest, ok = lenPrefixed(rest); !ok {
		return nil, fmt.Errorf("fsm: snapshot engine section truncated")
	}
	if s.dedup, rest, ok = lenPrefixed(rest); !ok || len(rest) != 0 {
		return nil, fmt.Errorf("fsm: snapshot dedup section malformed")
	}
	return s, nil
}

func lenPrefixed(b []byte) (section, rest []byte, ok bool) {
	if len(b) < 8 {
		return nil, nil, false
	}
	n := binary.LittleEndian.Uint64(b)
	b = b[8:]
	if uint64(len(b)) < n {
		return nil, nil, false
	}
	return b[:n], b[n:], true
}

// Persist writes the snapshot; on error the sink is cancelled so raft discards it.
func (s *snapshot) Persist(sink raft.SnapshotSink) error {
	if _, err := sink.Write(s.encode()); err != nil {
		sink.Cancel()
		return fmt.Errorf("fsm: writing snapshot: %w", err)
	}
	return sink.Close()
}

// Release frees nothing: the snapshot holds only its own bytes.
func (s *snapshot) Release() {}
