package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// TestEveryParentRefusesUnknownSubcommand walks the whole command tree: every command with
// subcommands (quotad itself, pause, limits, tls ca, completion, ...) refuses an unknown
// subcommand, also one given with flags, naming it, the command and the valid subcommands
// (user trial: `quotad pause list` printed help and exited 0); alone it prints its help
// without error. A new parent command is covered without touching this test.
func TestEveryParentRefusesUnknownSubcommand(t *testing.T) {
	var parents [][]string
	var walk func(c *cobra.Command, path []string)
	walk = func(c *cobra.Command, path []string) {
		if c.HasSubCommands() {
			parents = append(parents, path)
		}
		for _, sub := range c.Commands() {
			walk(sub, append(path[:len(path):len(path)], sub.Name()))
		}
	}
	walk(newRoot(), nil)
	if len(parents) < 10 {
		t.Fatalf("found %d parent commands (%v); the walk is broken", len(parents), parents)
	}
	run := func(args ...string) (string, error) {
		root := newRoot()
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetErr(&out)
		root.SetArgs(args)
		err := root.Execute()
		return out.String(), err
	}
	for _, path := range parents {
		name := strings.TrimSpace("quotad " + strings.Join(path, " "))
		root := newRoot()
		c, _, err := root.Find(path)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var valid []string
		for _, sub := range c.Commands() {
			if sub.IsAvailableCommand() {
				valid = append(valid, sub.Name())
			}
		}
		want := `unknown command "nonesuch" for "` + name + `"`
		for _, args := range [][]string{{"nonesuch"}, {"nonesuch", "--domain", "x"}, {"nonesuch", "extra"}} {
			_, err := run(append(path[:len(path):len(path)], args...)...)
			if err == nil || !strings.Contains(err.Error(), want) || !strings.HasSuffix(err.Error(), "valid: "+strings.Join(valid, ", ")) {
				t.Errorf("%s %s: %v, want an error containing %q and ending with valid: %s", name, strings.Join(args, " "), err, want, strings.Join(valid, ", "))
			}
		}
		out, err := run(path...)
		if err != nil || !strings.Contains(out, "Available Commands:") {
			t.Errorf("%s alone: %v, want its help and no error; printed:\n%s", name, err, out)
		}
	}
	// A near miss gets a suggestion.
	if _, err := run("token", "lst"); err == nil || !strings.Contains(err.Error(), "did you mean list?") {
		t.Errorf("token lst: %v, want a suggestion of list", err)
	}
	// Subcommands still run and still refuse their own bad flags as before.
	if _, err := run("pause", "lift", "--bogus"); err == nil || !strings.Contains(err.Error(), "unknown flag: --bogus") {
		t.Errorf("pause lift --bogus: %v", err)
	}
}
