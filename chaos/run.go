package chaos

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/proccluster"
)

// Config configures one chaos run.
type Config struct {
	Seed     int64
	Nodes    int           // 3 or 5
	Duration time.Duration // fault period
	Warmup   time.Duration // load without faults first (the throughput floor is measured here)
	Quiet    time.Duration // load after the final heal
	Floor    float64       // decisions per second before the first fault
	OutDir   string        // report, history and logs go here
	Tags     string        // build tags of the binary, comma-separated (default "chaos")
	// Docker runs one container per node (image FROM scratch) instead of processes.
	Docker bool
	// BinaryPath, if set, is used instead of building.
	BinaryPath string
	Workload   WorkloadConfig
	Nemesis    NemesisConfig
	// PorcupineTimeout bounds porcupine's cross-check of one budget bucket and
	// PorcupineBudget all of them (the exact checker decides; porcupine re-checks).
	PorcupineTimeout time.Duration
	PorcupineBudget  time.Duration
	Log              func(format string, args ...any)

	// AgentArgs are more agent flags for every node (e.g. --raft-log-store wal).
	AgentArgs []string
	// HolderTags are more build tags for the shares workload's holder binary only (e.g. the
	// planted chaos_bug_holderexpiry).
	HolderTags []string
}

// DefaultConfig is the CI-sized run (`make chaos`).
func DefaultConfig() Config {
	return Config{
		Seed: time.Now().UnixNano(), Nodes: 3, Duration: 4 * time.Minute, Warmup: 10 * time.Second,
		Quiet: 10 * time.Second, Floor: 100, OutDir: "out", Tags: "chaos", Workload: DefaultWorkload(),
		Nemesis:          NemesisConfig{Every: 3 * time.Second, Hold: 4 * time.Second},
		PorcupineTimeout: 15 * time.Second, PorcupineBudget: 2 * time.Minute,
		Log: func(f string, a ...any) { fmt.Printf(f+"\n", a...) },
	}
}

// Report is chaos/out/report.json.
type Report struct {
	Seed      int64          `json:"seed"`
	Nodes     int            `json:"nodes"`
	Binary    string         `json:"binary"`
	Backend   string         `json:"backend"`
	Notes     []string       `json:"notes,omitempty"`
	Duration  string         `json:"duration"`
	Ops       int            `json:"ops"`
	Anomalies int            `json:"anomalies"`
	Faults    map[string]int `json:"faults"`
	// Missing lists fault kinds never injected (a CI run must inject every kind).
	Missing      []string             `json:"missing_faults,omitempty"`
	Throughput   float64              `json:"throughput_before_fault"`
	Porcupine    LinearizabilityStats `json:"porcupine"`
	Checkers     []Result             `json:"checkers"`
	ReclaimBound string               `json:"reclaim_bound"`
	OK           bool                 `json:"ok"`
	// UnknownOutcomes counts the ops whose call ended without an answer (every kind), of
	// which ResolvedOutcomes were learned later by re-sending the request ID and
	// AmbiguousOutcomes stayed unknown to the end (NotResent of them on purpose, see
	// WorkloadConfig.LeaveAmbiguous). UnknownCauses splits UnknownOutcomes by Op.Cause.
	UnknownOutcomes   int            `json:"unknown_outcomes"`
	ResolvedOutcomes  int            `json:"resolved_outcomes"`
	AmbiguousOutcomes int            `json:"ambiguous_outcomes"`
	NotResent         int            `json:"not_resent"`
	UnknownCauses     map[string]int `json:"unknown_causes,omitempty"`
	// Strays counts nodes found down outside any fault (see Notes).
	Strays int `json:"strays"`
}

// UnknownStats counts a history's unknown outcomes (see Report.UnknownOutcomes).
type UnknownStats struct {
	Created, Resolved, Ambiguous, NotResent int
	Causes                                  map[string]int
}

func unknownStats(h *History) UnknownStats {
	st := UnknownStats{Causes: map[string]int{}}
	for _, op := range h.Ops {
		if op.Outcome != Unknown && !op.Resolved {
			continue
		}
		st.Created++
		st.Causes[cmp.Or(op.Cause, "unrecorded")]++
		switch {
		case op.Resolved:
			st.Resolved++
		case op.NotResent:
			st.Ambiguous++
			st.NotResent++
		default:
			st.Ambiguous++
		}
	}
	return st
}

