package clustertest

import (
	"crypto/tls"
	"io"
	"net"
	"time"

	"github.com/hashicorp/raft"
)

// Forger speaks Raft to a node the way an attacker on the network would: a hand-built
// hashicorp/raft NetworkTransport over its own dialer (plain TCP, or TLS with whatever
// configuration the attack needs). It is for tests of the peer trust boundary.
type Forger struct {
	trans *raft.NetworkTransport
	ln    net.Listener
}

// NewForger returns a Forger dialing with tlsCfg (nil: plain TCP).
func NewForger(tlsCfg *tls.Config) (*Forger, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &forgeStream{Listener: ln, tls: tlsCfg}
	trans := raft.NewNetworkTransport(s, 1, 3*time.Second, io.Discard)
	return &Forger{trans: trans, ln: ln}, nil
}

// Close releases the Forger's transport.
func (f *Forger) Close() error { return f.trans.Close() }

// AppendEntries sends one forged AppendEntries to addr claiming leadership at term with the
// given command entries appended after (prevIndex, prevTerm) and committed at once. It
// returns the transport's error (nil means the target answered; resp says what).
func (f *Forger) AppendEntries(addr string, term, prevIndex, prevTerm uint64, data ...[]byte) (*raft.AppendEntriesResponse, error) {
	req := &raft.AppendEntriesRequest{
		RPCHeader:         raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte("forger"), Addr: []byte(f.ln.Addr().String())},
		Term:              term,
		PrevLogEntry:      prevIndex,
		PrevLogTerm:       prevTerm,
		LeaderCommitIndex: prevIndex + uint64(len(data)),
	}
	for i, d := range data {
		req.Entries = append(req.Entries, &raft.Log{Index: prevIndex + uint64(i) + 1, Term: term, Type: raft.LogCommand, Data: d})
	}
	var resp raft.AppendEntriesResponse
	err := f.trans.AppendEntries("victim", raft.ServerAddress(addr), req, &resp)
	return &resp, err
}

// RequestVote asks addr for its vote at term, claiming a log up to lastIndex/lastTerm.
func (f *Forger) RequestVote(addr string, term, lastIndex, lastTerm uint64) (*raft.RequestVoteResponse, error) {
	req := &raft.RequestVoteRequest{
		RPCHeader:    raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte("forger"), Addr: []byte(f.ln.Addr().String())},
		Term:         term,
		LastLogIndex: lastIndex,
		LastLogTerm:  lastTerm,
	}
	var resp raft.RequestVoteResponse
	err := f.trans.RequestVote("victim", raft.ServerAddress(addr), req, &resp)
	return &resp, err
}

type forgeStream struct {
	net.Listener
	tls *tls.Config
}

func (s *forgeStream) Dial(addr raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	d := &net.Dialer{Timeout: timeout}
	if s.tls == nil {
		return d.Dial("tcp", string(addr))
	}
	return tls.DialWithDialer(d, "tcp", string(addr), s.tls)
}
