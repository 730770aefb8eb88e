package chaos

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/internal/proccluster"
)

// The Docker variant: one container per node from an image FROM scratch holding the static
// binary, on a private bridge network with fixed addresses. Kill is `docker kill` + `docker
// start` (the container's data dir is a bind mount, so it restarts from its data), pause is
// `docker pause`, and partitions that cut nodes off (leader isolated, majority/minority, the
// follower held back for a snapshot) are `docker network disconnect`/`connect`. A ring/bridge
// partition (A sees B and C, B and C do not see each other) cannot be expressed by detaching
// containers from one network, and clock and disk faults live inside the process, so those
// still go through the chaos build's /chaos/ hooks.

// dockerLabel marks every resource the suite creates, so a run can remove what a killed
// earlier run left behind.
const dockerLabel = "io.quotad.chaos"

// Container ports; every node has its own address, so they are the same everywhere.
const (
	dockerGRPCPort   = 7000
	dockerRaftPort   = 7201
	dockerGossipPort = 7301
	dockerHTTPPort   = 8080
)

// DockerAvailable reports whether the docker CLI can reach a daemon, and if not why.
func DockerAvailable() (bool, string) {
	if _, err := exec.LookPath("docker"); err != nil {
		return false, "no docker CLI in PATH"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "docker", "version", "--format", "{{.Server.Version}}").CombinedOutput()
	if err != nil {
		return false, fmt.Sprintf("docker daemon unreachable: %v: %s", err, firstLine(string(out)))
	}
	return true, ""
}

// CleanupDocker removes containers, networks and images created by this process or by a
// process that is gone (e.g. a test binary killed by its timeout): every resource is labelled
// dockerLabel=<pid of the test process>, so a concurrent run is left alone.
func CleanupDocker() {
	stale := func(id, pid string) bool {
		p, err := strconv.Atoi(strings.TrimSpace(pid))
		if err != nil || p <= 0 {
			return true
		}
		return p == os.Getpid() || syscall.Kill(p, 0) == errNoProcess
	}
	pick := func(lines []string) []string {
		var ids []string
		for _, l := range lines {
			id, pid, _ := strings.Cut(l, " ")
			if id != "" && stale(id, pid) {
				ids = append(ids, id)
			}
		}
		return ids
	}
	label := `{{.ID}} {{.Label "` + dockerLabel + `"}}`
	if ids := pick(dockerRows("ps", "-a", "--filter", "label="+dockerLabel, "--format", label)); len(ids) > 0 {
		_, _ = docker(append([]string{"rm", "-f"}, ids...)...)
	}
	if ids := pick(dockerRows("network", "ls", "--filter", "label="+dockerLabel, "--format", label)); len(ids) > 0 {
		_, _ = docker(append([]string{"network", "rm"}, ids...)...)
	}
	var images []string
	for _, id := range dockerRows("images", "-q", "--filter", "label="+dockerLabel) {
		pid, _ := docker("image", "inspect", "-f", `{{index .Config.Labels "`+dockerLabel+`"}}`, id)
		images = append(images, id+" "+pid)
	}
	if ids := pick(images); len(ids) > 0 {
		_, _ = docker(append([]string{"rmi", "-f"}, ids...)...)
	}
}

var errNoProcess = syscall.ESRCH

func dockerRows(args ...string) []string {
	out, err := docker(args...)
	if err != nil || out == "" {
		return nil
	}
	return strings.Split(out, "\n")
}

func docker(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, "docker", args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	s := strings.TrimSpace(out.String())
	if err != nil {
		return s, fmt.Errorf("docker %s: %v: %s", strings.Join(args, " "), err, s)
	}
	return s, nil
}

func firstLine(s string) string {
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			return l
		}
	}
	return ""
}

type container struct {
	name string
	ip   string
	addr NodeAddrs

	mu       sync.Mutex
	gen      int           // start generation
	exited   chan struct{} // closed when the current run ends; nil before the first start
	paused   bool
	detached bool
	starts   int
}