// String is the one-line summary of the test log.
func (s UnknownStats) String() string {
	var causes []string
	for _, c := range slices.Sorted(maps.Keys(s.Causes)) {
		causes = append(causes, fmt.Sprintf("%s %d", c, s.Causes[c]))
	}
	return fmt.Sprintf("unknown outcomes created %d (%s): resolved by re-send %d, left ambiguous %d (%d never re-sent on purpose)",
		s.Created, strings.Join(causes, ", "), s.Resolved, s.Ambiguous, s.NotResent)
}

// Run performs a whole chaos run and returns its report (also written to OutDir).
func Run(ctx context.Context, cfg Config) (*Report, error) {
	logf := cfg.Log
	if err := os.MkdirAll(cfg.OutDir, 0o755); err != nil {
		return nil, err
	}
	work, err := os.MkdirTemp("", "quotad-chaos-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	logf("chaos: seed %d (rerun with QUOTAD_CHAOS_SEED=%d), %d nodes, faults for %v", cfg.Seed, cfg.Seed, cfg.Nodes, cfg.Duration)

	rep := &Report{Seed: cfg.Seed, Nodes: cfg.Nodes, Faults: map[string]int{}}
	bin := &proccluster.Binary{Path: cfg.BinaryPath, Tags: splitTags(cfg.Tags)}
	if cfg.BinaryPath == "" {
		root, err := proccluster.ModuleRoot()
		if err != nil {
			return nil, err
		}
		if bin, err = proccluster.BuildBinary(root, work, splitTags(cfg.Tags), true); err != nil {
			return nil, err
		}
	} else {
		bin.Flags = proccluster.AgentFlags(bin.Path)
	}
	rep.Binary = bin.Path + " tags=" + strings.Join(bin.Tags, ",")
	if bin.Note != "" {
		rep.Notes = append(rep.Notes, bin.Note+" (no in-binary fault hooks)")
		logf("chaos: %s", bin.Note)
	}
	extra := []string{"--dead-node-timeout", "5s", "--min-voters", "3"}
	extra = append(extra, cfg.AgentArgs...)
	if len(cfg.AgentArgs) > 0 {
		rep.Notes = append(rep.Notes, "agent args: "+strings.Join(cfg.AgentArgs, " "))
	}
	snapshotFlags := bin.Flags["snapshot-threshold"] && bin.Flags["trailing-logs"]
	const trailing = 64
	if snapshotFlags {
		extra = append(extra, "--snapshot-threshold", "128", "--trailing-logs", fmt.Sprint(trailing))
		if bin.Flags["snapshot-interval"] {
			extra = append(extra, "--snapshot-interval", "1s")
		}
	} else {
		rep.Notes = append(rep.Notes, "agent lacks --snapshot-threshold/--trailing-logs: snapshot-install fault skipped")
	}
	logDir := filepath.Join(cfg.OutDir, "nodes")
	_ = os.RemoveAll(logDir)
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		return nil, err
	}
	limitsFile := filepath.Join(work, "limits.yaml")
	if err := os.WriteFile(limitsFile, []byte(LimitsYAML+SharesLimitsYAML), 0o644); err != nil {
		return nil, err
	}
	forger, holder := "", ""
	if root, err := proccluster.ModuleRoot(); err == nil {
		if forger, err = buildForger(root, work); err != nil {
			rep.Notes = append(rep.Notes, "forge fault skipped: "+firstLine(err.Error()))
		}
		if holder, err = buildHolder(root, work, append(splitTags(cfg.Tags), cfg.HolderTags...)); err != nil {
			return nil, err
		}
	}
	var b Backend
	if cfg.Docker {
		b, err = startContainers(ctx, bin, work, logDir, limitsFile, cfg.Nodes, extra, logf)
	} else {
		b, err = startProcesses(bin, work, logDir, limitsFile, cfg.Nodes, extra)
	}
	if err != nil {
		return nil, err
	}
	rep.Backend = b.Name()
	c := NewCluster(b)
	defer c.Close()
	if _, err := c.Leader(ctx, 60*time.Second); err != nil {
		hint := ""
		if cfg.Docker {
			c.Close() // collects the container logs
			hint = "; the test process must reach the containers' addresses directly (Linux, local daemon)"
		}
		return nil, fmt.Errorf("cluster did not come up: %w (logs in %s%s)", err, logDir, hint)
	}
	c.Hooks = c.probeHooks(c.Nodes[0])
	if !c.Hooks {
		rep.Notes = append(rep.Notes, "no /chaos/ fault hooks in the binary: partition, clock and disk faults skipped")
	}
	logf("chaos: %s cluster up (hooks=%v, snapshot flags=%v)", b.Name(), c.Hooks, snapshotFlags)

	rec := newRecorder(cfg.Seed)
	wl, err := newWorkload(cfg.Workload, c, rec, cfg.Seed)
	if err != nil {
		return nil, err
	}
	defer wl.close()
	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	rec.add(func(h *History) { h.LoadStart = rec.now() })
	wl.start(loadCtx)
	var sw *sharesWorkload
	if holder != "" {
		if sw, err = newSharesWorkload(holder, c, wl.addr, rec, cfg.Seed, work, logf); err != nil {
			return nil, err
		}
		if err := sw.start(loadCtx, cfg.Nemesis.Hold); err != nil {
			return nil, err
		}
	}
	sleepCtx(ctx, cfg.Warmup)

	nemCtx, stopNem := context.WithTimeout(ctx, cfg.Duration)
	nm := &nemesis{cfg: cfg.Nemesis, c: c, rec: rec, log: logf, snapshotFlags: snapshotFlags, trailingLogs: trailing,
		rng: newRand(cfg.Seed), bootstrap: cfg.Nodes, forger: forger}
	nm.run(nemCtx)
	stopNem()

	// Final heal: everything running, unpaused, unpartitioned, clocks and disks normal.
	for _, n := range c.Nodes {
		if n.Paused() {
			_ = n.Resume()
		}
	}
	for _, n := range c.Nodes[:cfg.Nodes] {
		_ = c.Start(n)
	}
	nm.healAll("all")
	if _, err := c.Leader(ctx, 60*time.Second); err != nil {
		rep.Notes = append(rep.Notes, "no leader after the final heal: "+err.Error())
	}
	healAt := rec.now()
	logf("chaos: healed; quiet period %v", cfg.Quiet)
	sleepCtx(ctx, cfg.Quiet)
	stopLoad()
	wl.wg.Wait()
	if sw != nil {
		sw.stop()
	}
	stopAt := rec.now()

	// Leases of crashed holders must come back within TTL + one election.
	// TTL plus time for an election and a probe acquisition after the heal. 5 s was exceeded
	// once (8.6 s) on a loaded 2-core CI machine with every workload on (seed
	// 1796133241400487411): that is the invariant's "plus one election" taking long, not a
	// leak, which would last the whole run.
	reclaimBound := LeaseTTL + 8*time.Second
	rep.ReclaimBound = reclaimBound.String()
	measureReclaim(ctx, c, wl, rec, max(healAt, lastLeaseGrant(rec)), reclaimBound)

	// Replica agreement after the quiet period.
	sampleStates(ctx, c, rec, 3*time.Second)

	// Total restart: kill -9 every node, restart, and re-send recent acknowledged decisions.
	acked := recentAcks(rec.snapshot(), stopAt-int64(20*time.Second), 300)
	logf("chaos: total restart; re-sending %d acknowledged decisions", len(acked))
	for _, n := range c.Running() {
		_ = n.Kill()
	}
	for _, n := range c.Nodes {
		if n.Starts() > 0 && !n.Removed {
			_ = c.Start(n)
		}
	}
	if _, err := c.Leader(ctx, 60*time.Second); err != nil {
		rep.Notes = append(rep.Notes, "no leader after the total restart: "+err.Error())
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for _, op := range acked {
		sem <- struct{}{}
		wg.Go(func() { defer func() { <-sem }(); wl.replay(op, "restart") })
	}
	wg.Wait()
	sampleStates(ctx, c, rec, 2*time.Second)
	wl.resolve.Wait()
	c.Close()

	h := rec.snapshot()
	if err := h.Write(filepath.Join(cfg.OutDir, "history.json")); err != nil {
		return nil, err
	}
	logf("chaos: checking %d ops", len(h.Ops))
	lin, st := CheckLinearizable(h, LinearizabilityConfig{Initial: BudgetBurst, Timeout: cfg.PorcupineTimeout, Budget: cfg.PorcupineBudget, VisualizeDir: cfg.OutDir})
	thr, rate := CheckThroughput(h, cfg.Floor)
	rep.Checkers = []Result{
		lin,
		CheckBoundedAdmission(h, map[string]RateLimit{"r0": {RateBurst, RatePerSecond}, "r1": {RateBurst, RatePerSecond},
			SharesBucket: {SharesBurst, SharesRate}}),
		CheckShares(h, holder != "" && cfg.Duration >= 80*time.Second),
		CheckLeases(h, map[string]uint64{"p0": LeaseMaxInFlight}),
		CheckReclaim(h, reclaimBound),
		CheckReplays(h),
		CheckReplicaHashes(h),
		CheckLogs(logDir),
		CheckForgeries(h),
		thr,
	}
	rep.Throughput, rep.Porcupine, rep.Ops = rate, st, len(h.Ops)
	rep.Strays = len(h.Strays)
	rep.Notes = append(rep.Notes, h.Strays...)
	rep.Duration = time.Duration(rec.now()).Round(time.Second).String()
	us := unknownStats(h)
	rep.UnknownOutcomes, rep.ResolvedOutcomes, rep.AmbiguousOutcomes, rep.NotResent, rep.UnknownCauses =
		us.Created, us.Resolved, us.Ambiguous, us.NotResent, us.Causes
	logf("chaos: %v", us)
	for _, k := range FaultKinds {
		rep.Faults[k] = 0
	}
	for _, f := range h.Faults {
		if f.Skipped == "" {
			rep.Faults[f.Kind]++
		}
	}
	for _, k := range FaultKinds {
		if rep.Faults[k] == 0 {
			rep.Missing = append(rep.Missing, k)
		}
	}
	rep.OK = true
	for _, r := range rep.Checkers {
		rep.Anomalies += r.Anomalies
		rep.OK = rep.OK && r.OK
	}
	if err := writeJSON(filepath.Join(cfg.OutDir, "report.json"), rep); err != nil {
		return rep, err
	}
	if rep.OK {
		_ = os.Remove(filepath.Join(cfg.OutDir, "history.json")) // kept only on failure
	}
	return rep, nil
}

func splitTags(s string) []string {
	var out []string
	for _, t := range strings.Split(s, ",") {
		if t = strings.TrimSpace(t); t != "" {
			out = append(out, t)
		}
	}
	return out
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

func lastLeaseGrant(rec *recorder) int64 {
	var t int64
	for _, op := range rec.snapshot().Ops {
		if op.Kind == KindLease && op.LeaseID != 0 {
			t = max(t, op.Return)
		}
	}
	return t
}

// measureReclaim waits until Status shows no permit in flight, then takes max_in_flight fresh
// permits at once and releases them.
func measureReclaim(ctx context.Context, c *Cluster, wl *workload, rec *recorder, from int64, bound time.Duration) {
	rc := Reclaim{Bucket: "p0", HealAt: from, ReclaimedAt: -1, Capacity: LeaseMaxInFlight}
	for _, op := range rec.snapshot().Ops {
		if op.Kind == KindLease && op.LeaseID != 0 && op.ReleaseCall < 0 {
			rc.CrashedHeld++
		}
	}
	cl := wl.clients[len(wl.clients)-1]
	deadline := rec.start.Add(time.Duration(from) + bound + 20*time.Second)
	for time.Now().Before(deadline) {
		sctx, cancel := context.WithTimeout(ctx, time.Second)
		st, err := cl.Status(sctx, LeaseDomain, client.Entry{Key: "pool", Value: "p0"})
		cancel()
		if err == nil {
			inFlight := uint64(0)
			for _, b := range st.Buckets {
				inFlight += b.InFlight
			}
			if inFlight == 0 {
				rc.ReclaimedAt = rec.now()
				break
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	if rc.ReclaimedAt >= 0 {
		var mu sync.Mutex
		var leases []uint64
		var wg sync.WaitGroup
		for range LeaseMaxInFlight {
			wg.Go(func() {
				actx, cancel := context.WithTimeout(ctx, 5*time.Second)
				defer cancel()
				d, err := cl.Allow(actx, client.Request{Domain: LeaseDomain, Descriptors: client.Descriptors("pool", "p0")})
				if err == nil && d.LeaseID != 0 {
					mu.Lock()
					leases = append(leases, d.LeaseID)
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		rc.Reacquired = uint64(len(leases))
		for _, id := range leases {
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			_, _ = cl.ReleaseLease(rctx, id)
			cancel()
		}
	}
	rec.add(func(h *History) { h.Reclaim = append(h.Reclaim, rc) })
}

// sampleStates polls every running node's /debug/state as fast as it can for d.
func sampleStates(ctx context.Context, c *Cluster, rec *recorder, d time.Duration) {
	end := time.Now().Add(d)
	for time.Now().Before(end) && ctx.Err() == nil {
		var wg sync.WaitGroup
		for _, n := range c.Running() {
			wg.Go(func() {
				sctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
				st, err := c.State(sctx, n)
				cancel()
				if err == nil {
					s := StateSample{At: rec.now(), Node: n.ID, AppliedIndex: st.AppliedIndex, Hash: st.Hash}
					rec.add(func(h *History) { h.States = append(h.States, s) })
				}
			})
		}
		wg.Wait()
		time.Sleep(5 * time.Millisecond)
	}
}

// recentAcks returns up to n acknowledged spends and leases answered after since.
func recentAcks(h *History, since int64, n int) []Op {
	var out []Op
	for i := len(h.Ops) - 1; i >= 0 && len(out) < n; i-- {
		op := h.Ops[i]
		if op.Return >= since && (op.Kind == KindSpend || op.Kind == KindLease) && (op.Outcome == Admitted || op.Outcome == Denied) {
			out = append(out, op)
		}
	}
	return out
}

// PrintSummary writes the report as a table.
func PrintSummary(w io.Writer, r *Report) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "seed\t%d\n", r.Seed)
	fmt.Fprintf(tw, "binary\t%s\n", r.Binary)
	fmt.Fprintf(tw, "ops\t%d\n", r.Ops)
	fmt.Fprintf(tw, "unknown outcomes\t%d created %v: %d resolved by re-send, %d left ambiguous (%d never re-sent on purpose)\n",
		r.UnknownOutcomes, r.UnknownCauses, r.ResolvedOutcomes, r.AmbiguousOutcomes, r.NotResent)
	fmt.Fprintf(tw, "throughput before first fault\t%.0f decisions/s\n", r.Throughput)
	fmt.Fprintf(tw, "porcupine\t%d buckets, %d ops, cross-checked %d, undecided %d, %v\n", r.Porcupine.Buckets, r.Porcupine.Ops, r.Porcupine.CrossChecked, r.Porcupine.Undecided, r.Porcupine.Elapsed.Round(time.Millisecond))
	var fk []string
	for _, k := range FaultKinds {
		fk = append(fk, fmt.Sprintf("%s=%d", k, r.Faults[k]))
	}
	fmt.Fprintf(tw, "faults\t%s\n", strings.Join(fk, " "))
	if len(r.Missing) > 0 {
		fmt.Fprintf(tw, "never injected\t%s\n", strings.Join(r.Missing, ", "))
	}
	for _, n := range r.Notes {
		fmt.Fprintf(tw, "note\t%s\n", n)
	}
	fmt.Fprintln(tw, "\nchecker\tresult\tanomalies\tchecked\ttime")
	for _, c := range r.Checkers {
		res := "ok"
		if !c.OK {
			res = "FAIL"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\n", c.Name, res, c.Anomalies, c.Checked, c.Duration)
	}
	tw.Flush()
	for _, c := range r.Checkers {
		if !c.OK {
			for _, d := range c.Details {
				fmt.Fprintf(w, "  %s: %s\n", c.Name, d)
			}
		}
	}
	verdict := "PASS"
	if !r.OK {
		verdict = "FAIL"
	}
	fmt.Fprintf(w, "chaos: %s, %d anomalies\n", verdict, r.Anomalies)
}
