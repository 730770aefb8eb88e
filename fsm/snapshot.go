package fsm

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"

	"github.com/hashicorp/raft"
)

// Snapshot file layout (all little endian):
//
//	magic "QSNP" | format u32 | applied u64 | lastSweep i64 | len(engine) u64 | engine |
//	len(dedup) u64 | dedup | crc32c of everything before it u32
const (
	snapshotMagic  = "QSNP"
	snapshotFormat = 1
	// snapshotHeader is the bytes before the engine section.
	snapshotHeader = 4 + 4 + 8 + 8 + 8
)

var crcTable = crc32.MakeTable(crc32.Castagnoli)

// snapshot is a captured state, already framed: data is the whole file but the checksum, which
// Persist computes off the FSM goroutine. Building the file in one buffer in place (the engine
// and the dedup table append to it) costs one copy of the state, not three.
type snapshot struct {
	data []byte
}

// appendSnapshotHeader starts a snapshot file; the engine and dedup sections follow, each
// closed by endSection.
func appendSnapshotHeader(b []byte, applied uint64, lastSweep int64) []byte {
	b = append(b, snapshotMagic...)
	b = binary.LittleEndian.AppendUint32(b, snapshotFormat)
	b = binary.LittleEndian.AppendUint64(b, applied)
	b = binary.LittleEndian.AppendUint64(b, uint64(lastSweep))
	return b
}

// beginSection reserves a section's length; endSection fills it in.
func beginSection(b []byte) ([]byte, int) {
	return binary.LittleEndian.AppendUint64(b, 0), len(b) + 8
}

func endSection(b []byte, start int) {
	binary.LittleEndian.PutUint64(b[start-8:], uint64(len(b)-start))
}

// snapshotSections are a read snapshot file's parts.
type snapshotSections struct {
	engine    []byte
	dedup     []byte
	applied   uint64
	lastSweep int64
}

// readSnapshot reads a snapshot file section by section into buffers of the exact size (no
// io.ReadAll doubling), checking the checksum as it goes.
func readSnapshot(r io.Reader) (*snapshotSections, error) {
	crc := crc32.New(crcTable)
	var hdr [snapshotHeader]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil || string(hdr[:4]) != snapshotMagic {
		return nil, fmt.Errorf("fsm: not a quotad snapshot (header: %v)", err)
	}
	crc.Write(hdr[:])
	if f := binary.LittleEndian.Uint32(hdr[4:]); f != snapshotFormat {
		return nil, fmt.Errorf("fsm: snapshot format %d unknown (this build reads %d)", f, snapshotFormat)
	}
	s := &snapshotSections{
		applied:   binary.LittleEndian.Uint64(hdr[8:]),
		lastSweep: int64(binary.LittleEndian.Uint64(hdr[16:])),
	}
	section := func(n uint64, name string) ([]byte, error) {
		if n > 1<<40 {
			return nil, fmt.Errorf("fsm: snapshot %s section claims %d bytes", name, n)
		}
		b := make([]byte, n)
		if _, err := io.ReadFull(r, b); err != nil {
			return nil, fmt.Errorf("fsm: snapshot %s section truncated: %w", name, err)
		}
		crc.Write(b)
		return b, nil
	}
	var err error
	if s.engine, err = section(binary.LittleEndian.Uint64(hdr[24:]), "engine"); err != nil {
		return nil, err
	}
	var l [8]byte
	if _, err := io.ReadFull(r, l[:]); err != nil {
		return nil, fmt.Errorf("fsm: snapshot dedup section malformed: %w", err)
	}
	crc.Write(l[:])
	if s.dedup, err = section(binary.LittleEndian.Uint64(l[:]), "dedup"); err != nil {
		return nil, err
	}
	var sum [4]byte
	if _, err := io.ReadFull(r, sum[:]); err != nil {
		return nil, fmt.Errorf("fsm: snapshot checksum missing: %w", err)
	}
	if got, want := crc.Sum32(), binary.LittleEndian.Uint32(sum[:]); got != want {
		return nil, fmt.Errorf("fsm: snapshot checksum %08x, want %08x: the file is corrupt", got, want)
	}
	if n, _ := r.Read(sum[:1]); n != 0 {
		return nil, fmt.Errorf("fsm: snapshot dedup section malformed: bytes after the checksum")
	}
	return s, nil
}

// Persist writes the snapshot; on error the sink is cancelled so raft discards it.
func (s *snapshot) Persist(sink raft.SnapshotSink) error {
	sum := binary.LittleEndian.AppendUint32(nil, crc32.Checksum(s.data, crcTable))
	if _, err := sink.Write(s.data); err != nil {
		sink.Cancel()
		return fmt.Errorf("fsm: writing snapshot: %w", err)
	}
	if _, err := sink.Write(sum); err != nil {
		sink.Cancel()
		return fmt.Errorf("fsm: writing snapshot: %w", err)
	}
	return sink.Close()
}

// Release frees nothing: the snapshot holds only its own bytes.
func (s *snapshot) Release() {}
