// Package agentconfig fills the flags of `quotad agent` from a configuration file and from
// environment variables, so that every flag — including flags added later — can be set in
// all three places without a list to keep in step.
//
// Precedence, highest first: a flag on the command line, the environment variable
// QUOTAD_<FLAG> (upper case, '-' → '_': --data-dir is $QUOTAD_DATA_DIR), the configuration
// file, the flag's default.
//
// The file is YAML: a mapping from flag names (without "--") to values, written as they would
// be on the command line. A list may be given where a flag takes a comma-separated list
// (join). Unknown keys, repeated keys and values a flag refuses are errors naming the file,
// the line and the key.
//
//	id: n1
//	data-dir: /var/lib/quotad
//	join: [10.0.0.2:7301, 10.0.0.3:7301]
//	raft-heartbeat-timeout: 1s
//	enable-debug: false
package agentconfig

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/spf13/pflag"
	"gopkg.in/yaml.v3"
)

// EnvPrefix starts every environment variable that sets an agent flag.
const EnvPrefix = "QUOTAD_"

// FileFlag is the flag naming the configuration file; it cannot be set in the file itself
// ($QUOTAD_CONFIG names the file when the flag is not given).
const FileFlag = "config"

// EnvName returns the environment variable that sets flag name: QUOTAD_DATA_DIR for data-dir.
func EnvName(name string) string {
	return EnvPrefix + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// Settable reports whether a flag can be set from a file or the environment (every flag but
// --config and --help).
func Settable(f *pflag.Flag) bool { return f.Name != FileFlag && f.Name != "help" }

// Apply sets every flag of fs that the command line did not set (fs must be parsed): from
// environ's QUOTAD_<FLAG> if present, else from the configuration file if it has the key.
// file "" means no file. environ is os.Environ()'s format ("KEY=value").
func Apply(fs *pflag.FlagSet, file string, environ []string) error {
	fromFile := map[string]fileValue{}
	if file != "" {
		var err error
		if fromFile, err = ReadFile(fs, file); err != nil {
			return err
		}
	}
	env := map[string]string{}
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok && strings.HasPrefix(k, EnvPrefix) {
			env[k] = v
		}
	}
	var errs []error
	fs.VisitAll(func(f *pflag.Flag) {
		if !Settable(f) || f.Changed {
			return
		}
		if v, ok := env[EnvName(f.Name)]; ok {
			if err := fs.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("$%s=%q (sets --%s): %v", EnvName(f.Name), v, f.Name, err))
			}
			return
		}
		if v, ok := fromFile[f.Name]; ok {
			if err := fs.Set(f.Name, v.value); err != nil {
				errs = append(errs, fmt.Errorf("%s:%d: key %q: value %q: %v", file, v.line, f.Name, v.value, err))
			}
		}
	})
	return errors.Join(errs...)
}

// UnknownEnv returns a warning for each variable of environ that starts with EnvPrefix but
// sets no settable flag of fs and is not one of known (variables quotad reads elsewhere:
// $QUOTAD_CONFIG, credentials, client settings), with the closest name it may have meant:
// a misspelled $QUOTAD_DATADIR is otherwise ignored without a word, and the agent then
// complains that --data-dir is missing. Sorted; nil if every variable is known.
func UnknownEnv(fs *pflag.FlagSet, environ []string, known ...string) []string {
	names := map[string]bool{EnvName(FileFlag): true}
	for _, k := range known {
		names[k] = true
	}
	fs.VisitAll(func(f *pflag.Flag) {
		if Settable(f) {
			names[EnvName(f.Name)] = true
		}
	})
	sorted := make([]string, 0, len(names))
	for n := range names {
		sorted = append(sorted, n)
	}
	sort.Strings(sorted)
	var out []string
	for _, kv := range environ {
		k, _, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(k, EnvPrefix) || names[k] {
			continue
		}
		best, bestD := "", 3
		norm := strings.ToUpper(strings.ReplaceAll(k, "-", "_"))
		for _, n := range sorted {
			if d := distance(norm, n); d < bestD {
				best, bestD = n, d
			}
		}
		if best != "" {
			out = append(out, fmt.Sprintf("$%s is not a quotad setting and is ignored (did you mean $%s?)", k, best))
		} else {
			out = append(out, fmt.Sprintf("$%s is not a quotad setting and is ignored (the agent reads $%s<FLAG> for each flag, e.g. $%s)", k, EnvPrefix, EnvName("data-dir")))
		}
	}
	sort.Strings(out)
	return out
}

