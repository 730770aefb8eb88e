// Command forger is the chaos suite's attacker on the peer ports: for a while it hammers the
// Raft and gossip ports of a quotad cluster with traffic no server credential backs, and
// prints what each vector achieved as JSON on stdout.
//
// It runs as its own process (the suite builds it like the agent binary), so a forger crash
// is not the suite's. Vectors:
//
//	raft-plain-garbage   plain TCP, random bytes
//	raft-plain           plain TCP, well-formed hashicorp/raft RPCs (below)
//	raft-tls-nocert      TLS without a client certificate, the same RPCs
//	raft-tls-client      TLS with a client-role certificate from the cluster's CA (--client-cert)
//	gossip-nokey         memberlist join without a gossip key, advertising a huge applied index
//	gossip-wrongkey      the same with a random key
//	gossip-garbage       random UDP packets and TCP bytes on the gossip port
//
// The Raft RPCs are built by raft.NewNetworkTransport on the forger's own stream layer: an
// AppendEntries carrying a SetLimits command (the --limits file, with a clock 57 years
// ahead) and a garbage entry, at a huge term and at the --term/--index hints; a RequestVote
// at a huge term; a TimeoutNow. An RPC that gets any answer or a gossip join that contacts a
// node counts as accepted; against a secure cluster every
// accepted count must be 0.
package main

import (
	"crypto/rand"
	"crypto/tls"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/hashicorp/raft"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	"github.com/quotad/quotad/config"
	"github.com/quotad/quotad/fsm"
)

// Vector is what one attack achieved.
type Vector struct {
	Attempts int `json:"attempts"`
	// Accepted counts forged RPCs a node read and answered, and gossip joins let in.
	Accepted int `json:"accepted"`
	// Succeeded counts accepted RPCs answered with success: AppendEntries applied, a vote
	// granted.
	Succeeded int `json:"succeeded,omitempty"`
	Refused   int `json:"refused"`
	// Answered counts garbage that got bytes back (an error reply, e.g. memberlist's):
	// not a breach — garbage is there to crash a parser, which node-logs would show.
	Answered  int    `json:"answered,omitempty"`
	LastError string `json:"last_error,omitempty"`
	// Skipped says why the vector did not run (e.g. no client certificate given).
	Skipped string `json:"skipped,omitempty"`
}

// Report is the forger's stdout.
type Report struct {
	Duration string             `json:"duration"`
	Vectors  map[string]*Vector `json:"vectors"`
}

type forger struct {
	raft, gossip []string
	clientCert   *tls.Certificate
	limitsJSON   []byte
	pace         time.Duration

	// hintMu guards the term and last index: from the flags, then learned from every answer
	// a node gives (a node that answers at all tells its term and last log index), so that a
	// forged AppendEntries can line up with its log and be appended and committed.
	hintMu      sync.Mutex
	term, index uint64

	mu  sync.Mutex
	rep Report
}

func main() {
	var (
		raftAddrs   = flag.String("raft", "", "comma-separated Raft addresses (host:port) to attack")
		gossipAddrs = flag.String("gossip", "", "comma-separated gossip addresses (host:port) to attack")
		duration    = flag.Duration("duration", 10*time.Second, "how long to attack")
		certFile    = flag.String("client-cert", "", "PEM client certificate from the cluster's CA (vector raft-tls-client)")
		keyFile     = flag.String("client-key", "", "PEM key of --client-cert")
		limitsFile  = flag.String("limits", "", "limits YAML to forge into a SetLimits entry (default: a huge budget)")
		term        = flag.Uint64("term", 0, "a Raft term hint (learned from answers too)")
		index       = flag.Uint64("index", 0, "a Raft last-index hint: prev log index of every other forged AppendEntries (learned from answers too)")
		pace        = flag.Duration("pace", 20*time.Millisecond, "pause between two attempts of one vector")
	)
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("forger: ")
	f := &forger{raft: split(*raftAddrs), gossip: split(*gossipAddrs), term: *term, index: *index, pace: *pace,
		rep: Report{Vectors: map[string]*Vector{}}}
	if len(f.raft) == 0 && len(f.gossip) == 0 {
		log.Fatal("give --raft and/or --gossip addresses to attack")
	}
	if (*certFile == "") != (*keyFile == "") {
		log.Fatal("--client-cert and --client-key go together")
	}
	if *certFile != "" {
		c, err := tls.LoadX509KeyPair(*certFile, *keyFile)
		if err != nil {
			log.Fatalf("--client-cert %s / --client-key %s: %v", *certFile, *keyFile, err)
		}
		f.clientCert = &c
	}
	var err error
	if f.limitsJSON, err = forgedLimits(*limitsFile); err != nil {
		log.Fatal(err)
	}
	start := time.Now()
	f.run(*duration)
	f.rep.Duration = time.Since(start).Round(time.Millisecond).String()
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(&f.rep); err != nil {
		log.Fatal(err)
	}
}

