// Package proccluster runs quotad clusters as separate operating-system processes, for tests
// that need real crashes (kill -9), pauses (SIGSTOP) and restarts from data directories: the
// end-to-end tests, the chaos suite and the benchmarks share it.
//
// It only starts, signals and watches processes of a quotad binary; it knows nothing about
// quota semantics.
package proccluster

import (
	"bufio"
	"cmp"
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
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"

	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/internal/testports"
)

// Build compiles ./cmd/quotad from the module at moduleDir into dir and returns the binary's
// path. tags are Go build tags (e.g. "chaos"). CGO is disabled, so the binary is static (it
// runs in a FROM-scratch container image too).
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

// Binary is a built quotad executable and what it was built with.
type Binary struct {
	Path string
	// Tags are the build tags actually used (empty after a fallback).
	Tags []string
	// Note says why the tagged build was not possible, after a fallback to an untagged one.
	Note string
	// Flags are the agent flags the binary accepts (from `quotad agent --help`, without "--").
	Flags map[string]bool
}

// BuildBinary is Build that also reads the binary's agent flags. If the tagged build fails
// and fallback is set, it builds without tags and says why in Note.
func BuildBinary(moduleDir, dir string, tags []string, fallback bool) (*Binary, error) {
	b := &Binary{Tags: tags}
	path, err := Build(moduleDir, dir, tags...)
	if err != nil {
		if !fallback || len(tags) == 0 {
			return nil, err
		}
		b.Note = fmt.Sprintf("-tags %s did not build (%s); using an untagged build",
			strings.Join(tags, ","), firstErrorLine(err.Error()))
		b.Tags = nil
		if path, err = Build(moduleDir, dir); err != nil {
			return nil, err
		}
	}
	b.Path = path
	b.Flags = AgentFlags(path)
	return b, nil
}

// AgentFlags returns the flags `binary agent --help` lists (names without "--").
func AgentFlags(binary string) map[string]bool {
	help, _ := exec.Command(binary, "agent", "--help").CombinedOutput()
	flags := map[string]bool{}
	for _, f := range strings.Fields(string(help)) {
		if strings.HasPrefix(f, "--") && len(f) > 2 {
			flags[strings.TrimRight(strings.TrimPrefix(f, "--"), ",=")] = true
		}
	}
	return flags
}

func firstErrorLine(s string) string {
	lines := strings.Split(s, "\n")
	for _, l := range lines[1:] { // lines[0] is the go command line
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			return l
		}
	}
	return strings.TrimSpace(lines[0])
}

// ModuleRoot returns the directory holding go.mod, searching up from the working directory.
func ModuleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("proccluster: go.mod not found above the working directory")
		}
		dir = parent
	}
}

// Config describes a cluster to start.
type Config struct {
	// Binary is the quotad executable.
	Binary string
	// NodeBinary, if set and not "", is the executable of one node at its next (re)start
	// (a rolling upgrade moves nodes to a new binary one at a time).
	NodeBinary func(n *Node) string
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
	// NodeArgs, if set, returns more arguments for one node (after ExtraArgs); NodeEnv more
	// environment. They are called at every (re)start.
	NodeArgs func(n *Node) []string
	NodeEnv  func(n *Node) []string
	// LogDir receives every node's log file, <id>.log (default Dir). Logs are appended across
	// restarts, each start and exit marked by a "=== proccluster:" line.
	LogDir string
	// LogFormat is the agents' --log-format (default "json").
	LogFormat string
	// Insecure starts the agents with --insecure (plaintext, no credentials). By default they
	// run secure: TLS with a throwaway CA, an encrypted gossip, a bootstrap admin token
	// (Credentials). Either way they serve the debug endpoints (--enable-debug) the harness
	// polls.
	Insecure bool
	// Credentials of a secure cluster; nil: made once in Dir/credentials by Start.
	Credentials *pkifiles.Local
	// HTTPCredentials, if set, are what the harness's own HTTP client (State, Leader,
	// HTTPClient) uses instead of Credentials: its CAFile may be a bundle (every certificate
	// in it is trusted) and an empty AdminCertFile/AdminKeyFile leaves the bearer token alone.
	// During a CA rotation: the old+new CA bundle and the token, so the harness follows nodes
	// that serve new-CA certificates and keeps working once the old CA is dropped.
	HTTPCredentials *pkifiles.Local
}

