package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/quotad/quotad/config"
)

func devCmd() *cobra.Command {
	var (
		nodes   int
		limits  string
		dataDir string
		host    string
		base    int
	)
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run a local cluster of separate agent processes (Ctrl-C stops them all)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if nodes < 1 || nodes > 9 {
				return fmt.Errorf("--nodes %d: use 1 to 9", nodes)
			}
			if limits != "" {
				if _, err := config.LoadFile(limits); err != nil {
					return err
				}
			}
			if dataDir == "" {
				d, err := os.MkdirTemp("", "quotad-dev-")
				if err != nil {
					return err
				}
				dataDir = d
			}
			self, err := os.Executable()
			if err != nil {
				return err
			}
			addr := func(kind, i int) string { return fmt.Sprintf("%s:%d", host, base+kind*100+i+1) }
			var gossip, grpcs []string
			for i := 0; i < nodes; i++ {
				gossip = append(gossip, addr(2, i))
				grpcs = append(grpcs, addr(0, i))
			}
			var procs []*exec.Cmd
			var wg sync.WaitGroup
			exited := make(chan string, nodes)
			for i := 0; i < nodes; i++ {
				id := fmt.Sprintf("node%d", i+1)
				args := []string{"agent", "--id", id,
					"--data-dir", filepath.Join(dataDir, id),
					"--grpc-addr", addr(0, i), "--raft-addr", addr(1, i),
					"--gossip-addr", addr(2, i), "--http-addr", addr(3, i),
					"--bootstrap-expect", fmt.Sprint(nodes), "--join", strings.Join(gossip, ","),
					"--insecure", // until dev generates a throwaway CA and gossip key
				}
				if limits != "" {
					args = append(args, "--limits", limits)
				}
				p := exec.Command(self, args...)
				stderr, _ := p.StderrPipe()
				p.Stdout = os.Stdout
				if err := p.Start(); err != nil {
					stopAll(procs, &wg)
					return fmt.Errorf("starting %s: %w", id, err)
				}
				procs = append(procs, p)
				wg.Add(1)
				go func() {
					defer wg.Done()
					prefixLines(os.Stderr, stderr, id)
					err := p.Wait()
					exited <- fmt.Sprintf("%s exited: %v", id, err)
				}()
				fmt.Printf("%s  grpc %s  raft %s  gossip %s  http %s  data %s\n", id, addr(0, i), addr(1, i), addr(2, i), addr(3, i), filepath.Join(dataDir, id))
			}
			fmt.Printf("\ncluster of %d: try\n  quotad status --addr %s\n  quotad acquire --addr %s --domain provider --descriptor endpoint=charges\nCtrl-C stops all nodes (data stays in %s).\n\n",
				nodes, strings.Join(grpcs, ","), strings.Join(grpcs, ","), dataDir)
			sig := make(chan os.Signal, 1)
			signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
			for alive := nodes; alive > 0; {
				select {
				case <-sig:
					stopAll(procs, &wg)
					return nil
				case msg := <-exited:
					fmt.Fprintln(os.Stderr, msg)
					alive--
				}
			}
			return fmt.Errorf("every node exited; see the log lines above")
		},
	}
	f := cmd.Flags()
	f.IntVar(&nodes, "nodes", 3, "number of agent processes")
	f.StringVar(&limits, "limits", "examples/limits.yaml", "limits file applied at first start")
	f.StringVar(&dataDir, "data-dir", "", "parent directory for the nodes' data (default: a new temp dir)")
	f.StringVar(&host, "host", "127.0.0.1", "address the nodes listen on")
	f.IntVar(&base, "port-base", 7100, "node i listens on grpc base+1+i, raft base+101+i, gossip base+201+i, http base+301+i")
	return cmd
}

// stopAll asks every process to stop gracefully and kills what is still running after 10 s.
// wg is done when every process has been waited for.
func stopAll(procs []*exec.Cmd, wg *sync.WaitGroup) {
	for _, p := range procs {
		_ = p.Process.Signal(syscall.SIGTERM)
	}
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		for _, p := range procs {
			_ = p.Process.Kill()
		}
		<-done
	}
}

func prefixLines(w io.Writer, r io.Reader, prefix string) {
	s := bufio.NewScanner(r)
	s.Buffer(make([]byte, 64*1024), 1024*1024)
	for s.Scan() {
		fmt.Fprintf(w, "[%s] %s\n", prefix, s.Text())
	}
}
