// Package fsm is quotad's replicated state machine: it turns Raft log entries into calls on the
// pure quota engine, keeps the request-ID dedup table, and snapshots/restores the whole state.
//
// The FSM never reads a clock. Every command carries the leader's timestamp and the FSM applies
// it at now = max(clock, ts), so replicas agree whatever their wall clocks say. It must never do
// anything on Apply whose result depends on the replica (no IO, no randomness, no map order).
package fsm

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/quota"
)

// CommandVersion is the newest version of Command this build writes and applies. A leader
// writes at the cluster's effective version (cluster.Node.CommandVersion: the lowest any node
// advertises, at most this), and every replica applies an entry with its version's semantics,
// so an entry of version v is decided the same by every build that applies v.
//
// Version 2: an admission that may wait (max_wait_ms > 0) is decided with scheduled grants
// (quota.Request.ScheduleWithin = min(max_wait_ms, MaxScheduleAhead)): if its buckets can pay
// within that time it is admitted as of that moment, Decision.RetryAfter later, instead of
// refused. Version 1 entries (older leaders) are applied as they were decided.
//
// Version 3: a concurrency_limited denial carries RetryAfter = the time until the earliest
// expiry of a lease holding a permit of the refusing level (quota.Request.ConcurrencyRetryAfter);
// version 1 and 2 entries are decided with RetryAfter 0, as their leaders decided them. Limits
// may carry a domain's strict_keys (quota.Domain.StrictKeys), which an older build would drop:
// only version 3 leaders accept it, and older nodes stop at their first version 3 entry.
//
// Version 4: a RateLimit descriptor may carry its own limit (has_limit, Envoy's per-descriptor
// override), which an older build would ignore and decide by the configuration: older nodes
// stop at their first version 4 entry instead.
//
// Version 4 also: a Share is allocated work-conservingly (quota.ShareRequest.NeedsFirst): every
// holder's need (its demand without the 1.25 headroom) is filled before anyone's headroom, so
// a holder's unspent headroom no longer sits idle while another holder's need goes unmet.
// Version 1–3 Share entries are allocated in one filling, as their leaders did.
//
// Version 5: a RateLimit (Envoy RLS) at a level that lends shares is decided against the
// central part left after the lends, and its hits count as central demand
// (quota.RLSRequest.LentRate), as an Acquire is; version 1–4 RateLimit entries are decided at
// the level's full rate, as their leaders decided them.
//
// Version 6: limits may carry a level's max_keys_per_parent (quota.Node.MaxKeysPerParent),
// which an older build would ignore (json drops the field) and so admit buckets a newer one
// refuses. Older nodes stop at their first version 6 entry; a SetLimits in a version 1–5
// entry that uses it is refused (ErrInvalidLimits), as no leader of those versions
// could have written it. Leaders replicate such limits only once every node advertises
// version 6 (cluster.Member.CommandVersion, rpc's applyLimits).
//
// Version 7: shadow_mode applies to the domain's max_keys in an Acquire
// (quota.Request.ShadowMaxKeys): a shadow level's new bucket the full domain has no room for
// is skipped and reported in ShadowDenials instead of refusing the admission, as Envoy RLS
// answers it. And a Share lends no path whose lend would store buckets beyond the domain's
// max_keys or a level's max_keys_per_parent (quota.ShareRequest.KeyCaps). Version 1–6
// entries are decided as their leaders decided them; older nodes stop at their first version
// 7 entry.
//
// Version 8: RevokeCert, the certificate deny-list (certs.go): an older build does not know
// the op and stops at it. A RevokeCert in a version 1–7 entry is refused (ErrInvalidCertRevoke),
// as no leader of those versions could have written it; leaders write it only once every node
// advertises version 8 (rpc's RevokeCert). Nothing else is decided differently: entries of
// every version apply alike on a version 8 node, and a state without revoked certificates
// snapshots and hashes as before (snapshot format 3 only with some).
const CommandVersion = 8

// MaxKeysPerParentVersion is the first command version whose nodes decide
// max_keys_per_parent.
const MaxKeysPerParentVersion = 6

// MaxScheduleAhead bounds how far after its entry's time a scheduled grant may take effect.
// It is part of the replicated semantics of version 2 commands: never change it without a
// new command version.
const MaxScheduleAhead = time.Second

