package fsm

import (
	"encoding/binary"
	"fmt"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	"github.com/quotad/quotad/quota"
)

// Decoding log entries without the protobuf runtime.
//
// Every replica decodes every entry, and under load almost every operation is an Acquire, so
// generic proto.Unmarshal (one allocation per message, string and oneof wrapper: ~10 per
// admission) was the largest cost of applying an entry (docs/performance.md). The decoder
// below reads the wire format of Command and of the Acquire op directly into reusable
// scratch space; other op kinds, rare and cheap, still go through proto.Unmarshal. It
// follows protobuf's rules for what our encoder writes (fields in any order, unknown fields
// skipped, the last value of a scalar or oneof wins); sub-messages repeated within one
// message, which our encoder never writes, are decoded as the last one rather than merged.

// Field numbers of quotad.fsm.v1 and quotad.v1 messages that the fast path reads.
const (
	fCommandVersion = 1
	fCommandTs      = 2
	fCommandOps     = 3

	fOpAcquire = 1

	fAcquireClientID  = 1
	fAcquireAdmission = 2
	fAcquireOwner     = 3

	fAdmissionRequestID   = 1
	fAdmissionDomain      = 2
	fAdmissionDescriptors = 3
	fAdmissionCost        = 4
	fAdmissionLeaseTTLMs  = 5
	fAdmissionAttempt     = 6
	fAdmissionWorkClass   = 7
	fAdmissionMaxWaitMs   = 8

	fEntryKey   = 1
	fEntryValue = 2
)

// rawCommand is a Command whose ops are still encoded.
type rawCommand struct {
	version uint32
	ts      int64
	ops     [][]byte // aliases the entry's data
}

// decodeCommand reads the top level of a Command into c, reusing c.ops.
func decodeCommand(b []byte, c *rawCommand) error {
	c.version, c.ts, c.ops = 0, 0, c.ops[:0]
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		switch {
		case num == fCommandVersion && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			c.version, b = uint32(v), b[n:]
		case num == fCommandTs && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			c.ts, b = int64(v), b[n:]
		case num == fCommandOps && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			c.ops, b = append(c.ops, v), b[n:]
		default:
			n := protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
		}
	}
	return nil
}

// acquireOp is a decoded Acquire op. Descriptors is scratch space reused by the next decode.
type acquireOp struct {
	// clientID is the dedup table's client: the op's client_id namespaced by its owner
	// (ownedClient).
	clientID string
	keyBuf   []byte // scratch for building clientID
	req      quota.Request
	id       uint64
	hasAdm   bool
	// waits: the admission may wait on the leader (max_wait_ms > 0). Its denials are not
	// remembered, so the scheduler can re-propose it under the same request ID.
	waits bool
	// maxWait is its max_wait_ms (scheduled grants, command version 2).
	maxWait time.Duration
}

// splitOp returns the encoded Acquire of an Op whose oneof is an Acquire (ok), or ok false
// when the op is of another kind (decode it with proto.Unmarshal).
func splitOp(b []byte) (acquire []byte, ok bool, err error) {
	last := protowire.Number(0)
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, false, protowire.ParseError(n)
		}
		b = b[n:]
		if typ == protowire.BytesType { // Op's only fields are the oneof's members
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return nil, false, protowire.ParseError(n)
			}
			last, acquire, b = num, v, b[n:]
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return nil, false, protowire.ParseError(n)
		}
		b = b[n:]
	}
	return acquire, last == fOpAcquire, nil
}

// decodeAcquire reads an encoded Acquire into a, reusing a.req.Descriptors. intern returns a
// shared copy of strings that repeat across ops (client IDs, domains, keys).
func decodeAcquire(b []byte, a *acquireOp, intern func([]byte) string) error {
	desc, keyBuf := a.req.Descriptors[:0], a.keyBuf
	*a = acquireOp{keyBuf: keyBuf}
	owner := ""
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		switch {
		case num == fAcquireClientID && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			a.clientID, b = intern(v), b[n:]
		case num == fAcquireOwner && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			owner, b = intern(v), b[n:]
		case num == fAcquireAdmission && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
			a.hasAdm = true
			var err error
			if desc, err = decodeAdmission(v, a, desc[:0], intern); err != nil {
				return err
			}
		default:
			n := protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
		}
	}
	a.req.Descriptors = desc
	if owner != "" {
		a.keyBuf = appendOwnedClient(a.keyBuf[:0], owner, a.clientID)
		a.clientID = intern(a.keyBuf)
		a.req.Owner = owner
	}
	return nil
}

// appendOwnedClient appends the dedup table's client for clientID of owner: the owner's
// length, the owner, then clientID, so that no two (owner, clientID) pairs meet and one
// identity can neither read nor refund another's decisions. Without an owner (entries written
// before ownership existed) it is clientID itself.
func appendOwnedClient(b []byte, owner, clientID string) []byte {
	if owner == "" {
		return append(b, clientID...)
	}
	b = binary.AppendUvarint(b, uint64(len(owner)))
	b = append(b, owner...)
	return append(b, clientID...)
}