func split(s string) []string {
	var out []string
	for _, a := range strings.Split(s, ",") {
		if a = strings.TrimSpace(a); a != "" {
			out = append(out, a)
		}
	}
	return out
}

const defaultForgedLimits = `domain: budget
descriptors:
  - key: b
    rate_limit: {unit: second, requests_per_unit: 1000000, burst: 1000000000}
`

// forgedLimits returns the JSON of the limits a forged SetLimits entry carries.
func forgedLimits(path string) ([]byte, error) {
	data := []byte(defaultForgedLimits)
	if path != "" {
		var err error
		if data, err = os.ReadFile(path); err != nil {
			return nil, fmt.Errorf("--limits: %w", err)
		}
	}
	l, err := config.Parse("forged", data)
	if err != nil {
		return nil, fmt.Errorf("--limits %s: %w", path, err)
	}
	return json.Marshal(l)
}

func (f *forger) vector(name string) *Vector {
	f.mu.Lock()
	defer f.mu.Unlock()
	v := f.rep.Vectors[name]
	if v == nil {
		v = &Vector{}
		f.rep.Vectors[name] = v
	}
	return v
}

// outcome of one attempt.
type outcome int

const (
	refused   outcome = iota
	answered          // garbage got bytes back
	accepted          // a forged RPC was read and answered, a join let in
	succeeded         // ... and answered with success
)

// record counts one attempt.
func (f *forger) record(name string, o outcome, err error) {
	v := f.vector(name)
	f.mu.Lock()
	defer f.mu.Unlock()
	v.Attempts++
	switch o {
	case refused:
		v.Refused++
	case answered:
		v.Answered++
	case succeeded:
		v.Succeeded++
		v.Accepted++
	case accepted:
		v.Accepted++
	}
	if err != nil {
		v.LastError = err.Error()
	}
}

func (f *forger) skip(name, why string) {
	v := f.vector(name)
	f.mu.Lock()
	v.Skipped = why
	f.mu.Unlock()
}

// run attacks with every vector at once until d has passed.
func (f *forger) run(d time.Duration) {
	deadline := time.Now().Add(d)
	var wg sync.WaitGroup
	loop := func(name string, attempt func()) {
		wg.Go(func() {
			for time.Now().Before(deadline) {
				attempt()
				time.Sleep(f.pace)
			}
		})
	}
	if len(f.raft) > 0 {
		loop("raft-plain-garbage", func() { f.garbageTCP("raft-plain-garbage", f.raft) })
		f.raftVector("raft-plain", &stream{}, loop)
		f.raftVector("raft-tls-nocert", &stream{tls: &tls.Config{InsecureSkipVerify: true}}, loop)
		if f.clientCert != nil {
			f.raftVector("raft-tls-client", &stream{tls: &tls.Config{InsecureSkipVerify: true, Certificates: []tls.Certificate{*f.clientCert}}}, loop)
		} else {
			f.skip("raft-tls-client", "no --client-cert given")
		}
	}
	if len(f.gossip) > 0 {
		loop("gossip-garbage", func() { f.garbageGossip() })
		wg.Go(func() { f.gossipJoin("gossip-nokey", nil, deadline) })
		key := make([]byte, 32)
		_, _ = rand.Read(key)
		wg.Go(func() { f.gossipJoin("gossip-wrongkey", key, deadline) })
	}
	wg.Wait()
}

// ---------------------------------------------------------------------------------------------
// Raft.