// DefaultDedupWindow is how long a decision is remembered for retries of its request ID.
const DefaultDedupWindow = 2 * time.Minute

var (
	// ErrLeaseNotFound: the lease expired or was released.
	ErrLeaseNotFound = quota.ErrLeaseNotFound
	// ErrInvalidLimits: a SetLimits command carried limits the engine refused; state unchanged.
	ErrInvalidLimits = errors.New("invalid limits")
)

// Options configure an FSM. The zero value is usable.
type Options struct {
	// DedupWindow is how long, in FSM time, a decision is kept for retries of the same request
	// ID. A client must not retry a request ID older than this. 0 means DefaultDedupWindow.
	// Must be the same on every replica (it changes replicated state).
	DedupWindow time.Duration
}

// FSM implements raft.FSM and raft.BatchingFSM. Apply/ApplyBatch/Snapshot/Restore are called by
// raft on one goroutine; the read methods (Clock, AppliedIndex, Status, Hash, Limits) are safe
// for concurrent use with them.
type FSM struct {
	dedupWindow time.Duration

	mu      sync.RWMutex
	engine  *quota.Engine
	dedup   *dedupTable
	applied uint64
	// lastSweep is the FSM time of the last full engine.Tick (replicated: it decides when the
	// next sweep happens, so it is part of the snapshot).
	lastSweep quota.Time
	// tokens is the token table (tokens.go): immutable versions, read without the lock.
	tokens atomic.Pointer[tokenSet]
	// tokensGen counts the token table's replacements (TokensGeneration).
	tokensGen atomic.Uint64
	// certs is the certificate deny-list (certs.go), read without the lock; certsGen counts
	// its replacements (CertsGeneration).
	certs    atomic.Pointer[certSet]
	certsGen atomic.Uint64

	// scratch is decoding space reused across entries (guarded by mu; not replicated state).
	scratch struct {
		cmd     rawCommand
		acquire acquireOp
		intern  internTable
		// version is the command version of the entry being applied (ops that decide
		// differently by version read it).
		version uint32
	}
}

func msDuration(ms int64) time.Duration { return time.Duration(ms) * time.Millisecond }

// SweepInterval is how often, in FSM time, the FSM runs the engine's full sweep (expired leases
// and pauses, full idle buckets dropped). Between sweeps the engine expires leases lazily.
const SweepInterval = time.Second

// New returns an empty FSM.
func New(opts Options) *FSM {
	if opts.DedupWindow <= 0 {
		opts.DedupWindow = DefaultDedupWindow
	}
	f := &FSM{dedupWindow: opts.DedupWindow, engine: quota.NewEngine(), dedup: newDedupTable()}
	f.storeTokens(emptyTokens)
	f.storeCerts(emptyCerts)
	return f
}

// Result is the response of one applied log entry: one OpResult per Op, in order.
type Result struct {
	Ops []OpResult
}

// OpResult is the outcome of one Op: Decision and Duplicate answer an Acquire (Other is nil);
// Other answers every other kind of op (and is never nil for one).
//
// Every replica builds one for every admission it applies, so the Acquire answer is kept
// small and pointer-light (128 bytes, where carrying a quota.Decision and every other op
// kind's fields took ~350) and the rarer outcomes are behind a pointer.
type OpResult struct {
	Decision  Decision     // Acquire
	Duplicate bool         // Acquire: answered from the dedup table
	Other     *OtherResult // any other op kind
}

// OtherResult is the outcome of an op other than Acquire. Only the fields of the op's kind
// are meaningful.
type OtherResult struct {
	Released      bool                 // Release
	Lifted        bool                 // LiftPause
	LeaseTTL      time.Duration        // Renew
	Refunded      uint64               // Refund: the admission's cost when RefundOutcome is RefundRefunded
	RefundOutcome RefundOutcome        // Refund
	BucketsKept   int                  // Refund: charged buckets a later admission debited, which keep the units
	Scope         string               // Pause, Feedback, LiftPause
	PausedFor     time.Duration        // Pause, Feedback
	Feedback      quota.FeedbackResult // Feedback
	LimitsVersion uint64               // SetLimits
	RateLimit     quota.RLSDecision    // RateLimit (Envoy RLS)
	Matcher       *quota.Matcher       // RateLimit: the limits it was decided under (statistics keys)
	Share         *quota.ShareGrant    // Share (nil with Err)
	Returned      uint64               // ReleaseShare: micro-units put back
	Err           error                // Release, Renew, Pause, Feedback, SetLimits, CreateToken, RevokeToken, RevokeCert, LiftPause, Share, ReleaseShare
}