// dockerBackend runs one container per node.
type dockerBackend struct {
	run     string // unique suffix of every resource name
	image   string
	network string
	subnet  string // "10.x.y." prefix
	dir     string
	logDir  string
	limits  string
	nodes   int // bootstrap-expect
	extra   []string
	user    string
	log     func(string, ...any)
	// creds: every container runs secure with them, mounted at /credentials.
	creds *pkifiles.Local

	mu     sync.Mutex
	cs     []*container
	closed bool
}

// startContainers builds the image, creates the network and starts nodes containers that
// bootstrap a cluster together. On error everything created so far is removed.
func startContainers(ctx context.Context, bin *proccluster.Binary, dir, logDir, limitsFile string, nodes int,
	extra []string, logf func(string, ...any)) (_ *dockerBackend, err error) {
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	d := &dockerBackend{run: hex.EncodeToString(rnd[:]), dir: dir, logDir: logDir, limits: limitsFile, nodes: nodes,
		extra: extra, user: fmt.Sprintf("%d:%d", os.Getuid(), os.Getgid()), log: logf}
	defer func() {
		if err != nil {
			d.Close()
		}
	}()
	if d.creds, err = pkifiles.EnsureLocal(filepath.Join(dir, "credentials"), proccluster.ClusterName); err != nil {
		return nil, err
	}
	if err := d.buildImage(bin.Path); err != nil {
		return nil, err
	}
	if err := d.createNetwork(); err != nil {
		return nil, err
	}
	for range nodes {
		if _, err := d.Prepare(); err != nil {
			return nil, err
		}
	}
	for i := range nodes {
		if err := d.Start(i); err != nil {
			return nil, err
		}
	}
	logf("chaos: docker image %s, network %s (%s0/24), %d containers", d.image, d.network, d.subnet, nodes)
	return d, ctx.Err()
}

func (d *dockerBackend) buildImage(binary string) error {
	ctxDir, err := os.MkdirTemp("", "quotad-chaos-image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(ctxDir)
	b, err := os.ReadFile(binary)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(ctxDir, "quotad"), b, 0o755); err != nil {
		return err
	}
	dockerfile := "FROM scratch\nCOPY quotad /quotad\nENTRYPOINT [\"/quotad\"]\n"
	if err := os.WriteFile(filepath.Join(ctxDir, "Dockerfile"), []byte(dockerfile), 0o644); err != nil {
		return err
	}
	d.image = "quotad-chaos:" + d.run
	_, err = docker("build", "-q", "--label", dockerLabel+"="+d.pidLabel(), "-t", d.image, ctxDir)
	return err
}

// createNetwork creates a private bridge network on a free 10.x.y.0/24.
func (d *dockerBackend) createNetwork() error {
	name := "quotad-chaos-" + d.run
	var lastErr error
	for range 20 {
		var r [2]byte
		_, _ = rand.Read(r[:])
		prefix := fmt.Sprintf("10.%d.%d.", 100+int(r[0])%100, r[1])
		_, err := docker("network", "create", "--driver", "bridge", "--label", dockerLabel+"="+d.pidLabel(),
			"--subnet", prefix+"0/24", "--gateway", prefix+"1", name)
		if err == nil {
			d.network, d.subnet = name, prefix
			return nil
		}
		lastErr = err
		if !strings.Contains(err.Error(), "overlap") {
			return err
		}
	}
	return lastErr
}

func (d *dockerBackend) Name() string { return "docker" }

// Credentials are the admin credentials of the containers' cluster.
func (d *dockerBackend) Credentials() *pkifiles.Local { return d.creds }

func (d *dockerBackend) pidLabel() string { return strconv.Itoa(os.Getpid()) }

func (d *dockerBackend) Len() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.cs)
}

func (d *dockerBackend) c(i int) *container {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.cs[i]
}

func (d *dockerBackend) Addrs(i int) NodeAddrs { return d.c(i).addr }

