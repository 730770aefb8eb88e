package rpc

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/quota"
)

// Share obtains or renews the caller's shares (issue 12; quota.Engine.Share). The holder is
// (the caller's identity, holder_id, incarnation): shares belong to the identity, and the
// caller needs the worker role for a path's domain (and, scoped to a tenant, must name it):
// a path it may not spend is answered invalid with the reason, a request with no such path
// is refused PermissionDenied.
func (s *Server) Share(ctx context.Context, req *quotadv1.ShareRequest) (*quotadv1.ShareResponse, error) {
	if err := invalidArg(shareRequestProblem(req)); err != nil {
		return nil, err
	}
	id := IdentityFrom(ctx)
	// A path the caller may not spend is answered invalid on its own, naming why; the others
	// are shared as usual. Refusing the whole request (as before) took every share of a
	// client away — renewals refused, its other Limiters never lent — for one Limiter on a
	// domain its credential does not cover. Only a request with no allowed path is refused.
	//
	// A refusal that depends on the limits (tenantPathProblem) is the leader's to make: a
	// follower's limits may lag the leader's, so a follower forwards such a request (the
	// leader checks again) instead of refusing it on its own limits. A refusal that depends
	// on the credential alone (scopeProblem) is made by any node.
	denied := make([]string, len(req.Paths))
	allowed, byLimits := 0, false
	for i, p := range req.Paths {
		msg := scopeProblem(id, p.GetDomain(), p.GetDescriptors(), true)
		if msg == "" {
			msg = s.tenantPathProblem(id, p.GetDomain(), p.GetDescriptors())
			byLimits = byLimits || msg != ""
		}
		if msg == "" {
			allowed++
			continue
		}
		denied[i] = fmt.Sprintf("paths[%d]: %s", i, msg)
	}
	if allowed == 0 && !byLimits {
		return nil, firstDenied(denied)
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			if allowed == 0 {
				return nil, firstDenied(denied) // no leader to ask: this node's limits answer, as before
			}
			return nil, err
		}
		return quotadv1.NewQuotaClient(conn).Share(forwardCtx(ctx), req)
	}
	if allowed == 0 {
		return nil, firstDenied(denied)
	}
	if allowed < len(req.Paths) {
		return s.shareAllowed(ctx, id.Name, req, denied)
	}
	return s.share(ctx, id.Name, req)
}

// firstDenied is the PermissionDenied error of a share request with no path the caller may
// spend: the reason of its first path.
func firstDenied(denied []string) error {
	for _, msg := range denied {
		if msg != "" {
			return permissionDenied("%s", msg)
		}
	}
	return permissionDenied("no path the caller may spend")
}

// shareAllowed shares the paths of req that denied leaves empty and answers the others
// invalid with their reason, in the request's order.
func (s *Server) shareAllowed(ctx context.Context, owner string, req *quotadv1.ShareRequest, denied []string) (*quotadv1.ShareResponse, error) {
	sub := proto.Clone(req).(*quotadv1.ShareRequest)
	sub.Paths = sub.Paths[:0]
	for i, p := range req.Paths {
		if denied[i] == "" {
			sub.Paths = append(sub.Paths, p)
		}
	}
	resp, err := s.share(ctx, owner, sub)
	if err != nil {
		return nil, err
	}
	paths := make([]*quotadv1.PathShare, 0, len(req.Paths))
	j := 0
	for i := range req.Paths {
		if denied[i] != "" {
			paths = append(paths, &quotadv1.PathShare{Status: string(quota.ShareInvalid), Message: "permission denied: " + denied[i]})
			continue
		}
		if j < len(resp.Paths) {
			paths = append(paths, resp.Paths[j])
		}
		j++
	}
	resp.Paths = paths
	return resp, nil
}

// share proposes a share request on the leader.
func (s *Server) share(ctx context.Context, owner string, req *quotadv1.ShareRequest) (*quotadv1.ShareResponse, error) {
	fsmReq := req
	if h := s.Region(); h != nil {
		fsmReq = h.CapDemand(req) // region.go
	}
	r, err := s.prop.propose(ctx, &fsmv1.Op{Op: &fsmv1.Op_Share{Share: &fsmv1.Share{Owner: owner, Request: fsmReq}}})
	if err != nil {
		return nil, s.applyError(err)
	}
	if err := shareError(r.Other.Err); err != nil {
		return nil, err
	}
	s.metrics.observeShare(r.Other.Share)
	// A retry (same seq) is answered from the stored grant only if it names the same paths as
	// the first try: the engine refuses it (ErrStaleShare, FailedPrecondition) otherwise. Here
	// that happens when a path's permission changed between the tries (shareAllowed proposes
	// only the paths the caller may spend; a limits change can turn a tenant-bound worker's
	// path valid or invalid), and the stored answer, matched by position, would hand one
	// path's share to another.
	resp := fsm.ShareResponse(r.Other.Share)
	return s.regionRelend(owner, req, resp), nil // region.go
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
