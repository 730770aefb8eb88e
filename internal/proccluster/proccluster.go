// Package proccluster runs quotad clusters as separate operating-system processes, for tests
// that need real crashes (kill -9), pauses (SIGSTOP) and restarts from data directories: the
// end-to-end tests, the chaos suite and the benchmarks share it.
//
// It only starts, signals and watches processes of a quotad binary; it knows nothing about
// quota semantics.
package proccluster

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Build compiles ./cmd/quotad from the module at moduleDir into dir and returns the binary's
// path. tags are Go build tags (e.g. "chaos").
func Build(moduleDir, dir string, tags ...string) (string, error) {
	bin := filepath.Join(dir, "quotad")
	args := []string{"build", "-o", bin}
	if len(tags) > 0 {
		args = append(args, "-tags", strings.Join(tags, ","))
	}
	args = append(args, "./cmd/quotad")
	cmd := exec.Command("go", args...)
	cmd.Dir = moduleDir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return bin, nil
}

// Config describes a cluster to start.
type Config struct {
	// Binary is the quotad executable.
	Binary string
	// Dir holds each node's data dir and log file.
	Dir string
	// Nodes is the number of agents that bootstrap the cluster.
	Nodes int
	// LimitsFile is passed to every agent with --limits.
	LimitsFile string
	// ExtraArgs are appended to every agent's command line.
	ExtraArgs []string
	// Env is added to every agent's environment.
	Env []string
}

// Node is one agent process slot: its addresses and data survive restarts.
type Node struct {
	ID         string
	GRPCAddr   string
	RaftAddr   string
	GossipAddr string
	HTTPAddr   string
	DataDir    string
	LogPath    string

	mu      sync.Mutex
	cmd     *exec.Cmd
	exited  chan struct{}
	stopped bool // SIGSTOPped
}

// Cluster is a set of agent processes.
type Cluster struct {
	cfg   Config
	Nodes []*Node
}

// FreePorts reserves n distinct free TCP ports on 127.0.0.1 (also free for UDP is likely but
// not guaranteed; gossip retries on failure).
func FreePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// Start starts cfg.Nodes agents that bootstrap a cluster together. It does not wait for a
// leader; use WaitLeader.
func Start(cfg Config) (*Cluster, error) {
	c := &Cluster{cfg: cfg}
	for range cfg.Nodes {
		if _, err := c.newNode(); err != nil {
			c.KillAll()
			return nil, err
		}
	}
	for i := range c.Nodes {
		if err := c.Start(i); err != nil {
			c.KillAll()
			return nil, err
		}
	}
	return c, nil
}

func (c *Cluster) newNode() (*Node, error) {
	ports, err := FreePorts(4)
	if err != nil {
		return nil, err
	}
	id := fmt.Sprintf("node%d", len(c.Nodes)+1)
	a := func(p int) string { return fmt.Sprintf("127.0.0.1:%d", p) }
	n := &Node{
		ID: id, GRPCAddr: a(ports[0]), RaftAddr: a(ports[1]), GossipAddr: a(ports[2]), HTTPAddr: a(ports[3]),
		DataDir: filepath.Join(c.cfg.Dir, id), LogPath: filepath.Join(c.cfg.Dir, id+".log"),
	}
	c.Nodes = append(c.Nodes, n)
	return n, nil
}

// AddNode starts one more agent that joins the running cluster (no bootstrap) and returns
// its index.
func (c *Cluster) AddNode() (int, error) {
	if _, err := c.newNode(); err != nil {
		return -1, err
	}
	i := len(c.Nodes) - 1
	return i, c.startWith(i, 0)
}

// Start (re)starts node i from its data dir on its addresses.
func (c *Cluster) Start(i int) error { return c.startWith(i, c.cfg.Nodes) }

func (c *Cluster) startWith(i, bootstrapExpect int) error {
	n := c.Nodes[i]
	var join []string
	for j, o := range c.Nodes {
		if j != i {
			join = append(join, o.GossipAddr)
		}
	}
	args := []string{"agent", "--id", n.ID, "--data-dir", n.DataDir,
		"--grpc-addr", n.GRPCAddr, "--raft-addr", n.RaftAddr, "--gossip-addr", n.GossipAddr,
		"--http-addr", n.HTTPAddr, "--bootstrap-expect", fmt.Sprint(bootstrapExpect),
		"--join", strings.Join(join, ","), "--log-format", "json"}
	if c.cfg.LimitsFile != "" {
		args = append(args, "--limits", c.cfg.LimitsFile)
	}
	args = append(args, c.cfg.ExtraArgs...)
	logf, err := os.OpenFile(n.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(c.cfg.Binary, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), c.cfg.Env...)
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("starting %s: %w", n.ID, err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); logf.Close(); close(exited) }()
	n.mu.Lock()
	n.cmd, n.exited, n.stopped = cmd, exited, false
	n.mu.Unlock()
	return nil
}