// ClusterName is the cluster name of the credentials Start makes.
const ClusterName = "quotad"

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
	starts  int
}

// Starts returns how many times the node's process was started.
func (n *Node) Starts() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.starts
}

// Cluster is a set of agent processes.
type Cluster struct {
	cfg   Config
	Nodes []*Node
	http  *http.Client
}

// FreePorts returns n distinct ports on 127.0.0.1 that are free for both TCP and UDP right now
// (gossip needs both), never returned before by this process, outside the kernel's ephemeral
// range and locked against this module's other test processes (testports.Reserve): the agents
// bind them later, and a restarted agent binds them again.
func FreePorts(n int) ([]int, error) { return testports.Reserve(n) }

// Start starts cfg.Nodes agents that bootstrap a cluster together. It does not wait for a
// leader; use WaitLeader.
func Start(cfg Config) (*Cluster, error) {
	if !cfg.Insecure && cfg.Credentials == nil {
		creds, err := pkifiles.EnsureLocal(filepath.Join(cfg.Dir, "credentials"), ClusterName)
		if err != nil {
			return nil, fmt.Errorf("proccluster: credentials: %w", err)
		}
		cfg.Credentials = creds
	}
	if cfg.Insecure {
		cfg.Credentials = nil
	}
	httpCreds := cfg.Credentials
	if cfg.HTTPCredentials != nil && cfg.Credentials != nil {
		httpCreds = cfg.HTTPCredentials
	}
	hc, err := HTTPClient(httpCreds, time.Second)
	if err != nil {
		return nil, err
	}
	c := &Cluster{cfg: cfg, http: hc}
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
	logDir := c.cfg.LogDir
	if logDir == "" {
		logDir = c.cfg.Dir
	}
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		return nil, err
	}
	n := &Node{
		ID: id, GRPCAddr: a(ports[0]), RaftAddr: a(ports[1]), GossipAddr: a(ports[2]), HTTPAddr: a(ports[3]),
		DataDir: filepath.Join(c.cfg.Dir, id), LogPath: filepath.Join(logDir, id+".log"),
	}
	c.Nodes = append(c.Nodes, n)
	return n, nil
}

// AddNode starts one more agent that joins the running cluster (no bootstrap) and returns
// its index.
func (c *Cluster) AddNode() (int, error) {
	i, err := c.PrepareNode()
	if err != nil {
		return -1, err
	}
	return i, c.Start(i)
}

// PrepareNode adds a slot for one more agent (addresses, data dir, log) without starting it;
// Start(i) starts it, joining the running cluster.
func (c *Cluster) PrepareNode() (int, error) {
	if _, err := c.newNode(); err != nil {
		return -1, err
	}
	return len(c.Nodes) - 1, nil
}

// Start (re)starts node i from its data dir on its addresses; it does nothing if node i is
// running. The first cfg.Nodes nodes are started with --bootstrap-expect cfg.Nodes (it only
// matters on an empty data dir), added ones with 0: they join.
func (c *Cluster) Start(i int) error {
	if i < c.cfg.Nodes {
		return c.startWith(i, c.cfg.Nodes)
	}
	return c.startWith(i, 0)
}

func (c *Cluster) startWith(i, bootstrapExpect int) error {
	if c.Running(i) {
		return nil
	}
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
		"--join", strings.Join(join, ","), "--log-format", cmp.Or(c.cfg.LogFormat, "json")}
	if c.cfg.LimitsFile != "" {
		args = append(args, "--limits", c.cfg.LimitsFile)
	}
	args = append(args, "--enable-debug")
	if c.cfg.Credentials == nil {
		args = append(args, "--insecure")
	} else {
		sec, err := c.cfg.Credentials.AgentArgs(n.ID)
		if err != nil {
			return err
		}
		args = append(args, sec...)
	}
	args = OverrideArgs(args, c.cfg.ExtraArgs)
	env := append(os.Environ(), c.cfg.Env...)
	if c.cfg.NodeArgs != nil {
		args = OverrideArgs(args, c.cfg.NodeArgs(n))
	}
	if c.cfg.NodeEnv != nil {
		env = append(env, c.cfg.NodeEnv(n)...)
	}
	if err := waitBindable(n, 10*time.Second); err != nil {
		return fmt.Errorf("starting %s: %w", n.ID, err)
	}
	logf, err := os.OpenFile(n.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	bin := c.cfg.Binary
	if c.cfg.NodeBinary != nil {
		bin = cmp.Or(c.cfg.NodeBinary(n), bin)
	}
	n.mu.Lock()
	n.starts++
	fmt.Fprintf(logf, "=== proccluster: start #%d at %s: %s %s\n", n.starts, time.Now().Format(time.RFC3339Nano),
		bin, strings.Join(args, " "))
	n.mu.Unlock()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = env
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("starting %s: %w", n.ID, err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		fmt.Fprintf(logf, "=== proccluster: exited at %s: %v\n", time.Now().Format(time.RFC3339Nano), cmd.ProcessState)
		logf.Close()
		close(exited)
	}()
	n.mu.Lock()
	n.cmd, n.exited, n.stopped = cmd, exited, false
	n.mu.Unlock()
	return nil
}

