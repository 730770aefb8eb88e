package rpc

import (
	"context"
	"errors"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/quota"
)

// ShareStatus lists the lending of the buckets on a path (every lendable bucket of the domain
// without descriptors; of every domain without a domain) and their holders, a holder whose
// token was revoked marked so (its grant in hand may still be spent until it ends).
// Linearizable like Status: the leader answers after confirming its leadership and applying
// everything committed before the call.
func (s *Server) ShareStatus(ctx context.Context, req *quotadv1.ShareStatusRequest) (*quotadv1.ShareStatusResponse, error) {
	if req.Domain == "" && len(req.Descriptors) > 0 {
		return nil, status.Error(codes.InvalidArgument, "descriptors without a domain: name the domain of the path, or send neither to list every domain")
	}
	if err := invalidArg(firstProblem(fieldProblem("domain", req.Domain), entriesProblem("descriptors", req.Descriptors))); err != nil {
		return nil, err
	}
	if msg := scopeProblem(IdentityFrom(ctx), req.Domain, req.Descriptors, false); msg != "" {
		return nil, permissionDenied("share status: %s", msg)
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewQuotaClient(conn).ShareStatus(forwardCtx(ctx), req)
	}
	if err := s.node.VerifyRead(ctx); err != nil {
		return nil, s.applyError(err)
	}
	// The path's buckets; with no descriptors this only checks that the domain exists, so a
	// misspelled domain is NotFound rather than "no lendable bucket" (as bucket status says).
	path := make([]quota.Entry, len(req.Descriptors))
	for i, e := range req.Descriptors {
		path[i] = quota.Entry{Key: e.Key, Value: e.Value}
	}
	var onPath map[string]bool
	if req.Domain != "" {
		bs, err := s.fsm.Status(req.Domain, path)
		if err != nil {
			return nil, statusReadError(err)
		}
		if len(req.Descriptors) > 0 {
			onPath = map[string]bool{}
			for _, b := range bs {
				onPath[b.Key] = true
			}
		}
	}
	lends, holders, now := s.fsm.ShareStatusNow(req.Domain)
	id, _ := s.node.Leader()
	resp := &quotadv1.ShareStatusResponse{AppliedIndex: s.fsm.AppliedIndex(), LeaderId: id}
	for _, l := range lends {
		if onPath != nil && !onPath[l.Key] {
			continue
		}
		resp.Buckets = append(resp.Buckets, &quotadv1.LendStatus{
			Key: l.Key, RateMicro: l.Rate, BurstMicro: l.Burst, LentRateMicro: l.LentRate, LentBurstMicro: l.LentBurst,
			ReserveRateMicro: l.ReserveRate, ReserveBurstMicro: l.ReserveBurst, CentralDemandMicro: l.CentralDemand,
			Holders: uint32(l.Holders),
		})
	}
	for _, h := range holders {
		if onPath != nil && !onPath[h.Key] {
			continue
		}
		var left time.Duration
		if h.Until > now {
			left = time.Duration(h.Until - now)
		}
		resp.Holders = append(resp.Holders, &quotadv1.HolderShare{
			Key: h.Key, Owner: h.Holder.Owner, HolderId: h.Holder.ID, Incarnation: h.Holder.Incarnation,
			RateMicro: h.Rate, BurstMicro: h.Burst, ExpiresInMs: ceilMs(left), DemandMicro: h.Demand,
			Seq: h.Seq, AckSeq: h.AckSeq, Acknowledged: h.Acked, Unacked: uint32(h.Unacked),
			OwnerRevoked: s.tokenRevoked(h.Holder.Owner),
		})
	}
	return resp, nil
}

// tokenRevoked reports whether owner is a token identity whose token is no longer stored
// (revoked, or gone with a snapshot restore): the holder cannot renew, but may spend the grant
// in hand until it ends. Other identities (certificates, the bootstrap token) are never so.
func (s *Server) tokenRevoked(owner string) bool {
	accessor, ok := strings.CutPrefix(owner, fsm.TokenIdentityPrefix)
	return ok && !s.fsm.TokenStored(accessor)
}

// statusReadError is the gRPC error of a failed bucket read: InvalidArgument for a malformed
// path (a key a strict_keys domain does not define), NotFound for an unknown domain.
func statusReadError(err error) error {
	if errors.Is(err, quota.ErrInvalidRequest) {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	return status.Error(codes.NotFound, err.Error())
}
