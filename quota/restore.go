package quota

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"slices"
)

// Restoring a snapshot into a running cluster (quotad snapshot restore) must not move
// counters that outlive the state backwards: the limits version (a regional cluster, and any
// reader, follows limits by version — a restore from 10 to 5 and an apply would make a second,
// different version 6) and the lease counter (a lease ID issued after the save would be issued
// again while its old holder may still renew or release it). The leader rewrites the engine
// section of the snapshot it installs with RenumberSnapshot, so every replica restores the
// same bytes.

// LeaseSeq is the last lease ID the engine issued.
func (e *Engine) LeaseSeq() uint64 { return e.leaseSeq }

// LeaseIDs returns the IDs of the live leases, sorted.
func (e *Engine) LeaseIDs() []uint64 {
	ids := make([]uint64, 0, len(e.leases))
	for id := range e.leases {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// PauseKeys returns the keys of the stored pauses (domain, or domain and descriptor prefix),
// sorted. Ended pauses not yet swept are included.
func (e *Engine) PauseKeys() []string {
	ks := make([]string, 0, len(e.pauses))
	for k := range e.pauses {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

// RenumberSnapshot returns the engine state data (as MarshalBinary wrote it) with its limits
// version set to limitsVersion and its lease counter raised to at least minLeaseSeq; every
// other byte is kept. It is a pure function of its arguments.
func RenumberSnapshot(data []byte, limitsVersion, minLeaseSeq uint64) ([]byte, error) {
	if len(data) == 0 {
		return nil, fmt.Errorf("%w: empty input", ErrBadSnapshot)
	}
	format := data[0]
	if format < snapshotFormat1 || format > snapshotFormat5 {
		return nil, fmt.Errorf("%w: unknown format %d (this build reads formats 1 to 5); upgrade this node", ErrBadSnapshot, format)
	}
	d := &decoder{data: data, off: 1}
	js := d.bytes(d.uvarint())
	clockStart := d.off
	d.varint()
	seqStart := d.off
	seq := d.uvarint()
	if d.err != nil {
		return nil, fmt.Errorf("%w: %v", ErrBadSnapshot, d.err)
	}
	var l Limits
	if err := json.Unmarshal(js, &l); err != nil {
		return nil, fmt.Errorf("%w: limits: %v", ErrBadSnapshot, err)
	}
	l.Version = limitsVersion
	njs, err := json.Marshal(&l)
	if err != nil {
		return nil, fmt.Errorf("quota: marshal limits: %w", err)
	}
	out := make([]byte, 0, len(data)+len(njs)-len(js)+10)
	out = append(out, format)
	out = binary.AppendUvarint(out, uint64(len(njs)))
	out = append(out, njs...)
	out = append(out, data[clockStart:seqStart]...)
	out = binary.AppendUvarint(out, max(seq, minLeaseSeq))
	return append(out, data[d.off:]...), nil
}
