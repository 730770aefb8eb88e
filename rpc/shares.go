package rpc

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/quota"
)

// Share obtains or renews the caller's shares (issue 12; quota.Engine.Share). The holder is
// (the caller's identity, holder_id, incarnation): shares belong to the identity, and the
// caller needs the worker role for every path's domain (and, scoped to a tenant, must name it).
func (s *Server) Share(ctx context.Context, req *quotadv1.ShareRequest) (*quotadv1.ShareResponse, error) {
	if err := invalidArg(shareRequestProblem(req)); err != nil {
		return nil, err
	}
	id := IdentityFrom(ctx)
	for i, p := range req.Paths {
		if msg := scopeProblem(id, p.GetDomain(), p.GetDescriptors(), true); msg != "" {
			return nil, permissionDenied("paths[%d]: %s", i, msg)
		}
		if msg := s.tenantPathProblem(id, p.GetDomain(), p.GetDescriptors()); msg != "" {
			return nil, permissionDenied("paths[%d]: %s", i, msg)
		}
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewQuotaClient(conn).Share(forwardCtx(ctx), req)
	}
	fsmReq := req
	if h := s.Region(); h != nil {
		fsmReq = h.CapDemand(req) // region.go
	}
	r, err := s.prop.propose(ctx, &fsmv1.Op{Op: &fsmv1.Op_Share{Share: &fsmv1.Share{Owner: id.Name, Request: fsmReq}}})
	if err != nil {
		return nil, s.applyError(err)
	}
	if err := shareError(r.Other.Err); err != nil {
		return nil, err
	}
	s.metrics.observeShare(r.Other.Share)
	return s.regionRelend(id.Name, req, fsm.ShareResponse(r.Other.Share)), nil // region.go
}

// ReleaseShare ends the caller's holder's shares and returns its unused tokens.
func (s *Server) ReleaseShare(ctx context.Context, req *quotadv1.ReleaseShareRequest) (*quotadv1.ReleaseShareResponse, error) {
	switch {
	case req.HolderId == "" || len(req.HolderId) > maxStringLen:
		return nil, status.Errorf(codes.InvalidArgument, "holder_id must be 1 to %d bytes (got %d)", maxStringLen, len(req.HolderId))
	case req.Seq == 0:
		return nil, status.Error(codes.InvalidArgument, "seq is 0; use a seq newer than the holder's last share request")
	case len(req.Tokens) > quota.MaxSharePaths*(quota.MaxDescriptors+1):
		return nil, status.Errorf(codes.InvalidArgument, "%d token entries; at most %d", len(req.Tokens), quota.MaxSharePaths*(quota.MaxDescriptors+1))
	}
	for i, t := range req.Tokens {
		if len(t.GetKey()) > 4*quota.MaxFieldBytes*(quota.MaxDescriptors+1) {
			return nil, status.Errorf(codes.InvalidArgument, "tokens[%d].key is %d bytes; it names a bucket key", i, len(t.GetKey()))
		}
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewQuotaClient(conn).ReleaseShare(forwardCtx(ctx), req)
	}
	r, err := s.prop.propose(ctx, &fsmv1.Op{Op: &fsmv1.Op_ReleaseShare{ReleaseShare: &fsmv1.ReleaseShare{Owner: IdentityFrom(ctx).Name, Request: req}}})
	if err != nil {
		return nil, s.applyError(err)
	}
	if err := shareError(r.Other.Err); err != nil {
		return nil, err
	}
	s.regionReleased(IdentityFrom(ctx).Name, req) // region.go
	return &quotadv1.ReleaseShareResponse{Returned: r.Other.Returned}, nil
}

// shareRequestProblem says why a share request can never be applied, or "".
func shareRequestProblem(req *quotadv1.ShareRequest) string {
	switch {
	case req.HolderId == "" || len(req.HolderId) > maxStringLen:
		return fmt.Sprintf("holder_id must be 1 to %d bytes (got %d); use a stable ID per holder process", maxStringLen, len(req.HolderId))
	case req.Seq == 0:
		return "seq is 0; number a holder's requests from 1, a retry reusing its seq"
	case len(req.Paths) > quota.MaxSharePaths:
		return fmt.Sprintf("%d paths in one request; a holder may share at most %d", len(req.Paths), quota.MaxSharePaths)
	}
	for i, p := range req.Paths {
		if p.GetDomain() == "" {
			return fmt.Sprintf("paths[%d].domain is empty", i)
		}
		if msg := firstProblem(fieldProblem(fmt.Sprintf("paths[%d].domain", i), p.GetDomain()),
			entriesProblem(fmt.Sprintf("paths[%d].descriptors", i), p.GetDescriptors())); msg != "" {
			return msg
		}
		if p.GetMaxCost() > MaxCost {
			return fmt.Sprintf("paths[%d].max_cost %d is above the maximum %d", i, p.GetMaxCost(), uint64(MaxCost))
		}
	}
	return ""
}

func shareError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, quota.ErrStaleShare):
		return status.Errorf(codes.FailedPrecondition, "%v; send a newer seq (a retry of the last one gets its answer)", err)
	case errors.Is(err, quota.ErrTooManyHolders), errors.Is(err, quota.ErrTooManyUnacked):
		return status.Error(codes.ResourceExhausted, err.Error())
	default:
		return status.Error(codes.InvalidArgument, err.Error())
	}
}