// RefundOutcome is what became of a Refund (quotad.v1.RefundResponse.outcome).
//
// Only the answer is computed from it: a Refund changes the state exactly as it did before
// RefundOutcome existed, so replicas of either build apply the same entries alike, and the
// command version is unchanged.
type RefundOutcome string

const (
	// RefundRefunded: the admission was found and not refunded before; its charged buckets
	// took the units back (OtherResult.BucketsKept of them keep them: debited since).
	RefundRefunded RefundOutcome = "refunded"
	// RefundNotFound: no admission under that request ID for that caller (never made, or
	// older than the dedup table remembers).
	RefundNotFound RefundOutcome = "not_found"
	// RefundNotAdmitted: the request was denied; nothing to give back.
	RefundNotAdmitted RefundOutcome = "not_admitted"
	// RefundAlreadyRefunded: an earlier Refund of the admission did the work.
	RefundAlreadyRefunded RefundOutcome = "already_refunded"
	// RefundNothingToRefund: the admission was found but took no rate tokens (only
	// concurrency permits, which a Release returns): Refunded is 0, at every Refund of it.
	RefundNothingToRefund RefundOutcome = "nothing_to_refund"
)

// applyRefund applies a Refund. The state changes exactly as before RefundNothingToRefund
// existed (every first refund of an admission calls Engine.Refund, which advances the clock,
// and marks the dedup record refunded); only the answer differs.
func (f *FSM) applyRefund(now quota.Time, o *fsmv1.Refund) OtherResult {
	seq, ok := f.dedup.lookup(ownedClient(o.Owner, o.ClientId), o.RequestId)
	if !ok {
		return OtherResult{RefundOutcome: RefundNotFound}
	}
	if f.dedup.refunded(seq) {
		if !debited(f.dedup.decision(seq)) {
			return OtherResult{RefundOutcome: RefundNothingToRefund}
		}
		return OtherResult{RefundOutcome: RefundAlreadyRefunded}
	}
	d := f.dedup.decision(seq)
	if !d.Admitted {
		return OtherResult{RefundOutcome: RefundNotAdmitted}
	}
	r := f.engine.Refund(now, d.Charges, d.Cost, d.DebitSeq)
	f.dedup.setRefunded(seq)
	if !debited(d) {
		return OtherResult{RefundOutcome: RefundNothingToRefund}
	}
	return OtherResult{Refunded: d.Cost, RefundOutcome: RefundRefunded, BucketsKept: r.Kept}
}

// debited reports whether admission d took rate tokens: the admissions Engine.Refund can give
// something back to (it returns an empty RefundResult for the others).
func debited(d quota.Decision) bool {
	return d.Admitted && len(d.Charges) > 0 && d.Cost > 0 && d.DebitSeq != 0
}

// Decision is the answer to an Acquire: a quota.Decision without Charges, Cost and DebitSeq
// (which only the FSM needs, for refunds; the dedup table keeps them) and ShadowDenials
// (which no caller reads).
type Decision struct {
	Admitted   bool
	Reason     quota.Reason
	Scope      string
	Limit      uint64
	Remaining  uint64
	Window     time.Duration
	ResetAfter time.Duration
	RetryAfter time.Duration
	LeaseID    uint64
	LeaseTTL   time.Duration
	Message    string
}

// setAnswer sets a to the part of d a caller is answered with.
func setAnswer(a *Decision, d *quota.Decision) {
	*a = Decision{Admitted: d.Admitted, Reason: d.Reason, Scope: d.Scope, Limit: d.Limit,
		Remaining: d.Remaining, Window: d.Window, ResetAfter: d.ResetAfter, RetryAfter: d.RetryAfter,
		LeaseID: d.LeaseID, LeaseTTL: d.LeaseTTL, Message: d.Message}
}

// Encode marshals cmd, setting its version.
func Encode(cmd *fsmv1.Command) ([]byte, error) {
	cmd.Version = CommandVersion
	return proto.Marshal(cmd)
}

