package rpc

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/cluster"
	"github.com/quotad/quotad/config"
	"github.com/quotad/quotad/quota"
)

// ApplyLimits parses and validates a limits file and replicates the change it makes: by
// default its domains are added or replace the domains of the same name (upsert), the others
// stay; with replace_all the file is the whole set; delete_domains are removed. The leader
// computes the new set from the limits in force (read after a barrier, under a lock, so two
// applies never lose each other's domains) and replicates it as one SetLimits entry: every
// replica switches at once. dry_run returns the changes and applies nothing.
func (s *Server) ApplyLimits(ctx context.Context, req *quotadv1.ApplyLimitsRequest) (*quotadv1.ApplyLimitsResponse, error) {
	name := req.FileName
	if name == "" {
		name = "limits"
	}
	parsed, err := config.Parse(name, []byte(req.Yaml))
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if err := applyProblem(name, parsed, req); err != nil {
		return nil, err
	}
	if err := s.regionApplyProblem(); err != nil { // region.go
		return nil, err
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewAdminClient(conn).ApplyLimits(forwardCtx(ctx), req)
	}
	s.limitsMu.Lock()
	defer s.limitsMu.Unlock()
	if err := s.node.VerifyRead(ctx); err != nil {
		return nil, s.applyError(err)
	}
	cur := s.fsm.Limits()
	next, err := mergeLimits(cur, parsed, req.ReplaceAll, req.DeleteDomains)
	if err != nil {
		return nil, err
	}
	resp := &quotadv1.ApplyLimitsResponse{Version: cur.Version, Changes: config.Diff(cur, next)}
	for _, d := range next.Domains {
		resp.Domains = append(resp.Domains, d.Name)
	}
	resp.Warnings = removedDomainWarnings(cur, next, s.rls.opts.DenyUnknownDomain, req.DryRun)
	if req.DryRun {
		return resp, nil
	}
	if resp.Version, err = s.applyLimits(ctx, next); err != nil {
		return nil, err
	}
	resp.Applied = true
	return resp, nil
}

// removedDomainWarnings says, for each domain cur has and next does not, what Envoy's
// requests for it get once it is gone: with --rls-unknown-domain allow (the default) they are
// answered OK, unlimited, and nothing else would tell the operator (a user removed a live
// domain and its traffic went through unlimited). The leader answers RLS requests with its own
// flag, so the warning names this leader's; other nodes (and regional clusters, which follow
// these limits) answer with theirs.
func removedDomainWarnings(cur, next *quota.Limits, deny, dryRun bool) []string {
	var out []string
	now := "are now"
	if dryRun {
		now = "would be"
	}
	for _, d := range cur.Domains {
		if slices.ContainsFunc(next.Domains, func(x quota.Domain) bool { return x.Name == d.Name }) {
			continue
		}
		if deny {
			out = append(out, fmt.Sprintf("domain %q removed: Envoy rate limit requests for it %s refused OVER_LIMIT by this leader (it runs --rls-unknown-domain deny; each leader, a regional cluster's too, answers per its own flag) and Acquire answers unknown_domain; if Envoy still sends domain %q, keep the domain with a permissive limit instead of deleting it",
				d.Name, now, d.Name))
			continue
		}
		out = append(out, fmt.Sprintf("domain %q removed: Envoy rate limit requests for it %s answered OK, NOT rate limited, by this leader (it runs --rls-unknown-domain allow, the default; each leader, a regional cluster's too, answers per its own flag) and Acquire answers unknown_domain; to keep Envoy's traffic for %q limited, keep the domain with a permissive limit instead of deleting it, or run every node with --rls-unknown-domain deny (requests for a domain the limits do not define are then refused OVER_LIMIT)",
			d.Name, now, d.Name))
	}
	return out
}