// ownedClient is appendOwnedClient as a string.
func ownedClient(owner, clientID string) string {
	if owner == "" {
		return clientID
	}
	return string(appendOwnedClient(make([]byte, 0, 2+len(owner)+len(clientID)), owner, clientID))
}

func decodeAdmission(b []byte, a *acquireOp, desc []quota.Entry, intern func([]byte) string) ([]quota.Entry, error) {
	a.id, a.req, a.waits, a.maxWait = 0, quota.Request{}, false, 0
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return desc, protowire.ParseError(n)
		}
		b = b[n:]
		if typ == protowire.VarintType {
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return desc, protowire.ParseError(n)
			}
			b = b[n:]
			switch num {
			case fAdmissionRequestID:
				a.id = v
			case fAdmissionCost:
				a.req.Cost = v
			case fAdmissionLeaseTTLMs:
				a.req.LeaseTTL = msDuration(int64(v))
			case fAdmissionAttempt:
				a.req.Attempt = uint32(v)
			case fAdmissionMaxWaitMs:
				a.waits, a.maxWait = int64(v) > 0, msDuration(int64(v))
			}
			continue
		}
		if typ != protowire.BytesType {
			n := protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return desc, protowire.ParseError(n)
			}
			b = b[n:]
			continue
		}
		v, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return desc, protowire.ParseError(n)
		}
		b = b[n:]
		switch num {
		case fAdmissionDomain:
			a.req.Domain = intern(v)
		case fAdmissionWorkClass:
			a.req.WorkClass = intern(v)
		case fAdmissionDescriptors:
			e, err := decodeEntry(v, intern)
			if err != nil {
				return desc, err
			}
			desc = append(desc, e)
		}
	}
	return desc, nil
}

func decodeEntry(b []byte, intern func([]byte) string) (quota.Entry, error) {
	var e quota.Entry
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return e, protowire.ParseError(n)
		}
		b = b[n:]
		if typ == protowire.BytesType && (num == fEntryKey || num == fEntryValue) {
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return e, protowire.ParseError(n)
			}
			b = b[n:]
			if num == fEntryKey {
				e.Key = intern(v)
			} else {
				e.Value = string(v) // unbounded cardinality (tenants): not interned
			}
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return e, protowire.ParseError(n)
		}
		b = b[n:]
	}
	return e, nil
}

// internTable shares one copy of strings that repeat in nearly every op. It only saves
// memory and allocations; its contents never affect a result, so replicas need not agree on
// them. It is emptied when it grows past maxInterned (client IDs come and go).
type internTable struct {
	m map[string]string
}

const maxInterned = 4096

func (t *internTable) get(b []byte) string {
	if s, ok := t.m[string(b)]; ok { // no allocation for the lookup
		return s
	}
	if t.m == nil || len(t.m) >= maxInterned {
		t.m = make(map[string]string)
	}
	s := string(b)
	t.m[s] = s
	return s
}

// decodeOtherOp decodes an op that is not an Acquire with the protobuf runtime.
func decodeOtherOp(b []byte) (*fsmv1.Op, error) {
	op := &fsmv1.Op{}
	if err := proto.Unmarshal(b, op); err != nil {
		return nil, err
	}
	return op, nil
}

// malformed is the message of the panic that stops a replica at a committed entry it cannot
// decode. Only an authenticated leader appends entries (peers need a server certificate), so
// such an entry means a corrupt log or a buggy or incompatible leader; every replica reaches
// the same entry, and skipping it on some but not others would make them diverge silently.
// docs/architecture.md ("Fail-stop on undecodable entries") says what an operator does.
func malformed(index uint64, err error) string {
	return fmt.Sprintf("fsm: committed log entry %d is not a Command (%v): the log is corrupt or was written by a buggy or incompatible leader; stopping this replica rather than diverging from the others", index, err)
}

// CheckCommand decodes a whole log entry as Apply would, without applying it: nil if Apply
// can read it (every op of a kind this build knows), else why not. It never panics, whatever
// the bytes.
func CheckCommand(data []byte) error {
	var c rawCommand
	if err := decodeCommand(data, &c); err != nil {
		return err
	}
	if c.version == 0 || c.version > CommandVersion {
		return fmt.Errorf("command version %d; this build applies versions 1..%d", c.version, CommandVersion)
	}
	var a acquireOp
	var intern internTable
	for i, b := range c.ops {
		acq, isAcquire, err := splitOp(b)
		if err != nil {
			return fmt.Errorf("op %d: %w", i, err)
		}
		if isAcquire {
			if err := decodeAcquire(acq, &a, intern.get); err != nil {
				return fmt.Errorf("op %d (acquire): %w", i, err)
			}
			continue
		}
		op, err := decodeOtherOp(b)
		if err != nil {
			return fmt.Errorf("op %d: %w", i, err)
		}
		if op.Op == nil {
			return fmt.Errorf("op %d: an operation of a kind this build does not know", i)
		}
	}
	return nil
}