// EncodeTick returns a command with no operations, at command version version (0: this
// build's; see EncodeEntryAt): applying it advances the clock to ts and expires leases and
// pauses. It satisfies cluster.FSM.
func (f *FSM) EncodeTick(ts int64, version int) []byte { return EncodeEntryAt(version, ts, nil) }

// Apply applies one log entry.
func (f *FSM) Apply(l *raft.Log) any {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.applyLocked(l)
}

// ApplyBatch applies consecutive log entries under one lock acquisition.
func (f *FSM) ApplyBatch(logs []*raft.Log) []any {
	out := make([]any, len(logs))
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, l := range logs {
		out[i] = f.applyLocked(l)
	}
	return out
}

func (f *FSM) applyLocked(l *raft.Log) any {
	if l.Index > f.applied {
		f.applied = l.Index
	}
	if l.Type != raft.LogCommand {
		return nil
	}
	cmd := &f.scratch.cmd
	if err := decodeCommand(l.Data, cmd); err != nil {
		// A committed entry we cannot read means this replica can no longer follow the log;
		// skipping it would silently diverge, so stop.
		panic(malformed(l.Index, err))
	}
	if cmd.version == 0 || cmd.version > CommandVersion {
		panic(fmt.Sprintf("fsm: committed log entry %d has command version %d; this build applies versions 1..%d — upgrade this node", l.Index, cmd.version, CommandVersion))
	}
	f.scratch.version = cmd.version
	now := quota.Time(cmd.ts)
	if c := f.engine.Clock(); now < c {
		now = c
	}
	f.engine.Advance(now)
	if now.Sub(f.lastSweep) >= SweepInterval {
		f.engine.Tick(now)
		f.lastSweep = now
	}
	f.dedup.expire(now)
	res := &Result{Ops: make([]OpResult, len(cmd.ops))}
	for i, b := range cmd.ops {
		acq, isAcquire, err := splitOp(b)
		if err != nil {
			panic(malformed(l.Index, err))
		}
		if isAcquire {
			a := &f.scratch.acquire
			if err := decodeAcquire(acq, a, f.scratch.intern.get); err != nil {
				panic(malformed(l.Index, err))
			}
			if a.waits && cmd.version >= 2 {
				a.req.ScheduleWithin = min(a.maxWait, MaxScheduleAhead)
			}
			a.req.ConcurrencyRetryAfter = cmd.version >= 3
			a.req.ShadowMaxKeys = cmd.version >= 7
			f.applyAcquire(now, a, &res.Ops[i]) // in place: no copy of the result per admission
			continue
		}
		op, err := decodeOtherOp(b)
		if err != nil {
			panic(malformed(l.Index, err))
		}
		if op.Op == nil {
			// A kind this build does not know (a newer leader's) or a corrupt entry: skipping it
			// would let this replica diverge silently from the ones that apply it.
			panic(fmt.Sprintf("fsm: committed log entry %d holds an operation this build does not know (written by a newer leader, or corrupt); upgrade this node", l.Index))
		}
		res.Ops[i] = f.applyOp(now, op)
	}
	return res
}