// Prepare creates slot i's container (not started): fixed IP, data dir bind-mounted.
func (d *dockerBackend) Prepare() (int, error) {
	d.mu.Lock()
	i := len(d.cs)
	d.mu.Unlock()
	id := fmt.Sprintf("node%d", i+1)
	ip := fmt.Sprintf("%s%d", d.subnet, 11+i)
	a := func(p int) string { return fmt.Sprintf("%s:%d", ip, p) }
	c := &container{name: "quotad-chaos-" + d.run + "-" + id, ip: ip, addr: NodeAddrs{
		ID: id, GRPC: a(dockerGRPCPort), Raft: a(dockerRaftPort), Gossip: a(dockerGossipPort), HTTP: a(dockerHTTPPort),
		DataDir: filepath.Join(d.dir, id),
	}}
	if err := os.MkdirAll(c.addr.DataDir, 0o755); err != nil {
		return -1, err
	}
	bootstrap := 0
	if i < d.nodes {
		bootstrap = d.nodes
	}
	var join []string
	for j := range max(d.nodes, i+1) {
		if j != i {
			join = append(join, fmt.Sprintf("%s%d:%d", d.subnet, 11+j, dockerGossipPort))
		}
	}
	args := []string{"create", "--name", c.name, "--label", dockerLabel + "=" + d.pidLabel(), "--network", d.network, "--ip", ip,
		"--user", d.user, "-v", c.addr.DataDir + ":/data", "-v", d.limits + ":/limits.yaml:ro",
		d.image, "agent", "--id", id, "--data-dir", "/data", "--limits", "/limits.yaml",
		"--grpc-addr", c.addr.GRPC, "--raft-addr", c.addr.Raft, "--gossip-addr", c.addr.Gossip, "--http-addr", c.addr.HTTP,
		"--bootstrap-expect", fmt.Sprint(bootstrap), "--join", strings.Join(join, ","), "--log-format", "json"}
	sec, err := d.creds.AgentArgs(id, ip)
	if err != nil {
		return -1, err
	}
	for j, a := range sec {
		if rel, ok := strings.CutPrefix(a, d.creds.Dir+string(filepath.Separator)); ok {
			sec[j] = "/credentials/" + rel
		}
	}
	args = slices.Insert(args, slices.Index(args, d.image), "-v", d.creds.Dir+":/credentials:ro")
	// The agent refuses a flag given twice: a flag of extra (QUOTAD_CHAOS_AGENT_ARGS) replaces
	// the one set here, as with processes (proccluster.OverrideArgs).
	img := slices.Index(args, d.image)
	args = append(args[:img+1:img+1], proccluster.OverrideArgs(args[img+1:], append(append([]string{"--enable-debug"}, sec...), d.extra...))...)
	if _, err := docker(args...); err != nil {
		return -1, err
	}
	d.mu.Lock()
	d.cs = append(d.cs, c)
	d.mu.Unlock()
	return i, nil
}

func (d *dockerBackend) Start(i int) error {
	c := d.c(i)
	if d.Running(i) {
		return nil
	}
	if _, err := docker("start", c.name); err != nil {
		return err
	}
	c.mu.Lock()
	c.gen++
	c.starts++
	gen, exited := c.gen, make(chan struct{})
	c.exited, c.paused = exited, false
	c.mu.Unlock()
	go func() {
		// `docker wait` returns when the container stops; if it attached late (after a newer
		// start) the newer generation has its own waiter.
		_, _ = docker("wait", c.name)
		for {
			c.mu.Lock()
			stale := c.gen != gen
			c.mu.Unlock()
			if stale || !containerRunning(c.name) {
				break
			}
			_, _ = docker("wait", c.name)
		}
		close(exited)
	}()
	return nil
}

func containerRunning(name string) bool {
	out, err := docker("inspect", "-f", "{{.State.Running}}", name)
	return err == nil && out == "true"
}

func (d *dockerBackend) Running(i int) bool {
	c := d.c(i)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.exited == nil {
		return false
	}
	select {
	case <-c.exited:
		return false
	default:
		return true
	}
}

func (d *dockerBackend) Paused(i int) bool {
	c := d.c(i)
	c.mu.Lock()
	p := c.paused
	c.mu.Unlock()
	return p && d.Running(i)
}

func (d *dockerBackend) Starts(i int) int {
	c := d.c(i)
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.starts
}

