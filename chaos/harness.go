package chaos

import (
	"bytes"
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
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// Binary is a built quotad executable.
type Binary struct {
	Path string
	Tags string
	// Hooks reports whether the binary serves the fault hooks at /chaos/ (checked on a live
	// node by Cluster.probeHooks); BuildNote says why a chaos-tagged build was not possible.
	BuildNote string
	// Flags are the agent flags the binary accepts (from `quotad agent --help`).
	Flags map[string]bool
}

// BuildBinary builds ./cmd/quotad of the module rooted at moduleDir into dir with the given
// build tags (CGO disabled, so the binary is static and fits a FROM-scratch image). If the
// tagged build fails and fallback is set, it builds without tags and says why in BuildNote.
func BuildBinary(moduleDir, dir, tags string, fallback bool) (*Binary, error) {
	out := filepath.Join(dir, "quotad")
	build := func(tags string) ([]byte, error) {
		args := []string{"build", "-o", out}
		if tags != "" {
			args = append(args, "-tags", tags)
		}
		args = append(args, "./cmd/quotad")
		cmd := exec.Command("go", args...)
		cmd.Dir = moduleDir
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		return cmd.CombinedOutput()
	}
	b := &Binary{Path: out, Tags: tags}
	if msg, err := build(tags); err != nil {
		if !fallback || tags == "" {
			return nil, fmt.Errorf("go build -tags %q ./cmd/quotad: %v\n%s", tags, err, msg)
		}
		b.BuildNote = fmt.Sprintf("-tags %s did not build (%s); using an untagged build without in-binary fault hooks",
			tags, firstLine(string(msg)))
		b.Tags = ""
		if msg, err := build(""); err != nil {
			return nil, fmt.Errorf("go build ./cmd/quotad: %v\n%s", err, msg)
		}
	}
	help, _ := exec.Command(out, "agent", "--help").CombinedOutput()
	b.Flags = map[string]bool{}
	for _, f := range strings.Fields(string(help)) {
		if strings.HasPrefix(f, "--") {
			b.Flags[strings.TrimPrefix(f, "--")] = true
		}
	}
	return b, nil
}

func firstLine(s string) string {
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			return l
		}
	}
	return strings.TrimSpace(s)
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
			return "", errors.New("chaos: go.mod not found above the working directory")
		}
		dir = parent
	}
}

// freePort returns a loopback port nothing listens on right now (TCP and UDP, for gossip).
func freePort() (int, error) {
	for range 50 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		u, err := net.ListenPacket("udp", fmt.Sprintf("127.0.0.1:%d", port))
		l.Close()
		if err == nil {
			u.Close()
			return port, nil
		}
	}
	return 0, errors.New("chaos: no free port with both TCP and UDP")
}

// Node is one agent process: its addresses, data dir and log, and whether it runs.
type Node struct {
	ID      string
	GRPC    string
	Raft    string
	Gossip  string
	HTTP    string
	DataDir string
	LogPath string

	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{}
	paused bool
	starts int
}

// Running reports whether the process is alive (it may be paused).
func (n *Node) Running() bool {
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

// Paused reports whether the process is stopped with SIGSTOP.
func (n *Node) Paused() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.paused && n.runningLocked()
}

// Cluster is a set of agent processes on loopback.
type Cluster struct {
	Bin    *Binary
	Dir    string // data dirs live here
	LogDir string
	Limits string // limits file path
	// ExtraFlags are added to every agent's command line.
	ExtraFlags []string
	Nodes      []*Node // every node ever created, in ID order; some may be stopped

	http  *http.Client
	conns sync.Map // grpc address → *grpc.ClientConn
	Hooks bool
}