// Running reports whether node i's process is alive.
func (c *Cluster) Running(i int) bool {
	n := c.Nodes[i]
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd == nil {
		return false
	}
	select {
	case <-n.exited:
		return false
	default:
		return true
	}
}

// Kill sends SIGKILL to node i and waits for it to exit.
func (c *Cluster) Kill(i int) { c.signalAndWait(i, syscall.SIGKILL, 0) }

// Stop sends SIGTERM (graceful: a leader hands over) and waits up to 15 s, then kills.
func (c *Cluster) Stop(i int) { c.signalAndWait(i, syscall.SIGTERM, 15*time.Second) }

func (c *Cluster) signalAndWait(i int, sig syscall.Signal, grace time.Duration) {
	n := c.Nodes[i]
	n.mu.Lock()
	cmd, exited, stopped := n.cmd, n.exited, n.stopped
	n.mu.Unlock()
	if cmd == nil {
		return
	}
	if stopped && sig != syscall.SIGKILL {
		_ = cmd.Process.Signal(syscall.SIGCONT)
	}
	_ = cmd.Process.Signal(sig)
	if grace > 0 {
		select {
		case <-exited:
			return
		case <-time.After(grace):
			_ = cmd.Process.Kill()
		}
	}
	<-exited
}

// Pause sends SIGSTOP to node i; Resume sends SIGCONT.
func (c *Cluster) Pause(i int) { c.signal(i, syscall.SIGSTOP, true) }

// Resume continues a paused node.
func (c *Cluster) Resume(i int) { c.signal(i, syscall.SIGCONT, false) }

func (c *Cluster) signal(i int, sig syscall.Signal, stopped bool) {
	n := c.Nodes[i]
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd != nil {
		_ = n.cmd.Process.Signal(sig)
		n.stopped = stopped
	}
}

// KillAll kills every node.
func (c *Cluster) KillAll() {
	for i := range c.Nodes {
		c.Kill(i)
	}
}

// GRPCAddrs returns every node's gRPC address.
func (c *Cluster) GRPCAddrs() []string {
	var out []string
	for _, n := range c.Nodes {
		out = append(out, n.GRPCAddr)
	}
	return out
}

// State is a node's /debug/state.
type State struct {
	ID            string `json:"id"`
	Leader        string `json:"leader"`
	IsLeader      bool   `json:"is_leader"`
	AppliedIndex  uint64 `json:"applied_index"`
	Hash          uint64 `json:"hash"`
	Clock         int64  `json:"clock"`
	LimitsVersion uint64 `json:"limits_version"`
}

var httpClient = &http.Client{Timeout: time.Second}

// State fetches node i's /debug/state.
func (c *Cluster) State(ctx context.Context, i int) (State, error) {
	var s State
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+c.Nodes[i].HTTPAddr+"/debug/state", nil)
	if err != nil {
		return s, err
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return s, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return s, fmt.Errorf("%s: /debug/state: %s", c.Nodes[i].ID, resp.Status)
	}
	return s, json.NewDecoder(resp.Body).Decode(&s)
}

// Leader returns the index of the running node that reports itself leader, or -1.
func (c *Cluster) Leader(ctx context.Context) int {
	for i := range c.Nodes {
		if !c.Running(i) {
			continue
		}
		if s, err := c.State(ctx, i); err == nil && s.IsLeader {
			return i
		}
	}
	return -1
}

// WaitLeader polls until a running node leads with limits applied (if a limits file was
// given), or the timeout passes.
func (c *Cluster) WaitLeader(timeout time.Duration) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for {
		if l := c.Leader(ctx); l >= 0 {
			if c.cfg.LimitsFile == "" {
				return l, nil
			}
			if s, err := c.State(ctx, l); err == nil && s.LimitsVersion > 0 {
				return l, nil
			}
		}
		select {
		case <-ctx.Done():
			return -1, errors.New("no leader within " + timeout.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// ScanLogs returns log lines of every node that contain any of the words (e.g. "panic").
func (c *Cluster) ScanLogs(words ...string) ([]string, error) {
	var hits []string
	for _, n := range c.Nodes {
		f, err := os.Open(n.LogPath)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		hits = append(hits, scan(f, n.ID, words)...)
		f.Close()
	}
	return hits, nil
}

func scan(r io.Reader, id string, words []string) []string {
	var hits []string
	s := bufio.NewScanner(r)
	s.Buffer(make([]byte, 64*1024), 4*1024*1024)
	for s.Scan() {
		line := s.Text()
		for _, w := range words {
			if strings.Contains(line, w) {
				hits = append(hits, id+": "+line)
				break
			}
		}
	}
	return hits
}