func (d *dockerBackend) waitExit(i int, timeout time.Duration) error {
	c := d.c(i)
	c.mu.Lock()
	exited := c.exited
	c.mu.Unlock()
	if exited == nil {
		return nil
	}
	select {
	case <-exited:
		return nil
	case <-time.After(timeout):
		return fmt.Errorf("chaos: container %s did not exit within %v", c.name, timeout)
	}
}

func (d *dockerBackend) Kill(i int) error {
	if !d.Running(i) {
		return nil
	}
	c := d.c(i)
	if d.Paused(i) {
		_ = d.Resume(i)
	}
	if _, err := docker("kill", c.name); err != nil && containerRunning(c.name) {
		return err
	}
	return d.waitExit(i, 30*time.Second)
}

func (d *dockerBackend) Stop(i int, grace time.Duration) error {
	if !d.Running(i) {
		return nil
	}
	c := d.c(i)
	if d.Paused(i) {
		_ = d.Resume(i)
	}
	secs := max(int(grace.Seconds()), 1)
	if _, err := docker("stop", "-t", fmt.Sprint(secs), c.name); err != nil && containerRunning(c.name) {
		return err
	}
	return d.waitExit(i, 30*time.Second)
}

func (d *dockerBackend) Pause(i int) error {
	c := d.c(i)
	if !d.Running(i) {
		return fmt.Errorf("chaos: node %s is not running", c.addr.ID)
	}
	if _, err := docker("pause", c.name); err != nil {
		return err
	}
	c.mu.Lock()
	c.paused = true
	c.mu.Unlock()
	return nil
}

func (d *dockerBackend) Resume(i int) error {
	c := d.c(i)
	c.mu.Lock()
	paused := c.paused
	c.mu.Unlock()
	if !paused {
		return nil
	}
	_, err := docker("unpause", c.name)
	if err == nil || !d.Running(i) {
		c.mu.Lock()
		c.paused = false
		c.mu.Unlock()
	}
	return err
}

// Isolate disconnects slot i's container from the network.
func (d *dockerBackend) Isolate(i int) error {
	c := d.c(i)
	c.mu.Lock()
	if c.detached {
		c.mu.Unlock()
		return nil
	}
	c.detached = true
	c.mu.Unlock()
	_, err := docker("network", "disconnect", "--force", d.network, c.name)
	return err
}

// Reconnect reattaches every isolated container on its address.
func (d *dockerBackend) Reconnect() error {
	var errs []error
	for i := range d.Len() {
		c := d.c(i)
		c.mu.Lock()
		detached := c.detached
		c.mu.Unlock()
		if !detached {
			continue
		}
		if _, err := docker("network", "connect", "--ip", c.ip, d.network, c.name); err != nil &&
			!strings.Contains(err.Error(), "already exists") {
			errs = append(errs, err)
			continue
		}
		c.mu.Lock()
		c.detached = false
		c.mu.Unlock()
	}
	return errors.Join(errs...)
}

// Close stops the containers, copies their logs into the log dir, and removes containers,
// network and image.
func (d *dockerBackend) Close() {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return
	}
	d.closed = true
	cs := append([]*container(nil), d.cs...)
	d.mu.Unlock()
	var wg sync.WaitGroup
	for i := range cs {
		wg.Go(func() { _ = d.Stop(i, 5*time.Second) })
	}
	wg.Wait()
	for _, c := range cs {
		var out bytes.Buffer
		cmd := exec.Command("docker", "logs", c.name)
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err == nil {
			_ = os.WriteFile(filepath.Join(d.logDir, c.addr.ID+".log"), out.Bytes(), 0o644)
		}
		if _, err := docker("rm", "-f", c.name); err != nil {
			d.log("chaos: %v", err)
		}
	}
	if d.network != "" {
		if _, err := docker("network", "rm", d.network); err != nil {
			d.log("chaos: %v", err)
		}
	}
	if d.image != "" {
		if _, err := docker("rmi", "-f", d.image); err != nil {
			d.log("chaos: %v", err)
		}
	}
}
