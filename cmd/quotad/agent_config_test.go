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

// TestAgentFlagGivenTwiceRefused: every agent flag given twice on the command line is refused
// naming the flag and both values (pflag let the last one win without a word, while a key
// repeated in the file is refused); once on the command line and also in the file or the
// environment is fine (the command line wins).
func TestAgentFlagGivenTwiceRefused(t *testing.T) {
	n := 0
	agentCmd().LocalFlags().VisitAll(func(f *pflag.Flag) {
		if !agentconfig.Settable(f) {
			return
		}
		n++
		a, b := sampleValue(t, f, 1), sampleValue(t, f, 2)
		if f.Value.Type() == "bool" {
			a, b = "true", "false"
		}
		err := agentCmd().ParseFlags([]string{"--" + f.Name + "=" + a, "--" + f.Name + "=" + b})
		if err == nil {
			t.Errorf("--%s=%s --%s=%s: accepted", f.Name, a, f.Name, b)
			return
		}
		for _, want := range []string{"--" + f.Name, b, fmt.Sprintf("%q", a), "given twice"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("--%s given twice: error %q does not say %s", f.Name, err, want)
			}
		}
	})
	if n < 30 {
		t.Fatalf("only %d agent flags found", n)
	}

	file := filepath.Join(t.TempDir(), "agent.yaml")
	if err := os.WriteFile(file, []byte("data-dir: /from/file\nlog-level: debug\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := agentCmd()
	if err := cmd.ParseFlags([]string{"--data-dir", "/from/flag", "--log-level", "warn"}); err != nil {
		t.Fatal(err)
	}
	if err := agentconfig.Apply(cmd.LocalFlags(), file, []string{"QUOTAD_LOG_LEVEL=error"}); err != nil {
		t.Fatalf("a flag also in the file and the environment: %v", err)
	}
	for name, want := range map[string]string{"data-dir": "/from/flag", "log-level": "warn"} {
		if got := cmd.LocalFlags().Lookup(name).Value.String(); got != want {
			t.Errorf("--%s = %q, want the command line's %q", name, got, want)
		}
	}
}

// TestRelativePathInConfigWarns: a relative path for a path flag in the --config file draws a
// warning naming the file, the line, the key and what it resolves to (the working directory,
// not the file's); absolute paths and non-path keys do not. Every agent flag that takes a
// file or directory is marked, checked by its help text.
func TestRelativePathInConfigWarns(t *testing.T) {
	cmd := agentCmd()
	cmd.LocalFlags().VisitAll(func(f *pflag.Flag) {
		u := strings.ToLower(f.Usage)
		if !agentconfig.Settable(f) || !(strings.HasPrefix(u, "pem ") || strings.HasPrefix(u, "file ") || strings.HasPrefix(u, "directory ") || strings.HasPrefix(u, "limits yaml")) {
			return
		}
		if f.Annotations[agentconfig.PathAnnotation] == nil {
			t.Errorf("--%s takes a path (%q) but is not in pathFlags", f.Name, f.Usage)
		}
	})
	file := filepath.Join(t.TempDir(), "agent.yaml")
	if err := os.WriteFile(file, []byte("cluster-name: prod\ndata-dir: /var/lib/quotad\nlimits: limits.yaml\ntls-cert: certs/n1.pem\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	got := agentconfig.RelativePaths(cmd.LocalFlags(), file, "/")
	if len(got) != 2 {
		t.Fatalf("warnings %q, want 2 (limits, tls-cert)", got)
	}
	for i, want := range [][]string{{file + ":3:", "limits", `"limits.yaml"`, "working directory (/)", "/limits.yaml", "absolute path"},
		{file + ":4:", "tls-cert", `"certs/n1.pem"`, "/certs/n1.pem"}} {
		for _, w := range want {
			if !strings.Contains(got[i], w) {
				t.Errorf("warning %q does not say %s", got[i], w)
			}
		}
	}
}