// applyProblem refuses requests that can never be applied, before they reach the leader.
func applyProblem(name string, parsed *quota.Limits, req *quotadv1.ApplyLimitsRequest) error {
	switch {
	case req.ReplaceAll && len(req.DeleteDomains) > 0:
		return status.Error(codes.InvalidArgument, "replace_all with delete_domains: replace_all already removes every domain the file does not name; use one or the other")
	case req.ReplaceAll && len(parsed.Domains) == 0:
		return status.Errorf(codes.InvalidArgument, "%s has no domains: replacing the limits with an empty set would make every acquire unknown_domain; to remove domains, delete them by name (quotad limits delete DOMAIN)", name)
	case len(parsed.Domains) == 0 && len(req.DeleteDomains) == 0:
		return status.Errorf(codes.InvalidArgument, "%s has no domains: nothing to apply; a limits document starts with domain: NAME", name)
	}
	for _, d := range parsed.Domains {
		if t := strings.TrimSpace(d.Name); t != d.Name {
			// Checked here, where limits are applied, not by config.Parse: the limits in force
			// (which a region parses from its global cluster) may hold such a name from before.
			return status.Errorf(codes.InvalidArgument, "%s: domain %q has leading or trailing whitespace, which makes it a domain of its own, not %q (callers naming %q get unknown_domain); remove the whitespace", name, d.Name, t, t)
		}
	}
	seen := make(map[string]bool, len(req.DeleteDomains))
	for _, d := range req.DeleteDomains {
		if err := invalidArg(fieldProblem("delete_domains", d)); err != nil {
			return err
		}
		switch {
		case d == "":
			return status.Error(codes.InvalidArgument, "delete_domains has an empty name; name each domain to remove")
		case seen[d]:
			return status.Errorf(codes.InvalidArgument, "delete_domains names %q twice", d)
		case slices.ContainsFunc(parsed.Domains, func(x quota.Domain) bool { return x.Name == d }):
			return status.Errorf(codes.InvalidArgument, "domain %q is both in %s and to be deleted; do one or the other", d, name)
		}
		seen[d] = true
	}
	return nil
}

// mergeLimits is the limit set an apply makes of cur: see ApplyLimits. Domains are sorted by
// name, as config.Parse returns them.
func mergeLimits(cur, file *quota.Limits, replaceAll bool, del []string) (*quota.Limits, error) {
	next := &quota.Limits{Domains: slices.Clone(file.Domains)}
	if !replaceAll {
		inFile := make(map[string]bool, len(file.Domains))
		for _, d := range file.Domains {
			inFile[d.Name] = true
		}
		for _, d := range cur.Domains {
			if !inFile[d.Name] && !slices.Contains(del, d.Name) {
				next.Domains = append(next.Domains, d)
			}
		}
	}
	for _, name := range del {
		if !slices.ContainsFunc(cur.Domains, func(d quota.Domain) bool { return d.Name == name }) {
			have := make([]string, len(cur.Domains))
			for i, d := range cur.Domains {
				have[i] = d.Name
			}
			return nil, status.Errorf(codes.NotFound, "domain %q is not in force (limits version %d has: %s); nothing was changed",
				name, cur.Version, strings.Join(have, ", "))
		}
	}
	slices.SortFunc(next.Domains, func(a, b quota.Domain) int { return strings.Compare(a.Name, b.Name) })
	return next, nil
}

// RemovalOutcomeUnknown is in the message of a RemoveServer that answers DeadlineExceeded
// because the leader appended the removal but does not know that it committed.
const RemovalOutcomeUnknown = "not known to have committed, it may have been applied"

// RemoveServer removes a member from the Raft configuration through the leader. A removal that
// was handed to Raft but is not known to have committed answers DeadlineExceeded with a
// message saying it may have been applied: the caller must not report a plain failure (nor
// retry blindly: a second try finds the member gone).
func (s *Server) RemoveServer(ctx context.Context, req *quotadv1.RemoveServerRequest) (*quotadv1.RemoveServerResponse, error) {
	if req.Id == "" {
		return nil, status.Error(codes.InvalidArgument, "id is empty; name the member to remove (quotad status lists them)")
	}
	if err := invalidArg(fieldProblem("id", req.Id)); err != nil {
		return nil, err
	}
	conn, err := s.route(ctx)
	if err != nil || conn != nil {
		if err != nil {
			return nil, err
		}
		return quotadv1.NewAdminClient(conn).RemoveServer(forwardCtx(ctx), req)
	}
	ids, err := s.node.RemoveServer(ctx, req.Id, req.Force)
	switch {
	case err == nil:
		return &quotadv1.RemoveServerResponse{Members: ids}, nil
	case errors.Is(err, cluster.ErrOutcomeUnknown):
		return nil, status.Errorf(codes.DeadlineExceeded, "removing %q: %s (check `quotad status` before retrying): %v", req.Id, RemovalOutcomeUnknown, err)
	case errors.Is(err, cluster.ErrUnknownServer):
		return nil, status.Error(codes.NotFound, fmt.Sprintf("%v; quotad status lists the members", err))
	case errors.Is(err, cluster.ErrNotLeader), errors.Is(err, cluster.ErrShutdown):
		return nil, s.applyError(err)
	default:
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	}
}
