package chaos

import (
	"bytes"
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/quotad/quotad/internal/proccluster"
)

// plantedBug is a deliberately broken build and the checkers that must catch it.
type plantedBug struct {
	tag string
	// what the tag must do (the lead implements it in fsm/ or rpc/ under this build tag).
	behaviour string
	// faults that provoke it, and checkers at least one of which must report an anomaly.
	faults   []string
	catchers []string
	raw      bool
}

var plantedBugs = []plantedBug{
	{
		tag:       "chaos_bug_nodedup",
		behaviour: "fsm: Acquire never consults the dedup table, so a retried request ID is decided (and debited) again",
		faults:    []string{"kill-leader", "pause-leader", "partition-leader"},
		catchers:  []string{"replay-same-decision", "linearizable-spends"},
	},
	{
		tag:       "chaos_bug_wallclock",
		behaviour: "leader stamps commands with its Clock's wall time (Now().UnixNano()) instead of base+monotonic elapsed",
		faults:    []string{"clock-offset", "clock-jump-back", "kill-leader"},
		catchers:  []string{"linearizable-spends", "bounded-admission", "lease-in-flight", "lease-reclaim", "replica-hashes", "replay-same-decision"},
	},
	{
		tag:       "chaos_bug_followerdecides",
		behaviour: "rpc: a follower decides Acquire from its own FSM state (a local, unreplicated debit) instead of forwarding",
		faults:    []string{"kill-follower", "pause-follower"},
		// A local debit changes the follower's state without a log entry: its hash at an
		// applied index then differs from the leader's.
		catchers: []string{"linearizable-spends", "replay-same-decision", "replica-hashes"},
		raw:      true,
	},
}

// tagImplemented reports whether any Go file of the module outside chaos/ mentions tag in a
// build constraint.
func tagImplemented(t *testing.T, root, tag string) bool {
	found := false
	_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.IsDir() && (d.Name() == "chaos" || strings.HasPrefix(d.Name(), ".")) {
			return filepath.SkipDir
		}
		if found || d.IsDir() || !strings.HasSuffix(p, ".go") {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return nil
		}
		for _, line := range strings.SplitN(string(b), "\n", 20) {
			if strings.HasPrefix(line, "//go:build") && strings.Contains(line, tag) {
				found = true
			}
		}
		return nil
	})
	return found
}

// tagChangesBinary reports whether building with tag changes the machine code: it compares
// the .text of reproducible builds (-trimpath, no VCS stamp, empty build ID) with tags
// "chaos,<tag>" and "chaos,<as many x>" (the build info records the tags, so an equally long
// dummy keeps every address in place). Equal code proves the tag's files exist but nothing
// uses them yet: such a "planted bug" cannot be caught, and a chaos run against it would only
// waste minutes. (Different code does not prove the bug is wired: the linker may just keep an
// extra method.)
func tagChangesBinary(t *testing.T, root, tag string) bool {
	t.Helper()
	dir := t.TempDir()
	build := func(out, tags string) []byte {
		cmd := exec.Command("go", "build", "-trimpath", "-buildvcs=false", "-ldflags=-buildid=", "-tags", tags, "-o", out, "./cmd/quotad")
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if msg, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build -tags %s: %v\n%s", tags, err, msg)
		}
		f, err := elf.Open(out)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		sec := f.Section(".text")
		if sec == nil {
			t.Fatalf("%s has no .text section", out)
		}
		b, err := sec.Data()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	plain := build(filepath.Join(dir, "plain"), "chaos,"+strings.Repeat("x", len(tag)))
	bug := build(filepath.Join(dir, "bug"), "chaos,"+tag)
	return !bytes.Equal(plain, bug)
}

// TestPlantedBugs runs a short chaos scenario against each broken build and expects its
// anomaly: the proof that the checkers can fail on a real cluster.
func TestPlantedBugs(t *testing.T) {
	if os.Getenv("QUOTAD_CHAOS") != "1" {
		t.Skip("set QUOTAD_CHAOS=1 to run the planted-bug builds (make chaos-bugs)")
	}
	root, err := proccluster.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	for _, bug := range plantedBugs {
		t.Run(bug.tag, func(t *testing.T) {
			if !tagImplemented(t, root, bug.tag) {
				t.Skipf("no file outside chaos/ has a //go:build line with %s yet; it should make: %s", bug.tag, bug.behaviour)
			}
			if !tagChangesBinary(t, root, bug.tag) {
				t.Fatalf("-tags chaos,%s builds the same machine code as -tags chaos: the tag's files exist but nothing "+
					"uses them, so there is no bug to catch yet; it should make: %s", bug.tag, bug.behaviour)
			}
			cfg := envConfig(t)
			cfg.Tags = "chaos," + bug.tag
			cfg.Duration = 60 * time.Second
			if d := os.Getenv("QUOTAD_CHAOS_BUG_DURATION"); d != "" {
				if cfg.Duration, err = time.ParseDuration(d); err != nil {
					t.Fatal(err)
				}
			}
			cfg.Nemesis.Only = bug.faults
			cfg.Workload.RawToAnyNode = bug.raw
			// No impatient workers: their ambiguous ops make porcupine's search of a broken
			// history longer (it already takes minutes), and these runs are about the bugs.
			cfg.Workload.ImpatientWorkers = 0
			cfg.OutDir = filepath.Join(cfg.OutDir, "bug-"+bug.tag)
			rep := runLogged(t, cfg)
			if !strings.Contains(rep.Binary, bug.tag) {
				t.Fatalf("the %s build failed and fell back to %s: %v", bug.tag, rep.Binary, rep.Notes)
			}
			var caught []string
			for _, c := range rep.Checkers {
				if !c.OK && slices.Contains(bug.catchers, c.Name) {
					caught = append(caught, c.Name)
				}
			}
			if len(caught) == 0 {
				t.Errorf("seed %d: planted bug %s (%s) was not caught by any of %v", rep.Seed, bug.tag, bug.behaviour, bug.catchers)
			} else {
				t.Logf("planted bug %s caught by %v", bug.tag, caught)
			}
		})
	}
}
