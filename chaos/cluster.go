package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/chaos/faults"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/internal/proccluster"
)

// Backend runs the agents: real processes on loopback (internal/proccluster) or one Docker
// container per node. Nodes are slots addressed by index; a slot's addresses and data dir
// survive restarts.
type Backend interface {
	// Name is "process" or "docker".
	Name() string
	// Len is the number of slots created so far.
	Len() int
	// Addrs returns slot i's identity and addresses as the test process reaches them.
	Addrs(i int) NodeAddrs
	// Prepare adds a slot (not started) whose node will join the running cluster.
	Prepare() (int, error)
	// Start (re)starts slot i from its data dir; nothing if it runs.
	Start(i int) error
	// Kill kills slot i at once (SIGKILL) and waits until it is gone.
	Kill(i int) error
	// Stop stops slot i gracefully, killing it after grace.
	Stop(i int, grace time.Duration) error
	Pause(i int) error
	Resume(i int) error
	Running(i int) bool
	Paused(i int) bool
	// Starts counts how often slot i was started.
	Starts(i int) int
	// Close stops every node, collects the logs into the log dir and frees every resource
	// (containers, networks, images).
	Close()
}

// Isolator is a Backend that can cut a node off the network itself (docker network
// disconnect) rather than through the in-binary partition hook.
type Isolator interface {
	// Isolate disconnects slot i from every other node (and from the test process).
	Isolate(i int) error
	// Reconnect undoes every Isolate.
	Reconnect() error
}

// NodeAddrs is a node's identity, addresses and data dir.
type NodeAddrs struct {
	ID, GRPC, Raft, Gossip, HTTP string
	// DataDir is the node's data dir on the test machine (bind-mounted into a container).
	DataDir string
	// LogPath is the node's log file while it runs ("" when the backend collects logs only
	// at the end).
	LogPath string
}

// Node is one agent slot of a Cluster.
type Node struct {
	NodeAddrs
	Index int
	// Removed is set while the node has left the cluster and its data dir was wiped.
	Removed bool
	b       Backend
}

func (n *Node) Running() bool                  { return n.b.Running(n.Index) }
func (n *Node) Paused() bool                   { return n.b.Paused(n.Index) }
func (n *Node) Kill() error                    { return n.b.Kill(n.Index) }
func (n *Node) Stop(grace time.Duration) error { return n.b.Stop(n.Index, grace) }
func (n *Node) Pause() error                   { return n.b.Pause(n.Index) }
func (n *Node) Resume() error                  { return n.b.Resume(n.Index) }
func (n *Node) Starts() int                    { return n.b.Starts(n.Index) }
func (n *Node) String() string                 { return n.ID }
func (n *Node) wipe() error                    { return removeContents(n.DataDir) }

// removeContents empties dir but keeps it (a container has it bind-mounted).
func removeContents(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

// Cluster is the chaos suite's view of a running cluster: the backend's nodes plus the
// HTTP and gRPC clients the nemesis and the checkers need.
type Cluster struct {
	B     Backend
	Nodes []*Node // every slot ever created, in index order; some may be stopped
	// Hooks reports whether the binary serves the fault hooks at /chaos/.
	Hooks bool

	http  *http.Client
	conns sync.Map // grpc address → *grpc.ClientConn
	// creds are the admin credentials of a secure cluster (nil: plaintext).
	creds *pkifiles.Local
}

// credentialed is a Backend whose agents run secure with these credentials.
type credentialed interface {
	Credentials() *pkifiles.Local
}

// NewCluster wraps the backend's slots.
func NewCluster(b Backend) *Cluster {
	c := &Cluster{B: b}
	if cb, ok := b.(credentialed); ok {
		c.creds = cb.Credentials()
	}
	hc, err := proccluster.HTTPClient(c.creds, 2*time.Second)
	if err != nil {
		// The credentials were just made by the backend; unreadable files are a broken setup.
		panic(fmt.Sprintf("chaos: credentials: %v", err))
	}
	c.http = hc
	for i := range b.Len() {
		c.Nodes = append(c.Nodes, &Node{NodeAddrs: b.Addrs(i), Index: i, b: b})
	}
	return c
}

// AddNode prepares one more node (not started).
func (c *Cluster) AddNode() (*Node, error) {
	i, err := c.B.Prepare()
	if err != nil {
		return nil, err
	}
	n := &Node{NodeAddrs: c.B.Addrs(i), Index: i, b: c.B}
	c.Nodes = append(c.Nodes, n)
	return n, nil
}

// Start (re)starts n from its data dir (nothing if it runs).
func (c *Cluster) Start(n *Node) error { return c.B.Start(n.Index) }

// Running returns the nodes whose process is alive.
func (c *Cluster) Running() []*Node {
	var out []*Node
	for _, n := range c.Nodes {
		if n.Running() {
			out = append(out, n)
		}
	}
	return out
}

// DebugState is an agent's /debug/state.
type DebugState = proccluster.State

// State reads n's /debug/state, with the state hash.
func (c *Cluster) State(ctx context.Context, n *Node) (DebugState, error) {
	var st DebugState
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, c.url(n, "/debug/state?hash=1"), nil)
	resp, err := c.http.Do(req)
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return st, fmt.Errorf("%s /debug/state: %s", n.ID, resp.Status)
	}
	return st, json.NewDecoder(resp.Body).Decode(&st)
}

