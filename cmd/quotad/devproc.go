package main

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// devCluster supervises the agent processes of `quotad dev`: it starts them, tells when one
// exits, restarts the exited ones on request (Enter on stdin, or SIGHUP) and stops them all on
// SIGINT/SIGTERM. It runs while any node runs or may be restarted.
type devCluster struct {
	self    string // the quotad binary
	dataDir string
	nodes   []*devNode
	exits   chan devExit
	wg      sync.WaitGroup
}

type devNode struct {
	id      string
	args    []string
	mu      sync.Mutex
	cmd     *exec.Cmd // nil: not running
	started time.Time
	starts  int
}

type devExit struct {
	i     int
	err   error
	ran   time.Duration
	first bool // the node's first run
}

// failedToStart tells whether the exit looks like a node that never came up: its first run,
// ended by the process itself (a non-zero exit code: a port in use, a bad flag) within
// quickExit. A node killed by a signal (kill -9 of a running node, as the README shows) was
// stopped from outside, however soon: dev then waits for a restart instead of giving up.
func (x devExit) failedToStart() bool {
	if !x.first || x.ran >= quickExit {
		return false
	}
	var ee *exec.ExitError
	if errors.As(x.err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return false
		}
	}
	return x.err != nil
}

// quickExit: a node whose first run ends sooner than this did not start at all (a port in
// use, a bad flag); if every node's does, dev gives up instead of waiting for a restart.
const quickExit = 5 * time.Second

func newDevCluster(self, dataDir string, args [][]string) *devCluster {
	dc := &devCluster{self: self, dataDir: dataDir, exits: make(chan devExit, len(args))}
	for _, a := range args {
		dc.nodes = append(dc.nodes, &devNode{id: a[2], args: a}) // a = agent --id ID ...
	}
	return dc
}

func (n *devNode) pid() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd == nil {
		return 0
	}
	return n.cmd.Process.Pid
}

func (dc *devCluster) pidFile(n *devNode) string { return filepath.Join(dc.dataDir, n.id+".pid") }

// start starts node i (its log lines on stderr, prefixed with its ID) and records its pid.
func (dc *devCluster) start(i int) error {
	n := dc.nodes[i]
	p := exec.Command(dc.self, n.args...)
	p.Stdout = os.Stdout
	stderr, err := p.StderrPipe()
	if err != nil {
		return err
	}
	if err := p.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", n.id, err)
	}
	n.mu.Lock()
	n.cmd, n.started = p, time.Now()
	n.starts++
	first := n.starts == 1
	n.mu.Unlock()
	_ = os.WriteFile(dc.pidFile(n), []byte(strconv.Itoa(p.Process.Pid)+"\n"), 0o644)
	dc.wg.Add(1)
	go func() {
		defer dc.wg.Done()
		prefixLines(os.Stderr, stderr, n.id)
		err := p.Wait()
		n.mu.Lock()
		n.cmd = nil
		ran := time.Since(n.started)
		n.mu.Unlock()
		dc.exits <- devExit{i, err, ran, first}
	}()
	return nil
}

// restartExited restarts every node that is not running.
func (dc *devCluster) restartExited() {
	restarted := 0
	for i, n := range dc.nodes {
		if n.pid() != 0 {
			continue
		}
		if err := dc.start(i); err != nil {
			fmt.Fprintf(os.Stderr, "restarting %s: %v\n", n.id, err)
			continue
		}
		restarted++
		fmt.Printf("%s restarted: pid %d\n", n.id, n.pid())
	}
	if restarted == 0 {
		fmt.Println("every node is running; nothing to restart")
	}
}

// run supervises the nodes until SIGINT/SIGTERM (nil), or until every node has exited right
// after starting (an error).
func (dc *devCluster) run() error {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sig)
	enter := make(chan struct{})
	go func() { // Enter on the terminal asks for a restart; EOF (no terminal) just ends this
		s := bufio.NewScanner(os.Stdin)
		for s.Scan() {
			enter <- struct{}{}
		}
	}()
	quick := make([]bool, len(dc.nodes))
	for {
		select {
		case s := <-sig:
			if s == syscall.SIGHUP {
				dc.restartExited()
				continue
			}
			dc.stopAll()
			return nil
		case <-enter:
			dc.restartExited()
		case x := <-dc.exits:
			alive := dc.running()
			quick[x.i] = x.failedToStart()
			fmt.Fprintf(os.Stderr, "%s exited (%v) after %v; %d of %d nodes running. Press Enter (or kill -HUP %d) to restart it.\n",
				dc.nodes[x.i].id, x.err, x.ran.Round(time.Millisecond), alive, len(dc.nodes), os.Getpid())
			if alive == 0 {
				all := true
				for _, q := range quick {
					all = all && q
				}
				if all {
					dc.wg.Wait()
					return fmt.Errorf("every node exited within %v of starting; see the log lines above", quickExit)
				}
				fmt.Fprintln(os.Stderr, "no node is running: press Enter to restart them, Ctrl-C to quit")
			}
		}
	}
}

// running counts the nodes whose process runs.
func (dc *devCluster) running() int {
	n := 0
	for _, nd := range dc.nodes {
		if nd.pid() != 0 {
			n++
		}
	}
	return n
}

// stopAll asks every running node to stop gracefully and kills what still runs after 10 s.
func (dc *devCluster) stopAll() {
	signalAll := func(s os.Signal) {
		for _, n := range dc.nodes {
			n.mu.Lock()
			if n.cmd != nil {
				_ = n.cmd.Process.Signal(s)
			}
			n.mu.Unlock()
		}
	}
	signalAll(syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		dc.wg.Wait()
		close(done)
	}()
	kill := time.NewTimer(10 * time.Second)
	defer kill.Stop()
	for {
		select {
		case <-done:
			return
		case <-dc.exits: // drain, so the waiters never block
		case <-kill.C:
			signalAll(syscall.SIGKILL)
		}
	}
}

// devPortsFree checks that every port `quotad dev` is about to give its nodes (and its regions'
// nodes) can be bound: gRPC, Raft and HTTP over TCP, gossip over TCP and UDP. The error names
// the first busy one, the node and flag it is for, and what to do.
func devPortsFree(host string, base, nodes, regions int) error {
	kinds := []string{"--grpc-addr", "--raft-addr", "--gossip-addr", "--http-addr"}
	for r := 0; r <= regions; r++ {
		for kind, flag := range kinds {
			for i := 0; i < nodes; i++ {
				addr := net.JoinHostPort(host, strconv.Itoa(base+1000*r+kind*100+i+1))
				node := fmt.Sprintf("node%d", i+1)
				if r > 0 {
					node = fmt.Sprintf("r%d-%s", r, node)
				}
				err := canListen("tcp", addr)
				if err == nil && flag == "--gossip-addr" {
					err = canListen("udp", addr)
				}
				if err != nil {
					return fmt.Errorf("port %s (%s's %s) is not free: %v; another quotad dev or agent may still be running there (stop it, or wait until it has exited), or start with another --port-base (now %d; dev uses ports %d to %d)",
						addr, node, flag, err, base, base+1, base+1000*regions+300+nodes)
				}
			}
		}
	}
	return nil
}

func canListen(network, addr string) error {
	if network == "udp" {
		c, err := net.ListenPacket(network, addr)
		if err != nil {
			return err
		}
		return c.Close()
	}
	l, err := net.Listen(network, addr)
	if err != nil {
		return err
	}
	return l.Close()
}