// waitBindable waits until node n's addresses can be bound (TCP; UDP too for gossip), retrying
// while one is in use: the agent would exit with "address already in use" (a restart right
// after a kill whose sockets the kernel has not released yet, or a port some other program
// took — the ports are reserved against this module's tests, not against everything).
func waitBindable(n *Node, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		err := bindable(n)
		if err == nil || !testports.InUse(err) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func bindable(n *Node) error {
	for _, a := range []string{n.GRPCAddr, n.RaftAddr, n.GossipAddr, n.HTTPAddr} {
		if a == "" {
			continue
		}
		l, err := net.Listen("tcp", a)
		if err != nil {
			return err
		}
		l.Close()
	}
	if n.GossipAddr != "" {
		u, err := net.ListenPacket("udp", n.GossipAddr)
		if err != nil {
			return err
		}
		u.Close()
	}
	return nil
}

// Pid returns node i's process ID (0 if it never started).
func (c *Cluster) Pid(i int) int {
	n := c.Nodes[i]
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd == nil || n.cmd.Process == nil {
		return 0
	}
	return n.cmd.Process.Pid
}

// Paused reports whether node i is alive and stopped by Pause.
func (c *Cluster) Paused(i int) bool {
	n := c.Nodes[i]
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.stopped && n.runningLocked()
}

// Running reports whether node i's process is alive.
func (c *Cluster) Running(i int) bool {
	n := c.Nodes[i]
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.runningLocked()
}

func (n *Node) runningLocked() bool {
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

// StopTimeout is Stop with a grace period of d before the SIGKILL.
func (c *Cluster) StopTimeout(i int, d time.Duration) { c.signalAndWait(i, syscall.SIGTERM, d) }

// StopAll stops every node at once, each with a grace period of d.
func (c *Cluster) StopAll(d time.Duration) {
	var wg sync.WaitGroup
	for i := range c.Nodes {
		wg.Go(func() { c.StopTimeout(i, d) })
	}
	wg.Wait()
}

func (c *Cluster) signalAndWait(i int, sig syscall.Signal, grace time.Duration) {
	n := c.Nodes[i]
	n.mu.Lock()
	cmd, exited, stopped := n.cmd, n.exited, n.stopped
	n.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(sig)
	if stopped && sig != syscall.SIGKILL {
		// A stopped process keeps a pending SIGTERM until it continues.
		_ = cmd.Process.Signal(syscall.SIGCONT)
	}
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
	if n.runningLocked() {
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

// State fetches node i's /debug/state.
func (c *Cluster) State(ctx context.Context, i int) (State, error) {
	var s State
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.URL(i, "/debug/state"), nil)
	if err != nil {
		return s, err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return s, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return s, fmt.Errorf("%s: /debug/state: %s", c.Nodes[i].ID, resp.Status)
	}
	return s, json.NewDecoder(resp.Body).Decode(&s)
}

// Leader returns the index of the running (not paused) node that reports itself leader, or
// -1.
func (c *Cluster) Leader(ctx context.Context) int {
	for i := range c.Nodes {
		if !c.Running(i) || c.Paused(i) {
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
	return c.WaitLeaderCtx(context.Background(), timeout)
}

// WaitLeaderCtx is WaitLeader that also gives up when ctx ends.
func (c *Cluster) WaitLeaderCtx(ctx context.Context, timeout time.Duration) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
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

// Credentials returns the credentials of a secure cluster (nil if Insecure).
func (c *Cluster) Credentials() *pkifiles.Local { return c.cfg.Credentials }

// ClientConfig returns a client configuration for every node, with the admin credentials of
// a secure cluster.
func (c *Cluster) ClientConfig() client.Config { return ClientConfig(c.cfg.Credentials, c.GRPCAddrs()) }

// DialOptions returns the gRPC dial options with the admin credentials (for raw API clients).
func (c *Cluster) DialOptions() ([]grpc.DialOption, error) { return c.ClientConfig().DialCredentials() }

// ClientEnv returns the environment that gives the quotad CLI the admin credentials.
func (c *Cluster) ClientEnv() []string { return ClientEnv(c.cfg.Credentials) }

// HTTPClient returns an HTTP client for the nodes' HTTP endpoints with the admin credentials.
func (c *Cluster) HTTPClient() *http.Client { return c.http }

// URL returns the URL of path on node i's HTTP endpoint (https on a secure cluster).
func (c *Cluster) URL(i int, path string) string {
	return URL(c.cfg.Credentials, c.Nodes[i].HTTPAddr, path)
}

// ClientConfig returns a client configuration for addrs with creds' admin certificate and
// bootstrap token (plaintext if creds is nil). Node certificates are verified by their
// server SAN, so any address works.
func ClientConfig(creds *pkifiles.Local, addrs []string) client.Config {
	cfg := client.DefaultConfig(addrs...)
	if creds != nil {
		cfg.TLSFiles = client.TLSFiles{CAFile: creds.CAFile, CertFile: creds.AdminCertFile, KeyFile: creds.AdminKeyFile,
			ServerName: auth.ServerName(creds.Cluster)}
		cfg.Token = creds.Token
	}
	return cfg
}

// ClientEnv returns the QUOTAD_* variables that give the quotad CLI creds' admin certificate
// and token (nil if creds is nil).
func ClientEnv(creds *pkifiles.Local) []string {
	if creds == nil {
		return nil
	}
	return []string{client.EnvCACert + "=" + creds.CAFile, client.EnvClientCert + "=" + creds.AdminCertFile,
		client.EnvClientKey + "=" + creds.AdminKeyFile, client.EnvToken + "=" + creds.Token}
}

// HTTPClient returns an HTTP client that presents creds' admin certificate and bearer token
// (a plain client if creds is nil). It trusts every CA certificate in creds.CAFile (a bundle
// during a CA rotation).
func HTTPClient(creds *pkifiles.Local, timeout time.Duration) (*http.Client, error) {
	if creds == nil {
		return &http.Client{Timeout: timeout}, nil
	}
	tlsCfg, err := ClientConfig(creds, nil).TLSConfig()
	if err != nil {
		return nil, err
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = tlsCfg
	return &http.Client{Timeout: timeout, Transport: bearer{tr, creds.Token}}, nil
}

// URL returns the URL of path at an HTTP address of a cluster with creds.
func URL(creds *pkifiles.Local, addr, path string) string {
	if creds == nil {
		return "http://" + addr + path
	}
	return "https://" + addr + path
}

type bearer struct {
	http.RoundTripper
	token string
}

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return b.RoundTripper.RoundTrip(r)
}

// OverrideArgs appends more to args; a flag given again (in more, or twice within more)
// replaces the earlier one with the values after it: the agent refuses a flag given twice,
// and ExtraArgs and NodeArgs replace what the cluster sets (e.g. a node's --tls-cert during a
// CA rotation), as a harness's own defaults in ExtraArgs are replaced by the same flag a user
// adds after them (chaos's --min-voters and QUOTAD_CHAOS_AGENT_ARGS, bench's -agent-args and
// --raft-log-store). The agent has no flag that takes a list, so no flag may repeat.
func OverrideArgs(args, more []string) []string {
	name := func(a string) string {
		if !strings.HasPrefix(a, "--") {
			return ""
		}
		n, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		return n
	}
	all := append(slices.Clone(args), more...)
	last := map[string]int{} // flag name: the index of its last occurrence
	for i, a := range all {
		if n := name(a); n != "" {
			last[n] = i
		}
	}
	out := make([]string, 0, len(all))
	drop := false
	for i, a := range all {
		if n := name(a); n != "" {
			drop = last[n] != i
		} else if i == 0 {
			drop = false // the subcommand
		}
		if !drop {
			out = append(out, a)
		}
	}
	return out
}