// fileValue is one setting read from the file.
type fileValue struct {
	value string
	line  int
}

// ReadFile parses a configuration file against fs's flags: every key must name a settable
// flag. It returns the values by flag name.
func ReadFile(fs *pflag.FlagSet, file string) (map[string]fileValue, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("--config: %w", err)
	}
	return Parse(fs, file, data)
}

// Parse is ReadFile of data already read (name is used in messages).
func Parse(fs *pflag.FlagSet, name string, data []byte) (map[string]fileValue, error) {
	out := map[string]fileValue{}
	if len(bytes.TrimSpace(data)) == 0 {
		return out, nil
	}
	var doc yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); errors.Is(err, io.EOF) {
		return out, nil // comments only
	} else if err != nil {
		return nil, fmt.Errorf("%s: not valid YAML: %v", name, err)
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); err == nil {
		return nil, fmt.Errorf("%s:%d: a second YAML document; an agent configuration file holds one mapping", name, extra.Line)
	}
	if len(doc.Content) == 0 {
		return out, nil
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return nil, fmt.Errorf("%s:%d: want a mapping of flag names to values (e.g. \"data-dir: /var/lib/quotad\")", name, root.Line)
	}
	var errs []error
	for i := 0; i+1 < len(root.Content); i += 2 {
		k, v := root.Content[i], root.Content[i+1]
		key := k.Value
		f := fs.Lookup(key)
		switch {
		case f == nil || !Settable(f):
			errs = append(errs, fmt.Errorf("%s:%d: unknown key %q%s", name, k.Line, key, suggest(fs, key)))
			continue
		}
		if prev, dup := out[key]; dup {
			errs = append(errs, fmt.Errorf("%s:%d: key %q repeated (first on line %d)", name, k.Line, key, prev.line))
			continue
		}
		if list := resolve(v); list.Kind == yaml.SequenceNode && !takesList(f) {
			errs = append(errs, fmt.Errorf("%s:%d: key %q: a list, but --%s takes one value; write it as %s: VALUE", name, v.Line, key, key, key))
			continue
		}
		val, err := scalar(v)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s:%d: key %q: %v", name, v.Line, key, err))
			continue
		}
		out[key] = fileValue{value: val, line: k.Line}
	}
	return out, errors.Join(errs...)
}

// resolve follows aliases to the node they name.
func resolve(v *yaml.Node) *yaml.Node {
	for v.Kind == yaml.AliasNode && v.Alias != nil {
		v = v.Alias
	}
	return v
}

// takesList reports whether a flag takes several values: a slice or array flag, or a string
// flag whose usage says it is comma-separated (--join, --global-addrs). A list for any other
// flag was joined with commas into one value (data-dir: [a, b] made a data dir "a,b").
func takesList(f *pflag.Flag) bool {
	t := f.Value.Type()
	return strings.HasSuffix(t, "Slice") || strings.HasSuffix(t, "Array") || strings.Contains(f.Usage, "comma-separated")
}

// scalar turns a YAML value into the string the flag would get on the command line: a scalar
// as written, a list of scalars joined with commas, null as "".
func scalar(v *yaml.Node) (string, error) {
	switch v.Kind {
	case yaml.ScalarNode:
		if v.Tag == "!!null" {
			return "", nil
		}
		return v.Value, nil
	case yaml.SequenceNode:
		parts := make([]string, 0, len(v.Content))
		for _, e := range v.Content {
			if e.Kind != yaml.ScalarNode {
				return "", fmt.Errorf("a list of plain values is expected")
			}
			parts = append(parts, e.Value)
		}
		return strings.Join(parts, ","), nil
	case yaml.AliasNode:
		return scalar(v.Alias)
	}
	return "", fmt.Errorf("want a value such as \"5s\", \"true\" or a list, not a mapping")
}