// NewCluster prepares n nodes (not started) with free ports and their own data dirs.
func NewCluster(bin *Binary, dir, logDir, limitsYAML string, n int, extra []string) (*Cluster, error) {
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		return nil, err
	}
	c := &Cluster{Bin: bin, Dir: dir, LogDir: logDir, ExtraFlags: extra, http: &http.Client{Timeout: 2 * time.Second}}
	c.Limits = filepath.Join(dir, "limits.yaml")
	if err := os.WriteFile(c.Limits, []byte(limitsYAML), 0o644); err != nil {
		return nil, err
	}
	for range n {
		if _, err := c.AddNode(); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// AddNode prepares one more node (not started).
func (c *Cluster) AddNode() (*Node, error) {
	id := fmt.Sprintf("n%d", len(c.Nodes)+1)
	var ports [4]int
	for i := range ports {
		p, err := freePort()
		if err != nil {
			return nil, err
		}
		ports[i] = p
	}
	addr := func(p int) string { return "127.0.0.1:" + strconv.Itoa(p) }
	n := &Node{
		ID: id, GRPC: addr(ports[0]), Raft: addr(ports[1]), Gossip: addr(ports[2]), HTTP: addr(ports[3]),
		DataDir: filepath.Join(c.Dir, id), LogPath: filepath.Join(c.LogDir, id+".log"),
	}
	c.Nodes = append(c.Nodes, n)
	return n, nil
}

// Start starts n's process. bootstrap is --bootstrap-expect (0 to join an existing cluster).
func (c *Cluster) Start(n *Node, bootstrap int) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.runningLocked() {
		return nil
	}
	var join []string
	for _, o := range c.Nodes {
		if o != n {
			join = append(join, o.Gossip)
		}
	}
	args := []string{"agent", "--id", n.ID, "--data-dir", n.DataDir,
		"--grpc-addr", n.GRPC, "--raft-addr", n.Raft, "--gossip-addr", n.Gossip, "--http-addr", n.HTTP,
		"--join", strings.Join(join, ","), "--limits", c.Limits}
	if bootstrap > 0 {
		args = append(args, "--bootstrap-expect", strconv.Itoa(bootstrap))
	}
	args = append(args, c.ExtraFlags...)
	logf, err := os.OpenFile(n.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	n.starts++
	fmt.Fprintf(logf, "=== chaos: start #%d at %s: %s %s\n", n.starts, time.Now().Format(time.RFC3339Nano), c.Bin.Path, strings.Join(args, " "))
	cmd := exec.Command(c.Bin.Path, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return err
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		fmt.Fprintf(logf, "=== chaos: exited at %s: %v\n", time.Now().Format(time.RFC3339Nano), cmd.ProcessState)
		logf.Close()
		close(exited)
	}()
	n.cmd, n.exited, n.paused = cmd, exited, false
	return nil
}

func (n *Node) signal(sig syscall.Signal) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.runningLocked() {
		return fmt.Errorf("chaos: node %s is not running", n.ID)
	}
	switch sig {
	case syscall.SIGSTOP:
		n.paused = true
	case syscall.SIGCONT:
		n.paused = false
	}
	return n.cmd.Process.Signal(sig)
}

// Kill sends SIGKILL (continuing a paused process first is unnecessary) and waits for exit.
func (n *Node) Kill() error {
	if err := n.signal(syscall.SIGKILL); err != nil {
		return err
	}
	<-n.exited
	return nil
}

// Stop sends SIGTERM and waits up to timeout, then kills.
func (n *Node) Stop(timeout time.Duration) error {
	if n.Paused() {
		_ = n.signal(syscall.SIGCONT)
	}
	if err := n.signal(syscall.SIGTERM); err != nil {
		return nil
	}
	select {
	case <-n.exited:
		return nil
	case <-time.After(timeout):
		return n.Kill()
	}
}

// Pause sends SIGSTOP; Resume sends SIGCONT.
func (n *Node) Pause() error  { return n.signal(syscall.SIGSTOP) }
func (n *Node) Resume() error { return n.signal(syscall.SIGCONT) }

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
type DebugState struct {
	ID            string `json:"id"`
	Leader        string `json:"leader"`
	IsLeader      bool   `json:"is_leader"`
	AppliedIndex  uint64 `json:"applied_index"`
	Hash          uint64 `json:"hash"`
	Clock         int64  `json:"clock"`
	LimitsVersion uint64 `json:"limits_version"`
}

// State reads n's /debug/state.
func (c *Cluster) State(ctx context.Context, n *Node) (DebugState, error) {
	var st DebugState
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+n.HTTP+"/debug/state", nil)
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
	u := "http://" + n.HTTP + "/chaos/" + op
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

// probeHooks reports whether n serves the fault-hook API.
func (c *Cluster) probeHooks(n *Node) bool {
	resp, err := c.http.Get("http://" + n.HTTP + "/chaos/")
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
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	if prev, loaded := c.conns.LoadOrStore(addr, cc); loaded {
		cc.Close()
		return prev.(*grpc.ClientConn), nil
	}
	return cc, nil
}

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

// Close stops every node (SIGTERM, then SIGKILL) and closes connections.
func (c *Cluster) Close() {
	var wg sync.WaitGroup
	for _, n := range c.Nodes {
		wg.Go(func() { _ = n.Stop(5 * time.Second) })
	}
	wg.Wait()
	c.conns.Range(func(_, v any) bool { v.(*grpc.ClientConn).Close(); return true })
}
