package rpc

import (
	"crypto/x509"
	"sync"

	"github.com/quotad/quotad/auth"
)

// nodeCertSet is the node (server) certificates this node has seen: its own, and every one a
// peer presented on a gRPC connection to it (a follower forwarding calls to this leader). A
// revoke of one of them is refused without force (Server.RevokeCert): revoking a node's
// certificate refuses that node's gRPC API and every call it forwards — all the callers it
// serves — and, where nodes share one certificate, every node's. Bounded: the first
// maxNodeCerts are kept (a cluster has a handful of nodes; renewals add a few more).
type nodeCertSet struct {
	mu      sync.Mutex
	sha     map[[32]byte]string // fingerprint → subject
	serials map[string]string   // serial (hex) → subject
}

const maxNodeCerts = 256

func newNodeCertSet() *nodeCertSet {
	return &nodeCertSet{sha: map[[32]byte]string{}, serials: map[string]string{}}
}

// add records cert (a node certificate).
func (s *nodeCertSet) add(cert *x509.Certificate) {
	if s == nil || cert == nil {
		return
	}
	k := auth.KeyOf(cert)
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.sha[k.SHA256]; ok || len(s.sha) >= maxNodeCerts {
		return
	}
	s.sha[k.SHA256] = cert.Subject.CommonName
	s.serials[k.Serial] = cert.Subject.CommonName
}

// match returns the subject of a node certificate with fingerprint sha or serial (either may
// be empty), and whether there is one.
func (s *nodeCertSet) match(sha []byte, serial string) (string, bool) {
	if s == nil {
		return "", false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(sha) == 32 {
		if subj, ok := s.sha[[32]byte(sha)]; ok {
			return subj, true
		}
	}
	if serial != "" {
		if subj, ok := s.serials[serial]; ok {
			return subj, true
		}
	}
	return "", false
}