// suggest names the flag a mistyped key probably meant.
func suggest(fs *pflag.FlagSet, key string) string {
	norm := strings.ToLower(strings.NewReplacer("_", "-", ".", "-", " ", "-").Replace(strings.TrimLeft(key, "-")))
	if f := fs.Lookup(norm); f != nil && Settable(f) && norm != key {
		return fmt.Sprintf(" (did you mean %q?)", norm)
	}
	best, bestD := "", 3
	var names []string
	fs.VisitAll(func(f *pflag.Flag) {
		if Settable(f) {
			names = append(names, f.Name)
		}
	})
	sort.Strings(names)
	for _, n := range names {
		if d := distance(norm, n); d < bestD {
			best, bestD = n, d
		}
	}
	if best != "" {
		return fmt.Sprintf(" (did you mean %q?)", best)
	}
	return "; the keys are the flags of `quotad agent --help` without \"--\""
}

// distance is the Levenshtein distance of a and b.
func distance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}

// RefuseRepeats makes every flag of fs that takes one value refuse a second value: given
// twice on the command line (`--data-dir /a … --data-dir /b`, a unit's ExecStart plus a
// drop-in, args appended to a manifest), pflag would let the last one win without a word, as
// a repeated key in the file is refused. Flags that take lists (slices, arrays) may repeat.
// Call it once the flags are defined, before parsing; Apply sets each flag at most once.
func RefuseRepeats(fs *pflag.FlagSet) {
	fs.VisitAll(func(f *pflag.Flag) {
		t := f.Value.Type()
		if strings.HasSuffix(t, "Slice") || strings.HasSuffix(t, "Array") || strings.Contains(t, "To") {
			return
		}
		if _, done := f.Value.(*onceValue); !done {
			f.Value = &onceValue{Value: f.Value}
		}
	})
}

// onceValue is a flag value that can be set once.
type onceValue struct {
	pflag.Value
	set   bool
	first string
}

func (o *onceValue) Set(s string) error {
	if o.set {
		return fmt.Errorf("the flag is given twice (first %q): give it once; a flag on the command line wins over $QUOTAD_<FLAG> and the --config file anyway", o.first)
	}
	if err := o.Value.Set(s); err != nil {
		return err
	}
	o.set, o.first = true, s
	return nil
}

// PathAnnotation marks a flag whose value is a file system path (MarkPaths).
const PathAnnotation = "quotad_path"

// MarkPaths marks the named flags of fs as taking file system paths, for RelativePaths. It
// panics on a name fs does not have (a programming error).
func MarkPaths(fs *pflag.FlagSet, names ...string) {
	for _, n := range names {
		if err := fs.SetAnnotation(n, PathAnnotation, []string{"true"}); err != nil {
			panic(err)
		}
	}
}

// RelativePaths returns a warning for each path flag (MarkPaths) that the configuration file
// gives a relative path: the agent resolves it against its working directory — / under
// systemd and in most containers — not against the file's directory, so `limits: limits.yaml`
// next to agent.yaml is not found, and a relative data-dir is a different, empty data dir
// whenever the agent starts from another directory. wd is the working directory. Sorted by
// line; nil without a file or if the file cannot be read (Apply reports that).
func RelativePaths(fs *pflag.FlagSet, file, wd string) []string {
	if file == "" {
		return nil
	}
	vals, err := ReadFile(fs, file)
	if err != nil {
		return nil
	}
	type rel struct {
		line int
		msg  string
	}
	var rels []rel
	for name, v := range vals {
		f := fs.Lookup(name)
		if f == nil || f.Annotations[PathAnnotation] == nil || v.value == "" || filepath.IsAbs(v.value) {
			continue
		}
		rels = append(rels, rel{v.line, fmt.Sprintf("%s:%d: %s: %q is a relative path: the agent resolves it against its working directory (%s), not the directory of %s, so it means %s; write an absolute path",
			file, v.line, name, v.value, wd, file, filepath.Join(wd, v.value))})
	}
	sort.Slice(rels, func(i, j int) bool { return rels[i].line < rels[j].line })
	out := make([]string, len(rels))
	for i, r := range rels {
		out[i] = r.msg
	}
	return out
}
