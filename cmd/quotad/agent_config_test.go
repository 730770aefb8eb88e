package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/pflag"

	"github.com/quotad/quotad/internal/agentconfig"
)

// sampleValue returns a value flag f accepts that differs from its default.
func sampleValue(t *testing.T, f *pflag.Flag, i int) string {
	switch f.Value.Type() {
	case "bool":
		if f.DefValue == "true" {
			return "false"
		}
		return "true"
	case "int", "int64", "uint64", "uint", "int32":
		return fmt.Sprint(1031 + i)
	case "duration":
		return fmt.Sprintf("%ds", 7+i)
	case "float64":
		return fmt.Sprintf("0.%d", 5+i%4)
	case "string":
		return fmt.Sprintf("v%d", i)
	}
	t.Fatalf("flag --%s has type %s: teach this test a sample value", f.Name, f.Value.Type())
	return ""
}

// TestEveryAgentFlagSettableFromFileAndEnv sets every agent flag from a config file, then from
// the environment, and checks the flag took the value. New flags are covered without edits.
func TestEveryAgentFlagSettableFromFileAndEnv(t *testing.T) {
	var lines []string
	want := map[string]string{}
	cmd := agentCmd()
	i := 0
	cmd.LocalFlags().VisitAll(func(f *pflag.Flag) {
		if !agentconfig.Settable(f) {
			return
		}
		v := sampleValue(t, f, i)
		i++
		want[f.Name] = v
		lines = append(lines, fmt.Sprintf("%s: %q", f.Name, v))
	})
	if len(want) < 30 {
		t.Fatalf("only %d agent flags found", len(want))
	}
	file := filepath.Join(t.TempDir(), "agent.yaml")
	if err := os.WriteFile(file, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	check := func(how string, fs *pflag.FlagSet) {
		for name, v := range want {
			f := fs.Lookup(name)
			got := f.Value.String()
			if got != v && !(f.Value.Type() == "duration" && got == strings.TrimSuffix(v, "s")+"s") {
				t.Errorf("%s: --%s = %q, want %q", how, name, got, v)
			}
		}
	}
	if err := cmd.ParseFlags(nil); err != nil {
		t.Fatal(err)
	}
	if err := agentconfig.Apply(cmd.LocalFlags(), file, nil); err != nil {
		t.Fatal(err)
	}
	check("file", cmd.LocalFlags())

	cmd = agentCmd()
	if err := cmd.ParseFlags(nil); err != nil {
		t.Fatal(err)
	}
	var env []string
	for name, v := range want {
		env = append(env, agentconfig.EnvName(name)+"="+v)
	}
	if err := agentconfig.Apply(cmd.LocalFlags(), "", env); err != nil {
		t.Fatal(err)
	}
	check("env", cmd.LocalFlags())
}