func (f *FSM) applyOp(now quota.Time, op *fsmv1.Op) OpResult {
	switch o := op.Op.(type) {
	case *fsmv1.Op_Acquire: // decoded by the fast path; kept for completeness
		a := o.Acquire
		op := acquireOp{clientID: ownedClient(a.Owner, a.ClientId), hasAdm: a.Admission != nil}
		if adm := a.Admission; adm != nil {
			op.id, op.waits = adm.RequestId, adm.MaxWaitMs > 0
			op.req = quota.Request{Domain: adm.Domain, Descriptors: entries(adm.Descriptors), Cost: adm.Cost,
				LeaseTTL: msDuration(adm.LeaseTtlMs), Attempt: adm.Attempt, WorkClass: adm.WorkClass, Owner: a.Owner}
		}
		var r OpResult
		f.applyAcquire(now, &op, &r)
		return r
	case *fsmv1.Op_Release:
		ok, err := f.engine.ReleaseBy(now, o.Release.LeaseId, o.Release.Owner)
		return other(OtherResult{Released: ok, Err: err})
	case *fsmv1.Op_Renew:
		ttl, err := f.engine.RenewBy(now, o.Renew.LeaseId, time.Duration(o.Renew.TtlNs), o.Renew.Owner)
		return other(OtherResult{LeaseTTL: ttl, Err: err})
	case *fsmv1.Op_Refund:
		return other(f.applyRefund(now, o.Refund))
	case *fsmv1.Op_SetLimits:
		var l quota.Limits
		if err := json.Unmarshal(o.SetLimits.LimitsJson, &l); err != nil {
			return other(OtherResult{Err: fmt.Errorf("%w: %v", ErrInvalidLimits, err)})
		}
		if f.scratch.version < MaxKeysPerParentVersion && l.UsesMaxKeysPerParent() {
			return other(OtherResult{Err: fmt.Errorf("%w: max_keys_per_parent in a version %d entry; it needs command version %d",
				ErrInvalidLimits, f.scratch.version, MaxKeysPerParentVersion)})
		}
		if err := f.engine.SetLimits(now, &l); err != nil {
			return other(OtherResult{Err: fmt.Errorf("%w: %w", ErrInvalidLimits, err)})
		}
		return other(OtherResult{LimitsVersion: f.engine.Limits().Version})
	case *fsmv1.Op_Pause:
		d := time.Duration(o.Pause.DurationNs)
		scope, err := f.engine.Pause(now, o.Pause.Domain, entries(o.Pause.Prefix), now.Add(d))
		if err != nil {
			return other(OtherResult{Err: err})
		}
		return other(OtherResult{Scope: scope, PausedFor: d})
	case *fsmv1.Op_Feedback:
		fb := o.Feedback
		res, err := f.engine.Feedback(now, quota.Feedback{Domain: fb.Domain, Prefix: entries(fb.Prefix),
			StatusCode: fb.StatusCode, RetryAfter: time.Duration(fb.RetryAfterNs), Reason: fb.Reason})
		if err != nil {
			return other(OtherResult{Err: err})
		}
		return other(OtherResult{Scope: res.Scope, PausedFor: res.PausedFor, Feedback: res})
	case *fsmv1.Op_CreateToken:
		return other(OtherResult{Err: f.applyCreateToken(o.CreateToken)})
	case *fsmv1.Op_RevokeToken:
		return other(OtherResult{Err: f.applyRevokeToken(o.RevokeToken)})
	case *fsmv1.Op_RevokeCert:
		return other(OtherResult{Err: f.applyRevokeCert(o.RevokeCert)})
	case *fsmv1.Op_RateLimit:
		rl := o.RateLimit
		req := quota.RLSRequest{Domain: rl.Domain, Hits: rl.Hits, Descriptors: make([]quota.RLSDescriptor, len(rl.Descriptors)),
			LentRate: f.scratch.version >= 5}
		for i, d := range rl.Descriptors {
			req.Descriptors[i] = quota.RLSDescriptor{Entries: entries(d.GetEntries()), HasHits: d.GetHasHits(), Hits: d.GetHits()}
			if d.GetHasLimit() {
				req.Descriptors[i].Limit = &quota.RLSLimit{RequestsPerUnit: d.GetLimitRequestsPerUnit(),
					Unit: time.Duration(min(d.GetLimitUnitSeconds(), uint64(quota.MaxOverrideUnit/time.Second)+1)) * time.Second}
			}
		}
		// The matcher comes with the decision: the leader's statistics need no FSM lock.
		return other(OtherResult{RateLimit: f.engine.RateLimit(now, req), Matcher: f.engine.Matcher()})
	case *fsmv1.Op_LiftPause:
		lp := o.LiftPause
		lifted, err := f.engine.Resume(now, lp.Domain, entries(lp.Prefix))
		if err != nil {
			return other(OtherResult{Err: err})
		}
		return other(OtherResult{Lifted: lifted})
	case *fsmv1.Op_Share:
		return f.applyShare(now, o.Share)
	case *fsmv1.Op_ReleaseShare:
		return f.applyReleaseShare(now, o.ReleaseShare)
	default:
		// An op this build does not know comes from a newer leader. Skipping it would let this
		// replica diverge silently from the ones that apply it, so stop instead.
		panic(fmt.Sprintf("fsm: a committed entry holds an operation this build does not know (%T); upgrade this node", op.Op))
	}
}

func other(r OtherResult) OpResult { return OpResult{Other: &r} }

