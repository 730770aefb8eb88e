package fsm

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"slices"

	"github.com/hashicorp/raft"

	"github.com/quotad/quotad/quota"
)

// Snapshot file layout (all little endian):
//
//	magic "QSNP" | format u32 | applied u64 | lastSweep i64 | len(engine) u64 | engine |
//	[format ≥ 2: len(tokens) u64 | tokens] | [format 3: len(certs) u64 | certs] |
//	len(dedup) u64 | dedup | crc32c of everything before it u32
//
// Format 2 adds the token table, format 3 the certificate deny-list (certs.go). A state is
// written in the oldest format that holds it: without tokens and revoked certificates as
// format 1, without revoked certificates as format 2, so older builds read it (a deny-list
// exists only once every node applies command version 8, and so reads format 3).
const (
	snapshotMagic  = "QSNP"
	snapshotFormat = 1
	// snapshotFormatTokens is the format with the tokens section.
	snapshotFormatTokens = 2
	// snapshotFormatCerts is the format with the tokens and the certificates sections.
	snapshotFormatCerts = 3
	// snapshotHeader is the bytes before the engine section.
	snapshotHeader = 4 + 4 + 8 + 8 + 8
	// maxSection bounds a section's claimed length, so a corrupt one is refused before any
	// allocation.
	maxSection = 1 << 40
	// trustedSection is how large a section's buffer is allocated before any of it is read.
	trustedSection = 64 << 20
)

var crcTable = crc32.MakeTable(crc32.Castagnoli)

// snapshot is a captured state (FSM.Snapshot), encoded by Persist off the FSM goroutine.
type snapshot struct {
	applied   uint64
	lastSweep int64
	engine    *quota.Capture
	dedup     *dedupCapture
	tokens    *tokenSet // immutable: captured by reference
	certs     *certSet  // immutable: captured by reference
}

// snapshotFormatFor is the oldest format that holds tokens and certs (nil: none).
func snapshotFormatFor(tokens, certs []byte) uint32 {
	switch {
	case certs != nil:
		return snapshotFormatCerts
	case tokens != nil:
		return snapshotFormatTokens
	}
	return snapshotFormat
}

// appendSnapshotHeader starts a snapshot file; the engine section follows, closed by
// endSection.
func appendSnapshotHeader(b []byte, applied uint64, lastSweep int64) []byte {
	return appendSnapshotHeaderFormat(b, snapshotFormat, applied, lastSweep)
}

