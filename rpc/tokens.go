package rpc

import (
	"context"
	"errors"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/quota"
)

// CreateToken makes a bearer token. The leader generates it, replicates only its hash and
// returns it once: the secret never enters the log, a snapshot or a follower.
func (s *Server) CreateToken(ctx context.Context, req *quotadv1.CreateTokenRequest) (*quotadv1.CreateTokenResponse, error) {
	role, err := auth.ParseRole(req.Role)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "--role: %v", err)
	}
	switch {
	case role == auth.RoleWorker && len(req.Domains) == 0:
		return nil, status.Error(codes.InvalidArgument, "a worker token needs --domain (repeatable; \"*\" for every domain)")
	case role != auth.RoleWorker && (len(req.Domains) > 0 || req.Tenant != ""):
		return nil, status.Errorf(codes.InvalidArgument, "--domain and --tenant scope workers only; a token of role %s may not have them (drop them, or create a worker token)", role)
	case len(req.Tenant) > maxStringLen || len(req.Description) > maxStringLen:
		return nil, status.Errorf(codes.InvalidArgument, "--tenant and --description must be at most %d bytes", maxStringLen)
	}
	for _, d := range req.Domains {
		if d == "" || len(d) > maxStringLen {
			return nil, status.Errorf(codes.InvalidArgument, "--domain %.40q: want 1 to %d bytes", d, maxStringLen)
		}
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		resp, err := quotadv1.NewAdminClient(conn).CreateToken(forwardCtx(ctx), req)
		if err == nil {
			// Read your writes: the caller may use the token on this node next.
			s.awaitToken(ctx, auth.HashToken(resp.Token))
		}
		return resp, err
	}
	token, accessor, err := auth.NewToken()
	if err != nil {
		return nil, status.Errorf(codes.Internal, "generating a token: %v", err)
	}
	h := auth.HashToken(token)
	r, err := s.prop.propose(ctx, &fsmv1.Op{Op: &fsmv1.Op_CreateToken{CreateToken: &fsmv1.CreateToken{
		Accessor: accessor, Hash: h[:], Role: string(role), Domains: req.Domains, Tenant: req.Tenant, Description: req.Description,
		CreatedUnixMs: time.Now().UnixMilli()}}})
	if err != nil {
		// Unknown outcome: the token may exist, but nobody has its secret; list and revoke it.
		return nil, status.Errorf(codes.Unavailable, "creating token %s: %v — it may exist without anyone holding it: check quotad token list and revoke it", accessor, s.applyError(err))
	}
	if err := r.Other.Err; err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	resp := &quotadv1.CreateTokenResponse{Token: token, Accessor: accessor}
	// A domain the limits lack is not an error (limits may come after the tokens), but it is
	// most often a typo: say so, so the CLI can warn.
	limits := s.fsm.Limits()
	for _, d := range req.Domains {
		if d != auth.AnyDomain && !limits.HasDomain(d) {
			resp.UnknownDomains = append(resp.UnknownDomains, d)
		}
	}
	return resp, nil
}

// ListTokens lists the tokens, linearizably (never their secrets, which the cluster does not have).
func (s *Server) ListTokens(ctx context.Context, req *quotadv1.ListTokensRequest) (*quotadv1.ListTokensResponse, error) {
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewAdminClient(conn).ListTokens(forwardCtx(ctx), req)
	}
	if err := s.node.VerifyRead(ctx); err != nil {
		return nil, s.applyError(err)
	}
	resp := &quotadv1.ListTokensResponse{}
	for _, t := range s.fsm.Tokens() {
		resp.Tokens = append(resp.Tokens, &quotadv1.TokenInfo{Accessor: t.Accessor, Role: string(t.Role), Domains: t.Domains,
			Tenant: t.Tenant, Description: t.Description, CreatedUnixMs: t.Created})
	}
	return resp, nil
}

// RevokeToken deletes a token: once the entry is applied on a node, that node refuses calls
// carrying it (a follower that lags forwards them to the leader, which refuses them).
func (s *Server) RevokeToken(ctx context.Context, req *quotadv1.RevokeTokenRequest) (*quotadv1.RevokeTokenResponse, error) {
	if req.Accessor == "" || len(req.Accessor) > maxStringLen {
		return nil, status.Error(codes.InvalidArgument, "accessor is empty or too long; name a token as quotad token list shows it")
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewAdminClient(conn).RevokeToken(forwardCtx(ctx), req)
	}
	r, err := s.prop.propose(ctx, &fsmv1.Op{Op: &fsmv1.Op_RevokeToken{RevokeToken: &fsmv1.RevokeToken{Accessor: req.Accessor}}})
	if err != nil {
		return nil, s.applyError(err)
	}
	if err := r.Other.Err; err != nil {
		if errors.Is(err, fsm.ErrTokenNotFound) {
			return nil, status.Errorf(codes.NotFound, "token %q is already revoked, or no token ever had that accessor: nothing changed (quotad token list shows the live ones)", req.Accessor)
		}
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	s.fair.wake() // its waiting admissions are failed at the pump's next pass: now
	return &quotadv1.RevokeTokenResponse{}, nil
}

// LiftPause ends a pause on exactly the scope named (admin).
func (s *Server) LiftPause(ctx context.Context, req *quotadv1.LiftPauseRequest) (*quotadv1.LiftPauseResponse, error) {
	if req.Domain == "" {
		return nil, status.Error(codes.InvalidArgument, "domain is empty; name the paused domain (--domain)")
	}
	if len(req.Descriptors) > MaxDescriptors {
		return nil, status.Errorf(codes.InvalidArgument, "%d descriptors; at most %d", len(req.Descriptors), MaxDescriptors)
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewAdminClient(conn).LiftPause(forwardCtx(ctx), req)
	}
	r, err := s.prop.propose(ctx, &fsmv1.Op{Op: &fsmv1.Op_LiftPause{LiftPause: &fsmv1.LiftPause{Domain: req.Domain, Prefix: req.Descriptors}}})
	if err != nil {
		return nil, s.applyError(err)
	}
	if err := r.Other.Err; err != nil {
		if errors.Is(err, quota.ErrUnknownDomain) {
			return nil, status.Error(codes.NotFound, err.Error())
		}
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	scope := quota.ScopeDomain
	if n := len(req.Descriptors); n > 0 {
		scope = req.Descriptors[n-1].GetKey()
	}
	return &quotadv1.LiftPauseResponse{Lifted: r.Other.Lifted, Scope: scope}, nil
}

// awaitToken waits (up to a second, or until ctx ends) until this node has applied the
// creation of the token with hash h. Other nodes know a token once they have applied its
// entry too, normally within milliseconds of the leader.
func (s *Server) awaitToken(ctx context.Context, h [32]byte) {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	t := time.NewTicker(2 * time.Millisecond)
	defer t.Stop()
	for {
		if _, ok := s.fsm.TokenByHash(h); ok {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