// applyAcquire decides a and sets out, a zero OpResult, to the answer.
func (f *FSM) applyAcquire(now quota.Time, a *acquireOp, out *OpResult) {
	if !a.hasAdm {
		out.Decision = Decision{Reason: quota.ReasonInvalid, Message: "admission missing"}
		return
	}
	if msg := opProblem(a); msg != "" {
		out.Decision = Decision{Reason: quota.ReasonInvalid, Message: msg}
		return
	}
	fp := admissionFingerprint(a)
	seq, known, at := f.dedup.find(a.clientID, a.id)
	if known && !plantedNoDedup {
		if old := f.dedup.fingerprint(seq); old != 0 && old != fp {
			d := conflictDecision(a.clientID, a.id)
			setAnswer(&out.Decision, &d)
			return
		}
		d := f.dedup.decision(seq)
		setAnswer(&out.Decision, &d)
		out.Duplicate = true
		return
	}
	a.req.Spread = spread(a.clientID, a.id)
	d := f.engine.Acquire(now, a.req)
	// Remember what a retry must get back. Not remembered, because they change nothing and a
	// retry may safely be decided afresh: invalid, unknown-domain and too-many-keys answers
	// (the last so that a flood of invented keys leaves no state at all, not even here), and
	// denials of admissions that wait on the leader (the scheduler re-proposes those under the
	// same ID until their wait ends).
	remember := a.clientID != "" && a.id != 0 && d.Reason != quota.ReasonInvalid &&
		d.Reason != quota.ReasonUnknownDomain && d.Reason != quota.ReasonTooManyKeys && (d.Admitted || !a.waits)
	if remember {
		f.dedup.putAt(at, a.clientID, a.id, fp, now.Add(f.dedupWindow), &d)
	}
	setAnswer(&out.Decision, &d)
}

// spread derives a request's place in a pause's resume jitter window from its IDs: the same on
// every replica, different across requests (FNV-1a, then a splitmix64 finalizer so that
// consecutive request IDs land far apart).
func spread(clientID string, requestID uint64) uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(clientID); i++ {
		h = (h ^ uint64(clientID[i])) * 1099511628211
	}
	h ^= requestID
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	return h ^ h>>31
}

func entries(es []*quotadv1.Entry) []quota.Entry {
	if len(es) == 0 {
		return nil
	}
	out := make([]quota.Entry, len(es))
	for i, e := range es {
		out[i] = quota.Entry{Key: e.Key, Value: e.Value}
	}
	return out
}

// Clock returns the FSM clock after the last applied entry, in nanoseconds.
func (f *FSM) Clock() int64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return int64(f.engine.Clock())
}

// CommandVersion returns the newest command version this FSM applies (CommandVersion); the
// cluster advertises it so that a leader knows what every node can decide.
func (f *FSM) CommandVersion() int { return CommandVersion }

// AppliedIndex returns the index of the last applied log entry.
func (f *FSM) AppliedIndex() uint64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.applied
}

// Status returns the buckets on a descriptor path as of the last applied entry. It reads local
// state: callers make it linearizable by checking leadership and the applied index first.
func (f *FSM) Status(domain string, path []quota.Entry) ([]quota.BucketStatus, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.engine.Status(f.engine.Clock(), domain, path)
}

// Remembers reports whether the dedup table holds a decision for (owner, clientID,
// requestID): a retry of it must go to the log, where it gets that decision back, whatever
// the scheduler would say about fresh work.
func (f *FSM) Remembers(owner, clientID string, requestID uint64) bool {
	key := ownedClient(owner, clientID)
	f.mu.RLock()
	defer f.mu.RUnlock()
	_, ok := f.dedup.lookup(key, requestID)
	return ok
}

// Matcher returns the descriptor matcher of the current limits (immutable; it keeps matching
// against those limits after they change).
func (f *FSM) Matcher() *quota.Matcher {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.engine.Matcher()
}

// Limits returns the current limits (treat as read-only).
func (f *FSM) Limits() *quota.Limits {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.engine.Limits()
}

// StateHash is a replica's state fingerprint at an applied index.
type StateHash struct {
	AppliedIndex uint64 `json:"applied_index"`
	Hash         uint64 `json:"hash,omitempty"` // only from /debug/state?hash=1
	Clock        int64  `json:"clock"`
}

