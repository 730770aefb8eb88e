//go:build !chaos_bug_followerdecides

package rpc

import quotadv1 "github.com/quotad/quotad/api/quotad/v1"

// plantedFollowerDecides does nothing outside the chaos suite's deliberately broken build.
func (s *Server) plantedFollowerDecides(*quotadv1.AcquireRequest) (*quotadv1.AcquireResponse, bool) {
	return nil, false
}
