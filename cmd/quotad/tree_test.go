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

// TestEveryLeafWithoutArgumentsRefusesThem walks the whole command tree: every command that
// takes no positional argument (its Use names none: words after the name are flags and their
// values) refuses one with an error naming the command and the argument — cobra's own said
// `unknown command "extra" for "quotad status"`, or nothing at all for a command that declared
// no Args. Commands that take arguments accept one here (the walk checks only Args, it never
// runs a command). A new leaf command is covered without touching this test.
func TestEveryLeafWithoutArgumentsRefusesThem(t *testing.T) {
	var leaves, withArgs []*cobra.Command
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		if !c.HasSubCommands() {
			if usesPositional(c.Use) {
				withArgs = append(withArgs, c)
			} else {
				leaves = append(leaves, c)
			}
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(newRoot())
	if len(leaves) < 20 || len(withArgs) < 5 {
		t.Fatalf("found %d leaves without and %d with arguments; the walk is broken", len(leaves), len(withArgs))
	}
	for _, c := range leaves {
		name := c.CommandPath()
		if err := c.ValidateArgs(nil); err != nil {
			t.Errorf("%s without arguments: %v", name, err)
		}
		for _, args := range [][]string{{"extra"}, {"extra", "more"}} {
			err := c.ValidateArgs(args)
			want := `"` + name + `" takes no arguments; got the argument`
			if len(args) > 1 {
				want += `s "extra" "more"`
			} else {
				want += ` "extra"`
			}
			if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), name+" --help") {
				t.Errorf("%s %s: %v, want an error containing %q and pointing at %s --help", name, strings.Join(args, " "), err, want, name)
			}
		}
	}
	for _, c := range withArgs {
		if err := c.ValidateArgs([]string{"extra"}); err != nil {
			t.Errorf("%s (Use %q) takes an argument but refused one: %v", c.CommandPath(), c.Use, err)
		}
	}
	// End to end, through Execute: refused before anything runs, exit 1 with the message.
	root := newRoot()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs([]string{"status", "extra"})
	if err := root.Execute(); err == nil || errorMessage(err) != `quotad: "quotad status" takes no arguments; got the argument "extra" (options are flags starting with --: see quotad status --help)` {
		t.Errorf("quotad status extra: %v", err)
	}
}

// usesPositional reports whether a command's Use names a positional argument: a word after the
// command's name that is neither a flag nor a flag's value.
func usesPositional(use string) bool {
	words := strings.Fields(use)
	for i := 1; i < len(words); i++ {
		words[i] = strings.TrimLeft(words[i], "([") // a group of flags: (--a X | --b Y)
		if words[i] == "|" {
			continue
		}
		if strings.HasPrefix(words[i], "-") {
			if !strings.Contains(words[i], "=") && i+1 < len(words) && !strings.HasPrefix(words[i+1], "-") {
				i++ // the flag's value
			}
			continue
		}
		return true
	}
	return false
}

// TestArgumentCountErrorsNameWhatIsTaken: a command that takes one argument (or at least one)
// given the wrong number says what it takes and what it got, not cobra's "accepts 1 arg(s),
// received 2"; nothing runs.
func TestArgumentCountErrorsNameWhatIsTaken(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"snapshot", "save", "a", "b"}, `quotad: "quotad snapshot save" takes 1 argument, FILE; got 2: "a" "b" (see quotad snapshot save --help)`},
		{[]string{"members", "remove"}, `quotad: "quotad members remove" takes 1 argument, ID; got none (see quotad members remove --help)`},
		{[]string{"token", "revoke", "x", "y"}, `quotad: "quotad token revoke" takes 1 argument, ACCESSOR; got 2: "x" "y" (see quotad token revoke --help)`},
		{[]string{"limits", "delete"}, `quotad: "quotad limits delete" takes at least one argument, DOMAIN...; got none (see quotad limits delete --help)`},
	} {
		root := newRoot()
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetErr(&out)
		root.SetArgs(tc.args)
		if err := root.Execute(); err == nil || errorMessage(err) != tc.want {
			t.Errorf("quotad %s: %v\nwant %s", strings.Join(tc.args, " "), err, tc.want)
		}
	}
}
