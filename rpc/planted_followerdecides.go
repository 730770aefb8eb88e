//go:build chaos_bug_followerdecides

package rpc

import (
	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// plantedFollowerDecides is a deliberately broken build for the chaos suite: a follower
// decides Acquire on its own state instead of forwarding to the leader.
func (s *Server) plantedFollowerDecides(req *quotadv1.AcquireRequest) (*quotadv1.AcquireResponse, bool) {
	if s.node.IsLeader() {
		return nil, false
	}
	ops := make([]*fsmv1.Op, len(req.Admissions))
	for i, adm := range req.Admissions {
		ops[i] = &fsmv1.Op{Op: &fsmv1.Op_Acquire{Acquire: &fsmv1.Acquire{ClientId: req.ClientId, Admission: adm}}}
	}
	res := s.fsm.ApplyLocal(ops)
	resp := &quotadv1.AcquireResponse{}
	for _, r := range res.Ops {
		resp.Decisions = append(resp.Decisions, decisionToProto(r.Decision))
	}
	return resp, true
}