func appendSnapshotHeaderFormat(b []byte, format uint32, applied uint64, lastSweep int64) []byte {
	b = append(b, snapshotMagic...)
	b = binary.LittleEndian.AppendUint32(b, format)
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

// checksumReader passes reads through and checksums what they return.
type checksumReader struct {
	r   io.Reader
	crc uint32
}

func (c *checksumReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.crc = crc32.Update(c.crc, crcTable, p[:n])
	return n, err
}

// snapshotReader reads a snapshot file front to back, checking its checksum at the end. The
// sections are read by their decoders: the engine's whole (quota decodes from a byte slice),
// the dedup table's in bounded pieces (readDedup).
type snapshotReader struct {
	r         checksumReader
	format    uint32
	applied   uint64
	lastSweep int64
}

// readHeader reads the file header.
func (s *snapshotReader) readHeader() error {
	var hdr [snapshotHeader - 8]byte
	if _, err := io.ReadFull(&s.r, hdr[:]); err != nil || string(hdr[:4]) != snapshotMagic {
		return fmt.Errorf("fsm: not a quotad snapshot (header: %v)", err)
	}
	s.format = binary.LittleEndian.Uint32(hdr[4:])
	if s.format < snapshotFormat || s.format > snapshotFormatCerts {
		return fmt.Errorf("fsm: snapshot format %d unknown (this build reads %d to %d); upgrade this node", s.format, snapshotFormat, snapshotFormatCerts)
	}
	s.applied = binary.LittleEndian.Uint64(hdr[8:])
	s.lastSweep = int64(binary.LittleEndian.Uint64(hdr[16:]))
	return nil
}

// sectionLen reads a section's length.
func (s *snapshotReader) sectionLen(name string) (uint64, error) {
	var l [8]byte
	if _, err := io.ReadFull(&s.r, l[:]); err != nil {
		return 0, fmt.Errorf("fsm: snapshot %s section malformed: %w", name, err)
	}
	n := binary.LittleEndian.Uint64(l[:])
	if n > maxSection {
		return 0, fmt.Errorf("fsm: snapshot %s section claims %d bytes", name, n)
	}
	return n, nil
}

// readSection reads a whole section of n bytes. Up to trustedSection bytes, the buffer is
// allocated at that size; beyond, it doubles as the bytes arrive, so that a corrupt length
// cannot make it allocate much more than the file holds.
func (s *snapshotReader) readSection(n uint64, name string) ([]byte, error) {
	b := make([]byte, 0, min(n, trustedSection))
	for uint64(len(b)) < n {
		if len(b) == cap(b) {
			b = slices.Grow(b, int(min(n-uint64(len(b)), uint64(len(b)))))
		}
		k, err := io.ReadFull(&s.r, b[len(b):min(uint64(cap(b)), n)])
		b = b[:len(b)+k]
		if err != nil {
			return nil, fmt.Errorf("fsm: snapshot %s section truncated: %w", name, err)
		}
	}
	return b, nil
}

// readChecksum reads the checksum, compares it with the bytes read before it, and checks that
// nothing follows.
func (s *snapshotReader) readChecksum() error {
	got := s.r.crc
	var sum [4]byte
	if _, err := io.ReadFull(s.r.r, sum[:]); err != nil {
		return fmt.Errorf("fsm: snapshot checksum missing: %w", err)
	}
	if want := binary.LittleEndian.Uint32(sum[:]); got != want {
		return fmt.Errorf("fsm: snapshot checksum %08x, want %08x: the file is corrupt", got, want)
	}
	if n, _ := s.r.r.Read(sum[:1]); n != 0 {
		return fmt.Errorf("fsm: snapshot dedup section malformed: bytes after the checksum")
	}
	return nil
}

// readDedupSection reads the dedup section and the checksum after it. fileErr is a file that
// is truncated or corrupt (checked first: a section that does not decode is still read to its
// end, so that a corrupt file is reported as such); dedupErr a section that does not decode.
func (s *snapshotReader) readDedupSection() (t *dedupTable, fileErr, dedupErr error) {
	n, err := s.sectionLen("dedup")
	if err != nil {
		return nil, err, nil
	}
	section := &io.LimitedReader{R: &s.r, N: int64(n)}
	t, dedupErr = readDedup(section, n, dedupReadPiece)
	if _, err := io.Copy(io.Discard, section); err != nil {
		return nil, fmt.Errorf("fsm: snapshot dedup section truncated: %w", err), nil
	}
	if section.N != 0 {
		return nil, fmt.Errorf("fsm: snapshot dedup section truncated: %d of its %d bytes missing", section.N, n), nil
	}
	if err := s.readChecksum(); err != nil {
		return nil, err, nil
	}
	return t, nil, dedupErr
}

// Persist writes the snapshot; on error the sink is cancelled so raft discards it.
func (s *snapshot) Persist(sink raft.SnapshotSink) error {
	if err := s.writeTo(sink); err != nil {
		sink.Cancel()
		return fmt.Errorf("fsm: writing snapshot: %w", err)
	}
	return sink.Close()
}

// writeTo encodes the snapshot file to w. The engine section is built whole (its length comes
// first and is only known once it is encoded; ~24 bytes a bucket); meanwhile the dedup
// section is sized, and then written in pieces: at a full dedup window it is the largest part
// of the state (hundreds of MB), and fresh memory is what a snapshot costs most.
func (s *snapshot) writeTo(w io.Writer) error {
	engineCh := make(chan []byte, 1)
	var tokens, certs []byte
	if s.tokens != nil && len(s.tokens.byAccessor) > 0 {
		tokens = s.tokens.appendTo(nil)
	}
	if s.certs != nil && s.certs.len() > 0 {
		certs = s.certs.appendTo(nil)
	}
	go func() {
		engineCh <- appendStateSections(make([]byte, 0, snapshotHeader), s.applied, s.lastSweep, s.engine.AppendBinary, tokens, certs)
	}()
	dedupSize := s.dedup.sectionSize()
	cw := &checksumWriter{w: w}
	if _, err := cw.Write(<-engineCh); err != nil {
		return err
	}
	if _, err := cw.Write(binary.LittleEndian.AppendUint64(nil, uint64(dedupSize))); err != nil {
		return err
	}
	counted := &countingWriter{w: cw}
	if err := s.dedup.writeTo(counted, make([]byte, 0, 512<<10)); err != nil {
		return err
	}
	if counted.n != int64(dedupSize) {
		// A bug, not bad input: the file would be unreadable. Refuse to finish it.
		return fmt.Errorf("dedup section is %d bytes, sized as %d", counted.n, dedupSize)
	}
	_, err := w.Write(binary.LittleEndian.AppendUint32(nil, cw.crc))
	return err
}

// appendStateSections appends a snapshot file's header and its sections before the dedup
// section, in the oldest format that holds tokens and certs (nil: none; an empty tokens
// section is written when certs needs format 3).
func appendStateSections(b []byte, applied uint64, lastSweep int64, engine func([]byte) []byte, tokens, certs []byte) []byte {
	format := snapshotFormatFor(tokens, certs)
	b = appendSnapshotHeaderFormat(b, format, applied, lastSweep)
	b, start := beginSection(b)
	b = engine(b)
	endSection(b, start)
	if format >= snapshotFormatTokens {
		b, start = beginSection(b)
		if tokens == nil {
			tokens = emptyTokens.appendTo(nil)
		}
		b = append(b, tokens...)
		endSection(b, start)
	}
	if format >= snapshotFormatCerts {
		b, start = beginSection(b)
		b = append(b, certs...)
		endSection(b, start)
	}
	return b
}

// Release lets the state shared with the captures change in place again.
func (s *snapshot) Release() {
	s.engine.Release()
	s.dedup.release()
}

// checksumWriter passes writes through and checksums them.
type checksumWriter struct {
	w   io.Writer
	crc uint32
}

func (c *checksumWriter) Write(p []byte) (int, error) {
	c.crc = crc32.Update(c.crc, crcTable, p)
	return c.w.Write(p)
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// WriteSnapshotWithTokens copies the snapshot file read from r to w with its token table
// replaced by f's current one (written as format 1 when f has no tokens), and a new checksum;
// the other sections are copied byte for byte. A restore uses it to keep the cluster's tokens
// and revocations (security state) while the rest of the state goes back to the file's. r's
// checksum is checked at the end: on an error, what was written to w is unusable. It returns
// the number of bytes written.
func (f *FSM) WriteSnapshotWithTokens(w io.Writer, r io.Reader) (int64, error) {
	return f.WriteRestoreSnapshot(w, r, RestoreRewrite{KeepTokens: true})
}

// RestoreRewrite says how WriteRestoreSnapshot changes a snapshot file for a restore.
type RestoreRewrite struct {
	// KeepTokens replaces the file's token table with the FSM's current one.
	KeepTokens bool
	// Renumber sets the limits version to LimitsVersion and raises the lease counter to at
	// least MinLeaseSeq (quota.RenumberSnapshot).
	Renumber                   bool
	LimitsVersion, MinLeaseSeq uint64
}

// RestoreVersions returns what a restore of a file whose limits version is fileLimits and
// whose lease counter is fileLeaseSeq renumbers them to, given f's current state: the limits
// version max(current, file) + 1 (0 when both are 0: no limits were ever set), so it never
// moves backwards and never names two different limit sets; the lease counter
// max(current, file), so no lease ID is issued twice. The leader decides it once and the
// rewritten bytes are what every replica restores.
func (f *FSM) RestoreVersions(fileLimits, fileLeaseSeq uint64) RestoreRewrite {
	f.mu.RLock()
	cur, seq := f.engine.LimitsVersion(), f.engine.LeaseSeq()
	f.mu.RUnlock()
	rw := RestoreRewrite{Renumber: true, MinLeaseSeq: max(seq, fileLeaseSeq)}
	if cur > 0 || fileLimits > 0 {
		rw.LimitsVersion = max(cur, fileLimits) + 1
	}
	return rw
}

// WriteRestoreSnapshot copies the snapshot file read from r to w changed as rw says, with a
// new checksum; everything else is copied byte for byte. r's checksum is checked at the end:
// on an error, what was written to w is unusable. It returns the number of bytes written.
func (f *FSM) WriteRestoreSnapshot(w io.Writer, r io.Reader, rw RestoreRewrite) (int64, error) {
	s := snapshotReader{r: checksumReader{r: r}}
	if err := s.readHeader(); err != nil {
		return 0, err
	}
	n, err := s.sectionLen("engine")
	if err != nil {
		return 0, err
	}
	engine, err := s.readSection(n, "engine")
	if err != nil {
		return 0, err
	}
	if rw.Renumber {
		if engine, err = quota.RenumberSnapshot(engine, rw.LimitsVersion, rw.MinLeaseSeq); err != nil {
			return 0, fmt.Errorf("fsm: snapshot engine section: %w", err)
		}
	}
	var fileTokens, fileCerts []byte
	if s.format >= snapshotFormatTokens {
		n, err := s.sectionLen("tokens")
		if err != nil {
			return 0, err
		}
		if fileTokens, err = s.readSection(n, "tokens"); err != nil {
			return 0, err
		}
	}
	if s.format >= snapshotFormatCerts {
		n, err := s.sectionLen("certs")
		if err != nil {
			return 0, err
		}
		if fileCerts, err = s.readSection(n, "certs"); err != nil {
			return 0, err
		}
	}
	if bytes.Equal(fileTokens, emptyTokens.appendTo(nil)) {
		fileTokens = nil // format 3 without tokens
	}
	if rw.KeepTokens {
		fileTokens = nil
		if tokens := f.tokens.Load(); len(tokens.byAccessor) > 0 {
			fileTokens = tokens.appendTo(nil)
		}
	}
	// Revoked certificates are kept whatever the file holds, and the file's are kept too: a
	// restore never takes a revoke back (an operator who revoked a leaked certificate must not
	// see it come back with last week's backup). A file whose section does not decode is
	// refused here, before anything is restored.
	if fileCerts, err = unionCerts(f.certs.Load(), fileCerts); err != nil {
		return 0, err
	}
	b := appendStateSections(make([]byte, 0, snapshotHeader+len(engine)+len(fileTokens)+len(fileCerts)), s.applied, s.lastSweep,
		func(b []byte) []byte { return append(b, engine...) }, fileTokens, fileCerts)
	dedupLen, err := s.sectionLen("dedup")
	if err != nil {
		return 0, err
	}
	b = binary.LittleEndian.AppendUint64(b, dedupLen)
	out := &countingWriter{w: w}
	cw := &checksumWriter{w: out}
	if _, err := cw.Write(b); err != nil {
		return out.n, err
	}
	if _, err := io.CopyN(cw, &s.r, int64(dedupLen)); err != nil {
		return out.n, fmt.Errorf("fsm: snapshot dedup section truncated: %w", err)
	}
	if err := s.readChecksum(); err != nil {
		return out.n, err
	}
	_, err = out.Write(binary.LittleEndian.AppendUint32(nil, cw.crc))
	return out.n, err
}

// RestoreView is what a restore compares between the state it replaces and the file's
// (quotad snapshot restore's summary and --dry-run).
type RestoreView struct {
	LimitsVersion uint64
	LeaseSeq      uint64
	LeaseIDs      []uint64 // sorted
	PauseKeys     []string // sorted
	Buckets       int
	DedupEntries  int
}

// RestoreView returns f's RestoreView.
func (f *FSM) RestoreView() RestoreView {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return RestoreView{LimitsVersion: f.engine.LimitsVersion(), LeaseSeq: f.engine.LeaseSeq(),
		LeaseIDs: f.engine.LeaseIDs(), PauseKeys: f.engine.PauseKeys(),
		Buckets: f.engine.Stats().Buckets, DedupEntries: f.dedup.len()}
}
