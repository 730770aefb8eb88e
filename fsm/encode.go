package fsm

import (
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// Encoding log entries op by op. The leader's group commit encodes each op when it is
// submitted (on the caller's goroutine, in parallel) and joins the encoded ops into one
// Command when the entry is cut (EncodeEntry), instead of building a Command message and
// marshalling it with the protobuf runtime on the single committing goroutine. The bytes are
// a valid quotad.fsm.v1.Command (version, ts, then the ops), so proto.Unmarshal reads them.

// AppendAcquireOp appends the encoding of Op{acquire: {client_id, admission}} to b. It
// writes the Admission fields this build knows; unknown fields of adm are dropped.
func AppendAcquireOp(b []byte, clientID string, adm *quotadv1.Admission) []byte {
	return AppendOwnedAcquireOp(b, "", clientID, adm)
}

// AppendOwnedAcquireOp is AppendAcquireOp for owner (the authenticated caller's identity
// name, set by the leader): the lease it takes belongs to owner, and its request ID is
// namespaced by owner. It costs the log 2+len(owner) bytes per admission.
func AppendOwnedAcquireOp(b []byte, owner, clientID string, adm *quotadv1.Admission) []byte {
	admLen := admissionSize(adm)
	acqLen := 0
	if clientID != "" {
		acqLen += 1 + protowire.SizeBytes(len(clientID))
	}
	if owner != "" {
		acqLen += 1 + protowire.SizeBytes(len(owner))
	}
	acqLen += 1 + protowire.SizeBytes(admLen)
	b = protowire.AppendTag(b, fOpAcquire, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(acqLen))
	if clientID != "" {
		b = protowire.AppendTag(b, fAcquireClientID, protowire.BytesType)
		b = protowire.AppendString(b, clientID)
	}
	b = protowire.AppendTag(b, fAcquireAdmission, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(admLen))
	b = appendAdmission(b, adm)
	if owner != "" { // field 3 last, in field order as proto.Marshal writes it
		b = protowire.AppendTag(b, fAcquireOwner, protowire.BytesType)
		b = protowire.AppendString(b, owner)
	}
	return b
}

func admissionSize(a *quotadv1.Admission) int {
	n := 0
	if a.RequestId != 0 {
		n += 1 + protowire.SizeVarint(a.RequestId)
	}
	if a.Domain != "" {
		n += 1 + protowire.SizeBytes(len(a.Domain))
	}
	for _, e := range a.Descriptors {
		n += 1 + protowire.SizeBytes(entrySize(e))
	}
	if a.Cost != 0 {
		n += 1 + protowire.SizeVarint(a.Cost)
	}
	if a.LeaseTtlMs != 0 {
		n += 1 + protowire.SizeVarint(uint64(a.LeaseTtlMs))
	}
	if a.Attempt != 0 {
		n += 1 + protowire.SizeVarint(uint64(a.Attempt))
	}
	if a.WorkClass != "" {
		n += 1 + protowire.SizeBytes(len(a.WorkClass))
	}
	if a.MaxWaitMs != 0 {
		n += 1 + protowire.SizeVarint(uint64(a.MaxWaitMs))
	}
	return n
}

func entrySize(e *quotadv1.Entry) int {
	n := 0
	if k := e.GetKey(); k != "" {
		n += 1 + protowire.SizeBytes(len(k))
	}
	if v := e.GetValue(); v != "" {
		n += 1 + protowire.SizeBytes(len(v))
	}
	return n
}

func appendAdmission(b []byte, a *quotadv1.Admission) []byte {
	if a.RequestId != 0 {
		b = protowire.AppendTag(b, fAdmissionRequestID, protowire.VarintType)
		b = protowire.AppendVarint(b, a.RequestId)
	}
	if a.Domain != "" {
		b = protowire.AppendTag(b, fAdmissionDomain, protowire.BytesType)
		b = protowire.AppendString(b, a.Domain)
	}
	for _, e := range a.Descriptors {
		b = protowire.AppendTag(b, fAdmissionDescriptors, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(entrySize(e)))
		if k := e.GetKey(); k != "" {
			b = protowire.AppendTag(b, fEntryKey, protowire.BytesType)
			b = protowire.AppendString(b, k)
		}
		if v := e.GetValue(); v != "" {
			b = protowire.AppendTag(b, fEntryValue, protowire.BytesType)
			b = protowire.AppendString(b, v)
		}
	}
	if a.Cost != 0 {
		b = protowire.AppendTag(b, fAdmissionCost, protowire.VarintType)
		b = protowire.AppendVarint(b, a.Cost)
	}
	if a.LeaseTtlMs != 0 {
		b = protowire.AppendTag(b, fAdmissionLeaseTTLMs, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(a.LeaseTtlMs))
	}
	if a.Attempt != 0 {
		b = protowire.AppendTag(b, fAdmissionAttempt, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(a.Attempt))
	}
	if a.WorkClass != "" {
		b = protowire.AppendTag(b, fAdmissionWorkClass, protowire.BytesType)
		b = protowire.AppendString(b, a.WorkClass)
	}
	if a.MaxWaitMs != 0 {
		b = protowire.AppendTag(b, fAdmissionMaxWaitMs, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(a.MaxWaitMs))
	}
	return b
}

// EncodeOp returns the encoding of any op (the protobuf runtime's; for the rare kinds).
func EncodeOp(op *fsmv1.Op) ([]byte, error) {
	return proto.Marshal(op)
}

// EncodeEntry returns a Command{version: CommandVersion, ts, ops} whose ops are already
// encoded (by AppendAcquireOp or EncodeOp), in one allocation. It is EncodeEntryAt(0, ts, ops).
func EncodeEntry(ts int64, ops [][]byte) []byte { return EncodeEntryAt(0, ts, ops) }

// EncodeEntryAt is EncodeEntry writing command version version: the cluster's effective
// version (cluster.Node.CommandVersion), which every node applies, so that during a rolling
// upgrade an upgraded leader's entries do not stop the nodes not yet upgraded. Every replica
// applies the entry with that version's semantics (applyLocked). version 0 means this build's
// CommandVersion, and so does a version above it (this build cannot write what it does not
// apply); a negative one is treated as 0.
//
// The caller must not put in the entry an op that needs a newer version than version (such as
// limits with max_keys_per_parent below MaxKeysPerParentVersion): the FSM refuses it or, for
// features older than command version 6, may decide it as that older version did.
func EncodeEntryAt(version int, ts int64, ops [][]byte) []byte {
	v := uint64(CommandVersion)
	if version > 0 && version < CommandVersion {
		v = uint64(version)
	}
	n := 1 + protowire.SizeVarint(v) + 1 + protowire.SizeVarint(uint64(ts))
	for _, op := range ops {
		n += 1 + protowire.SizeBytes(len(op))
	}
	b := make([]byte, 0, n)
	b = protowire.AppendTag(b, fCommandVersion, protowire.VarintType)
	b = protowire.AppendVarint(b, v)
	b = protowire.AppendTag(b, fCommandTs, protowire.VarintType)
	b = protowire.AppendVarint(b, uint64(ts))
	for _, op := range ops {
		b = protowire.AppendTag(b, fCommandOps, protowire.BytesType)
		b = protowire.AppendBytes(b, op)
	}
	return b
}