// Leader waits until a running, unpaused node reports itself leader with limits applied.
func (c *Cluster) Leader(ctx context.Context, timeout time.Duration) (*Node, error) {
	deadline := time.Now().Add(timeout)
	for {
		for _, n := range c.Running() {
			if n.Paused() {
				continue
			}
			sctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
			st, err := c.State(sctx, n)
			cancel()
			if err == nil && st.IsLeader && st.LimitsVersion > 0 {
				return n, nil
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return nil, fmt.Errorf("chaos: no leader with limits within %v", timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Chaos posts to n's fault-hook API, e.g. Chaos(n, "partition", "block", "a,b").
func (c *Cluster) Chaos(n *Node, op string, kv ...string) error {
	q := make([]string, 0, len(kv)/2)
	for i := 0; i+1 < len(kv); i += 2 {
		q = append(q, kv[i]+"="+kv[i+1])
	}
	u := c.url(n, "/chaos/"+op)
	if len(q) > 0 {
		u += "?" + strings.Join(q, "&")
	}
	var lastErr error
	for range 5 { // a node that is just restarting may not listen yet
		resp, err := c.http.Post(u, "", nil)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			return fmt.Errorf("POST %s: %s: %s", u, resp.Status, bytes.TrimSpace(body))
		}
		lastErr = err
		time.Sleep(200 * time.Millisecond)
	}
	return lastErr
}

// FaultState reads n's fault-hook settings and counters (GET /chaos/).
func (c *Cluster) FaultState(n *Node) (faults.State, error) {
	var st faults.State
	resp, err := c.http.Get(c.url(n, "/chaos/"))
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return st, fmt.Errorf("%s GET /chaos/: %s", n.ID, resp.Status)
	}
	return st, json.NewDecoder(resp.Body).Decode(&st)
}

// probeHooks reports whether n serves the fault-hook API.
func (c *Cluster) probeHooks(n *Node) bool {
	resp, err := c.http.Get(c.url(n, "/chaos/"))
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// Conn returns a (cached) gRPC connection to addr.
func (c *Cluster) Conn(addr string) (*grpc.ClientConn, error) {
	if cc, ok := c.conns.Load(addr); ok {
		return cc.(*grpc.ClientConn), nil
	}
	opts, err := c.ClientConfig().DialCredentials()
	if err != nil {
		return nil, err
	}
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		return nil, err
	}
	if prev, loaded := c.conns.LoadOrStore(addr, cc); loaded {
		cc.Close()
		return prev.(*grpc.ClientConn), nil
	}
	return cc, nil
}

// ClientConfig returns a client configuration for addrs with the cluster's admin
// credentials.
func (c *Cluster) ClientConfig(addrs ...string) client.Config {
	return proccluster.ClientConfig(c.creds, addrs)
}

// url is path on n's HTTP endpoint.
func (c *Cluster) url(n *Node, path string) string { return proccluster.URL(c.creds, n.HTTP, path) }

// Members asks the running nodes for the membership until one answers.
func (c *Cluster) Members(ctx context.Context) (*quotadv1.MembersResponse, error) {
	var lastErr error = errors.New("no running node")
	for _, n := range c.Running() {
		if n.Paused() {
			continue
		}
		cc, err := c.Conn(n.GRPC)
		if err != nil {
			lastErr = err
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		resp, err := quotadv1.NewAdminClient(cc).Members(cctx, &quotadv1.MembersRequest{})
		cancel()
		if err == nil && resp.GetLeader() != nil {
			return resp, nil
		}
		lastErr = err
	}
	return nil, lastErr
}

// Voters returns the IDs of the voters in the Raft configuration as the leader sees it.
func (c *Cluster) Voters(ctx context.Context) ([]string, error) {
	m, err := c.Members(ctx)
	if err != nil {
		return nil, err
	}
	var v []string
	for _, mem := range m.GetMembers() {
		if mem.GetSuffrage() == "voter" {
			v = append(v, mem.GetId())
		}
	}
	slices.Sort(v)
	return v, nil
}

// SnapshotIndexes returns the indexes of the snapshots in n's data dir (raft names them
// term-index-millis).
func (n *Node) SnapshotIndexes() []uint64 {
	entries, _ := os.ReadDir(filepath.Join(n.DataDir, "snapshots"))
	var out []uint64
	for _, e := range entries {
		parts := strings.Split(e.Name(), "-")
		if len(parts) != 3 || strings.HasSuffix(e.Name(), ".tmp") {
			continue
		}
		if idx, err := strconv.ParseUint(parts[1], 10, 64); err == nil {
			out = append(out, idx)
		}
	}
	slices.Sort(out)
	return out
}

// Close stops every node and closes connections.
func (c *Cluster) Close() {
	c.B.Close()
	c.conns.Range(func(k, v any) bool { v.(*grpc.ClientConn).Close(); c.conns.Delete(k); return true })
}

// ---------------------------------------------------------------------------------------------
// Process backend.

// procBackend runs the agents as processes on loopback through internal/proccluster.
type procBackend struct {
	pc *proccluster.Cluster
}

// startProcesses starts nodes agents (bootstrapping together) of bin, with the limits file,
// data dirs under dir and logs in logDir.
func startProcesses(bin *proccluster.Binary, dir, logDir, limitsFile string, nodes int, extra []string) (*procBackend, error) {
	pc, err := proccluster.Start(proccluster.Config{
		Binary: bin.Path, Dir: dir, LogDir: logDir, Nodes: nodes, LimitsFile: limitsFile, ExtraArgs: extra,
	})
	if err != nil {
		return nil, err
	}
	return &procBackend{pc: pc}, nil
}

func (p *procBackend) Name() string { return "process" }
func (p *procBackend) Len() int     { return len(p.pc.Nodes) }
func (p *procBackend) Addrs(i int) NodeAddrs {
	n := p.pc.Nodes[i]
	return NodeAddrs{ID: n.ID, GRPC: n.GRPCAddr, Raft: n.RaftAddr, Gossip: n.GossipAddr, HTTP: n.HTTPAddr,
		DataDir: n.DataDir, LogPath: n.LogPath}
}
func (p *procBackend) Prepare() (int, error) { return p.pc.PrepareNode() }
func (p *procBackend) Start(i int) error     { return p.pc.Start(i) }
func (p *procBackend) Kill(i int) error      { p.pc.Kill(i); return nil }
func (p *procBackend) Stop(i int, grace time.Duration) error {
	p.pc.StopTimeout(i, grace)
	return nil
}
func (p *procBackend) Pause(i int) error  { return p.notRunning(i, p.pc.Pause) }
func (p *procBackend) Resume(i int) error { return p.notRunning(i, p.pc.Resume) }
func (p *procBackend) Running(i int) bool { return p.pc.Running(i) }
func (p *procBackend) Paused(i int) bool  { return p.pc.Paused(i) }
func (p *procBackend) Starts(i int) int   { return p.pc.Nodes[i].Starts() }
func (p *procBackend) Close()             { p.pc.StopAll(5 * time.Second) }

// Credentials are the admin credentials of the cluster (nil if insecure).
func (p *procBackend) Credentials() *pkifiles.Local { return p.pc.Credentials() }

func (p *procBackend) notRunning(i int, f func(int)) error {
	if !p.pc.Running(i) {
		return fmt.Errorf("chaos: node %s is not running", p.pc.Nodes[i].ID)
	}
	f(i)
	return nil
}