// stream is the forger's raft.StreamLayer: dials plain TCP or TLS (no server verification:
// an attacker does not care who answers). Its listener is a real loopback one nobody dials.
type stream struct {
	tls  *tls.Config
	once sync.Once
	ln   net.Listener
}

func (s *stream) listener() net.Listener {
	s.once.Do(func() {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			log.Fatalf("listen: %v", err)
		}
		s.ln = l
	})
	return s.ln
}

func (s *stream) Accept() (net.Conn, error) { return s.listener().Accept() }
func (s *stream) Close() error              { return s.listener().Close() }
func (s *stream) Addr() net.Addr            { return s.listener().Addr() }

func (s *stream) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	d := &net.Dialer{Timeout: timeout}
	if s.tls == nil {
		return d.Dial("tcp", string(address))
	}
	return tls.DialWithDialer(d, "tcp", string(address), s.tls)
}

// raftVector sends forged RPCs over st to every Raft address in turn.
func (f *forger) raftVector(name string, st *stream, loop func(string, func())) {
	tr := raft.NewNetworkTransport(st, 1, 2*time.Second, io.Discard)
	i := 0
	loop(name, func() {
		target := raft.ServerAddress(f.raft[i%len(f.raft)])
		kind := i / len(f.raft) % 3
		i++
		var err error
		ok := false
		switch kind {
		case 0:
			var resp raft.AppendEntriesResponse
			err = tr.AppendEntries("forged", target, f.appendEntries(tr, i), &resp)
			ok = resp.Success
			if err == nil {
				f.learn(resp.Term, resp.LastLog)
			}
		case 1:
			var resp raft.RequestVoteResponse
			err = tr.RequestVote("forged", target, &raft.RequestVoteRequest{
				RPCHeader: header(tr), Term: 1 << 40, LastLogIndex: 1 << 40, LastLogTerm: 1 << 40,
			}, &resp)
			ok = resp.Granted
			if err == nil {
				f.learn(resp.Term, 0)
			}
		case 2:
			var resp raft.TimeoutNowResponse
			err = tr.TimeoutNow("forged", target, &raft.TimeoutNowRequest{RPCHeader: header(tr)}, &resp)
			ok = true // the node starts an election
		}
		// Any decoded answer means the node read and handled a forged RPC.
		switch {
		case err != nil:
			f.record(name, refused, err)
		case ok:
			f.record(name, succeeded, nil)
		default:
			f.record(name, accepted, nil)
		}
	})
}

func header(tr *raft.NetworkTransport) raft.RPCHeader {
	return raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte("forged"), Addr: []byte(tr.LocalAddr())}
}

// learn keeps the latest term and last log index a node answered with.
func (f *forger) learn(term, lastLog uint64) {
	f.hintMu.Lock()
	defer f.hintMu.Unlock()
	if term > 0 { // possibly the huge term our own RPCs pushed it to: it is its term now
		f.term = term
	}
	if lastLog > 0 {
		f.index = lastLog
	}
}

// appendEntries builds the i-th forged AppendEntries: a SetLimits command stamped 57 years
// ahead and a garbage entry, alternately at a huge term with no previous entry, and right
// after the node's last entry in its current term (the hints, learned from its answers): a
// node that takes it appends both entries and, told they are committed, applies them.
func (f *forger) appendEntries(tr *raft.NetworkTransport, i int) *raft.AppendEntriesRequest {
	future := time.Now().Add(57 * 365 * 24 * time.Hour).UnixNano()
	cmd, err := fsm.Encode(&fsmv1.Command{Ts: future, Ops: []*fsmv1.Op{{Op: &fsmv1.Op_SetLimits{SetLimits: &fsmv1.SetLimits{LimitsJson: f.limitsJSON}}}}})
	if err != nil {
		log.Fatalf("encoding the forged command: %v", err)
	}
	garbage := make([]byte, 64)
	_, _ = rand.Read(garbage)
	term, prev, prevTerm := uint64(1<<40), uint64(0), uint64(0)
	f.hintMu.Lock()
	if i%2 == 1 && f.index > 0 {
		term, prev, prevTerm = max(f.term, 1), f.index, f.term
	}
	f.hintMu.Unlock()
	return &raft.AppendEntriesRequest{
		RPCHeader: header(tr), Term: term, PrevLogEntry: prev, PrevLogTerm: prevTerm,
		Entries: []*raft.Log{
			{Index: prev + 1, Term: term, Type: raft.LogCommand, Data: cmd},
			{Index: prev + 2, Term: term, Type: raft.LogCommand, Data: garbage},
		},
		LeaderCommitIndex: prev + 2,
	}
}

