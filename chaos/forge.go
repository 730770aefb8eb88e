package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// ForgeVector is what one attack of the forger achieved (chaos/forger's Vector).
type ForgeVector struct {
	Attempts  int    `json:"attempts"`
	Accepted  int    `json:"accepted"`
	Succeeded int    `json:"succeeded,omitempty"`
	Refused   int    `json:"refused"`
	Answered  int    `json:"answered,omitempty"`
	LastError string `json:"last_error,omitempty"`
	Skipped   string `json:"skipped,omitempty"`
}

// Forgery is one forge fault: what the forger reported and what the cluster looked like
// before, during and after.
type Forgery struct {
	Start   int64                  `json:"start"`
	End     int64                  `json:"end"`
	Vectors map[string]ForgeVector `json:"vectors"`
	// Error is set when the forger did not run to the end or its report was unreadable.
	Error string `json:"error,omitempty"`
	// Leaders are the leaders seen while it ran (in order, deduplicated); one is expected.
	Leaders []string `json:"leaders"`
	// VotersBefore and VotersAfter are the Raft voters around the attack.
	VotersBefore []string `json:"voters_before"`
	VotersAfter  []string `json:"voters_after"`
}

// buildForger compiles chaos/forger into dir.
func buildForger(moduleDir, dir string) (string, error) {
	bin := filepath.Join(dir, "forger")
	cmd := exec.Command("go", "build", "-o", bin, "./chaos/forger")
	cmd.Dir = moduleDir
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./chaos/forger: %v\n%s", err, out)
	}
	return bin, nil
}