// Hash fingerprints the whole replicated state (engine and dedup table). Two replicas at the
// same applied index must report the same Hash.
//
// The dedup table (millions of records at full load, a second or more to hash) is hashed from
// a capture after the lock is released, so that polling Hash does not hold up applies.
func (f *FSM) Hash() StateHash {
	f.mu.Lock() // capturing marks the table shared
	h := fnv.New64a()
	var b [8]byte
	putU64(b[:], f.engine.Hash())
	h.Write(b[:])
	putU64(b[:], uint64(f.lastSweep))
	h.Write(b[:])
	f.tokens.Load().hashInto(h)
	f.certs.Load().hashInto(h)
	dedup := f.dedup.capture()
	out := StateHash{AppliedIndex: f.applied, Clock: int64(f.engine.Clock())}
	f.mu.Unlock()
	dedup.hashInto(h)
	dedup.release()
	out.Hash = h.Sum64()
	return out
}

// Stats are sizes of the replicated state, for metrics.
type Stats struct {
	quota.Stats
	DedupEntries int
}

// Stats returns the current state sizes.
func (f *FSM) Stats() Stats {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return Stats{Stats: f.engine.Stats(), DedupEntries: f.dedup.len()}
}

// Snapshot captures the whole state. It runs on raft's FSM goroutine, so applies wait for it:
// it only captures (quota.Engine.Capture, dedupTable.capture: O(chunks), copy-on-write), and
// the returned snapshot's Persist encodes on raft's snapshot goroutine while applies go on.
// With a million buckets and a full dedup window, encoding here took half a second or more:
// long enough for raft's apply queue to fill, and a follower whose queue is full answers no
// heartbeats (its fast path hands the commit index to the FSM before recording contact).
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	f.mu.Lock() // capturing marks the state shared; readers wait for microseconds
	defer f.mu.Unlock()
	engine, err := f.engine.Capture()
	if err != nil {
		return nil, fmt.Errorf("fsm: snapshot of the engine: %w", err)
	}
	return &snapshot{applied: f.applied, lastSweep: int64(f.lastSweep), engine: engine, dedup: f.dedup.capture(), tokens: f.tokens.Load(), certs: f.certs.Load()}, nil
}

// Restore replaces the whole state with a snapshot's (never merges). Nothing is replaced
// unless the whole file was read and its checksum matches.
func (f *FSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	s := snapshotReader{r: checksumReader{r: rc}}
	if err := s.readHeader(); err != nil {
		return err
	}
	n, err := s.sectionLen("engine")
	if err != nil {
		return err
	}
	engineBytes, err := s.readSection(n, "engine")
	if err != nil {
		return err
	}
	tokens := emptyTokens
	var tokensErr error
	if s.format >= snapshotFormatTokens {
		n, err := s.sectionLen("tokens")
		if err != nil {
			return err
		}
		b, err := s.readSection(n, "tokens")
		if err != nil {
			return err
		}
		tokens, tokensErr = decodeTokens(b) // reported after the checksum: a corrupt file first
	}
	certs := emptyCerts
	var certsErr error
	if s.format >= snapshotFormatCerts {
		n, err := s.sectionLen("certs")
		if err != nil {
			return err
		}
		b, err := s.readSection(n, "certs")
		if err != nil {
			return err
		}
		certs, certsErr = decodeCerts(b)
	}
	// The two sections are independent: decode the engine on another goroutine while the
	// dedup section is read and decoded here. Both start before the checksum at the end is
	// checked, and both take any bytes (UnmarshalBinary is fuzzed to return an error or a
	// usable engine); neither result is used unless the checksum matches.
	engine := quota.NewEngine()
	engineDone := make(chan error, 1)
	go func() { engineDone <- engine.UnmarshalBinary(engineBytes) }()
	dedup, fileErr, dedupErr := s.readDedupSection()
	engineErr := <-engineDone
	switch {
	case fileErr != nil:
		return fileErr
	case engineErr != nil:
		return fmt.Errorf("fsm: restoring the engine: %w", engineErr)
	case dedupErr != nil:
		return dedupErr
	case tokensErr != nil:
		return tokensErr
	case certsErr != nil:
		return certsErr
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.engine, f.dedup, f.applied, f.lastSweep = engine, dedup, s.applied, quota.Time(s.lastSweep)
	f.storeTokens(tokens)
	f.storeCerts(certs)
	return nil
}
