package agentconfig

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
)

type testFlags struct {
	id     string
	join   string
	hb     time.Duration
	debug  bool
	voters int
	thresh uint64
	config string
	fs     *pflag.FlagSet
}

func newFlags(t *testing.T, args ...string) *testFlags {
	t.Helper()
	f := &testFlags{fs: pflag.NewFlagSet("agent", pflag.ContinueOnError)}
	f.fs.StringVar(&f.config, FileFlag, "", "")
	f.fs.StringVar(&f.id, "id", "default-id", "")
	f.fs.StringVar(&f.join, "join", "", "comma-separated gossip addresses of other nodes")
	f.fs.DurationVar(&f.hb, "raft-heartbeat-timeout", time.Second, "")
	f.fs.BoolVar(&f.debug, "enable-debug", false, "")
	f.fs.IntVar(&f.voters, "min-voters", 3, "")
	f.fs.Uint64Var(&f.thresh, "snapshot-threshold", 8192, "")
	if err := f.fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	return f
}

func writeFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "agent.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestPrecedenceFlagEnvFileDefault(t *testing.T) {
	file := writeFile(t, `
id: from-file
join: [a:1, b:2]
raft-heartbeat-timeout: 5s
enable-debug: true
min-voters: 5
`)
	f := newFlags(t, "--id", "from-flag")
	env := []string{"QUOTAD_RAFT_HEARTBEAT_TIMEOUT=7s", "QUOTAD_ID=from-env", "PATH=/bin", "QUOTAD_SNAPSHOT_THRESHOLD=99"}
	if err := Apply(f.fs, file, env); err != nil {
		t.Fatal(err)
	}
	if f.id != "from-flag" {
		t.Errorf("id = %q: the command line must win over env and file", f.id)
	}
	if f.hb != 7*time.Second {
		t.Errorf("heartbeat = %v: the environment must win over the file", f.hb)
	}
	if f.join != "a:1,b:2" || !f.debug || f.voters != 5 {
		t.Errorf("from the file: join %q debug %v voters %d", f.join, f.debug, f.voters)
	}
	if f.thresh != 99 {
		t.Errorf("snapshot-threshold = %d: env without a file key", f.thresh)
	}
	// No file, no env: defaults stay.
	g := newFlags(t)
	if err := Apply(g.fs, "", nil); err != nil || g.id != "default-id" || g.hb != time.Second {
		t.Errorf("defaults: %v %q %v", err, g.id, g.hb)
	}
}

func TestFileErrorsNameFileLineAndKey(t *testing.T) {
	for _, tc := range []struct {
		body string
		want []string
	}{
		{"id: x\nmin_voters: 3\n", []string{":2:", `unknown key "min_voters"`, `did you mean "min-voters"`}},
		{"id: x\nlisten: :1\n", []string{":2:", `unknown key "listen"`, "quotad agent --help"}},
		{"id: x\nmin-votrs: 3\n", []string{":2:", `unknown key "min-votrs"`, `did you mean "min-voters"`}},
		{"raft-heartbeat-timeout: fast\n", []string{":1:", `key "raft-heartbeat-timeout"`, `"fast"`}},
		{"min-voters: 3\nmin-voters: 4\n", []string{":2:", "repeated (first on line 1)"}},
		{"id: {a: b}\n", []string{":1:", `key "id"`, "mapping"}},
		{"config: other.yaml\n", []string{":1:", `unknown key "config"`}},
		{"- id\n", []string{":1:", "want a mapping"}},
		// A list for a one-value flag was joined into one value (data-dir: [a, b] → "a,b").
		{"id: [a, b]\n", []string{":1:", `key "id"`, "a list", "--id takes one value"}},
		{"x: &l [a, b]\nid: *l\n", []string{":2:", `key "id"`, "a list"}},
		{"id: x\n---\nid: y\n", []string{":2:", "second YAML document"}},
	} {
		file := writeFile(t, tc.body)
		f := newFlags(t)
		err := Apply(f.fs, file, nil)
		if err == nil {
			t.Errorf("%q: accepted", tc.body)
			continue
		}
		for _, w := range append(tc.want, file) {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%q: error %q does not contain %q", tc.body, err, w)
			}
		}
		if f.id != "default-id" && !strings.Contains(tc.body, "id: x") {
			t.Errorf("%q: a refused file changed --id to %q", tc.body, f.id)
		}
	}
}

func TestEnvErrorNamesVariable(t *testing.T) {
	f := newFlags(t)
	err := Apply(f.fs, "", []string{"QUOTAD_MIN_VOTERS=many"})
	if err == nil || !strings.Contains(err.Error(), "$QUOTAD_MIN_VOTERS") || !strings.Contains(err.Error(), "--min-voters") {
		t.Fatalf("err = %v", err)
	}
}

// TestUnknownEnvSuggests: a QUOTAD_* variable that sets no flag and is not a known other
// setting is reported with the name it probably meant (user trial: $QUOTAD_DATADIR was
// ignored silently and the agent said "--data-dir is required"); known ones and other
// prefixes are not.
func TestUnknownEnvSuggests(t *testing.T) {
	f := newFlags(t)
	got := UnknownEnv(f.fs, []string{
		"QUOTAD_MINVOTERS=3", "QUOTAD_MIN_VOTERS=3", "QUOTAD_CONFIG=x", "QUOTAD_TOKEN=t", "QUOTAD_TOKN=t",
		"QUOTAD_SOMETHING_ELSE_ENTIRELY=1", "HOME=/root", "QUOTADX=1",
	}, "QUOTAD_TOKEN")
	want := []string{
		"$QUOTAD_MINVOTERS is not a quotad setting and is ignored (did you mean $QUOTAD_MIN_VOTERS?)",
		"$QUOTAD_SOMETHING_ELSE_ENTIRELY is not a quotad setting and is ignored (the agent reads $QUOTAD_<FLAG> for each flag, e.g. $QUOTAD_DATA_DIR)",
		"$QUOTAD_TOKN is not a quotad setting and is ignored (did you mean $QUOTAD_TOKEN?)",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("UnknownEnv:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

func TestEmptyFileAndMissingFile(t *testing.T) {
	f := newFlags(t)
	if err := Apply(f.fs, writeFile(t, "# nothing\n"), nil); err != nil {
		t.Errorf("empty file: %v", err)
	}
	err := Apply(f.fs, filepath.Join(t.TempDir(), "nope.yaml"), nil)
	if err == nil || !strings.Contains(err.Error(), "--config") {
		t.Errorf("missing file: %v", err)
	}
}