// garbageTCP writes random bytes to one of addrs (an answer is counted, not a breach).
func (f *forger) garbageTCP(name string, addrs []string) {
	addr := addrs[randIntN(len(addrs))]
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		f.record(name, refused, err)
		return
	}
	defer c.Close()
	b := make([]byte, 1+randIntN(4096))
	_, _ = rand.Read(b)
	_ = c.SetDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := c.Write(b); err != nil {
		f.record(name, refused, err)
		return
	}
	if n, err := c.Read(make([]byte, 512)); n > 0 {
		f.record(name, answered, err)
	} else {
		f.record(name, refused, err)
	}
}

// ---------------------------------------------------------------------------------------------
// Gossip.

// garbageGossip sends random packets to the gossip UDP port and random bytes to its TCP port.
func (f *forger) garbageGossip() {
	addr := f.gossip[randIntN(len(f.gossip))]
	if c, err := net.Dial("udp", addr); err == nil {
		b := make([]byte, 1+randIntN(1400))
		_, _ = rand.Read(b)
		_, _ = c.Write(b)
		c.Close()
	}
	f.garbageTCP("gossip-garbage", []string{addr})
}

// forgedMeta is what a quotad node advertises in gossip (cluster.nodeMeta), claiming Raft
// state and an applied index far ahead of the cluster: the fields a leader must never
// promote a voter on.
type forgedMeta struct {
	Version  int    `json:"v"`
	ID       string `json:"id"`
	Raft     string `json:"r"`
	HasState bool   `json:"s,omitempty"`
	Applied  uint64 `json:"a,omitempty"`
}

type metaDelegate struct{ meta []byte }

func (d metaDelegate) NodeMeta(int) []byte                 { return d.meta }
func (d metaDelegate) NotifyMsg([]byte)                    {}
func (d metaDelegate) GetBroadcasts(int, int) [][]byte     { return nil }
func (d metaDelegate) LocalState(bool) []byte              { return nil }
func (d metaDelegate) MergeRemoteState(buf []byte, _ bool) {}

// gossipJoin keeps a forged member trying to join until the deadline: joined (any node
// contacted, or a node seen as a member) counts as accepted.
func (f *forger) gossipJoin(name string, key []byte, deadline time.Time) {
	raftLn, err := net.Listen("tcp", "127.0.0.1:0") // the Raft address it advertises (a black hole)
	if err != nil {
		f.skip(name, err.Error())
		return
	}
	defer raftLn.Close()
	id := fmt.Sprintf("forged-%s-%d", strings.TrimPrefix(name, "gossip-"), os.Getpid())
	meta, _ := json.Marshal(forgedMeta{Version: 1, ID: id, Raft: raftLn.Addr().String(), HasState: true, Applied: 1 << 62})
	mc := memberlist.DefaultLocalConfig()
	mc.Name = id
	mc.BindAddr, mc.BindPort = "127.0.0.1", 0
	mc.SecretKey = key
	mc.Delegate = metaDelegate{meta: meta}
	mc.LogOutput = io.Discard
	mc.ProbeInterval, mc.ProbeTimeout = 500*time.Millisecond, 250*time.Millisecond
	ml, err := memberlist.Create(mc)
	if err != nil {
		f.skip(name, err.Error())
		return
	}
	defer ml.Shutdown()
	for time.Now().Before(deadline) {
		n, err := ml.Join(f.gossip)
		others := ml.NumMembers() - 1
		if n > 0 || others > 0 {
			err = fmt.Errorf("joined: contacted %d, sees %d members", n, others)
		}
		o := refused
		if n > 0 || others > 0 {
			o = accepted
		}
		f.record(name, o, err)
		time.Sleep(250 * time.Millisecond)
	}
}

func randIntN(n int) int {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return int(uint32(b[0])|uint32(b[1])<<8|uint32(b[2])<<16|uint32(b[3])<<24) % n
}