// forge runs the forger against every node's Raft and gossip ports for hold and records a
// Forgery.
func (nm *nemesis) forge(ctx context.Context, leader *Node, hold time.Duration) (nodes []string, detail, skipped string) {
	switch {
	case nm.forger == "":
		return nil, "", "no forger binary (see the run's notes)"
	case nm.c.creds == nil:
		return nil, "", "the cluster runs --insecure (no peer TLS, no gossip key): forged peer traffic is accepted by design"
	}
	// A legitimate caller's credential: the harness's admin client certificate, issued by the
	// cluster's CA (auth.ClientRoleURI). It must not open the peer ports.
	cert, key := nm.c.creds.AdminCertFile, nm.c.creds.AdminKeyFile
	var raftAddrs, gossipAddrs []string
	for _, n := range nm.c.Nodes {
		if n.Starts() > 0 && !n.Removed {
			raftAddrs, gossipAddrs = append(raftAddrs, n.Raft), append(gossipAddrs, n.Gossip)
			nodes = append(nodes, n.ID)
		}
	}
	fg := Forgery{Start: nm.rec.now(), Leaders: []string{leader.ID}}
	var err error
	if fg.VotersBefore, err = nm.voters(ctx); err != nil {
		return nodes, "", "voters unreadable before the attack: " + err.Error()
	}
	args := []string{"--raft", strings.Join(raftAddrs, ","), "--gossip", strings.Join(gossipAddrs, ","),
		"--duration", hold.String(), "--client-cert", cert, "--client-key", key}
	sctx, cancel := context.WithTimeout(ctx, time.Second)
	if st, err := nm.c.State(sctx, leader); err == nil {
		args = append(args, "--index", fmt.Sprint(st.AppliedIndex))
	}
	cancel()
	// The attack must finish even when the fault period ends: a half-run attack proves nothing.
	fctx, cancel := context.WithTimeout(context.Background(), hold+30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(fctx, nm.forger, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		return nodes, "", "starting the forger: " + err.Error()
	}
	go func() { done <- cmd.Wait() }()
	// Watch the leader while it runs.
	var runErr error
watch:
	for {
		select {
		case runErr = <-done:
			break watch
		case <-time.After(250 * time.Millisecond):
			lctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			if l, err := nm.c.Leader(lctx, 2*time.Second); err == nil && l.ID != fg.Leaders[len(fg.Leaders)-1] {
				fg.Leaders = append(fg.Leaders, l.ID)
			}
			cancel()
		}
	}
	fg.End = nm.rec.now()
	if runErr != nil {
		fg.Error = fmt.Sprintf("forger: %v: %s", runErr, truncate(strings.TrimSpace(stderr.String()), 300))
	} else if err := json.Unmarshal(stdout.Bytes(), &struct {
		Vectors *map[string]ForgeVector `json:"vectors"`
	}{&fg.Vectors}); err != nil {
		fg.Error = fmt.Sprintf("forger report unreadable: %v: %s", err, truncate(stdout.String(), 300))
	}
	// Observed with their own deadline: the fault period may have ended meanwhile.
	octx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if l, err := nm.c.Leader(octx, 20*time.Second); err == nil && l.ID != fg.Leaders[len(fg.Leaders)-1] {
		fg.Leaders = append(fg.Leaders, l.ID)
	}
	if fg.VotersAfter, err = nm.voters(octx); err != nil {
		fg.Error = strings.TrimPrefix(fg.Error+"; voters after the attack unreadable: "+err.Error(), "; ")
	}
	nm.rec.add(func(h *History) { h.Forgeries = append(h.Forgeries, fg) })
	var parts []string
	for _, name := range slices.Sorted(maps.Keys(fg.Vectors)) {
		v := fg.Vectors[name]
		parts = append(parts, fmt.Sprintf("%s %d/%d accepted", name, v.Accepted, v.Attempts))
	}
	detail = strings.Join(parts, ", ") + fmt.Sprintf("; leaders %v", fg.Leaders)
	if fg.Error != "" {
		detail += "; " + fg.Error
	}
	return nodes, detail, ""
}

// voters reads the voters, retrying for a few seconds.
func (nm *nemesis) voters(ctx context.Context) ([]string, error) {
	var err error
	for range 10 {
		var v []string
		if v, err = nm.c.Voters(ctx); err == nil {
			return v, nil
		}
		if !sleepCtx(ctx, 500*time.Millisecond) {
			break
		}
	}
	return nil, err
}

// CheckForgeries checks the forge faults: no forged peer traffic was accepted (no Raft RPC
// answered, no gossip join let in), the leader did not change while the forger ran, the
// voters stayed the same and no forged member is among them. A forger that did not run to
// the end, or attacked with no vector, makes its fault inconclusive, which is an anomaly
// too. Crashes show in node-logs and the run's strays.
func CheckForgeries(h *History) Result {
	return timed("forged-peer-traffic", func(r *Result) {
		for _, fg := range h.Forgeries {
			at := ms(fg.Start)
			if fg.Error != "" {
				r.anomaly("forge at %s inconclusive: %s", at, fg.Error)
				continue
			}
			attempts := 0
			for name, v := range fg.Vectors {
				attempts += v.Attempts
				r.Checked += v.Attempts
				if v.Accepted > 0 {
					r.anomaly("forge at %s: %s: %d of %d forged attempts accepted, %d with success (last: %s)", at, name, v.Accepted, v.Attempts, v.Succeeded, v.LastError)
				}
			}
			if attempts == 0 {
				r.anomaly("forge at %s: the forger made no attempt", at)
			}
			if len(fg.Leaders) > 1 {
				r.anomaly("forge at %s: the leader changed while forged traffic arrived: %v", at, fg.Leaders)
			}
			if !slices.Equal(fg.VotersBefore, fg.VotersAfter) {
				r.anomaly("forge at %s: voters changed from %v to %v", at, fg.VotersBefore, fg.VotersAfter)
			}
			for _, v := range fg.VotersAfter {
				if strings.HasPrefix(v, "forged") {
					r.anomaly("forge at %s: forged member %s became a voter", at, v)
				}
			}
		}
		r.note("%d forge faults, %d forged attempts", len(h.Forgeries), r.Checked)
	})
}
