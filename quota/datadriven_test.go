package quota

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the expected output in testdata/*.txt")

// TestScripts runs the engine scripts in testdata/*.txt. Each block is a command line, an
// optional body, "----", and the expected output up to a blank line; lines starting with # between
// blocks are comments. Run with -rewrite to regenerate the expected output.
//
// Commands (times are durations since 0, e.g. t=1.5s; words without "=" are flags):
//
//	limits                     body: "domain NAME [attrs]" and nodes indented two spaces per
//	                           level: "key[=value] [attrs]"; attrs: rate=N/UNIT burst=N
//	                           conc=N/TTL shadow unlimited
//	acquire t= domain= [k=v...] [cost=N] [ttl=D]
//	refund t= cost=N [keys=a,b]   keys default to the last admitted decision's charges
//	release t= lease=N
//	renew t= lease=N [ttl=D]
//	pause t= domain= [k=v...] until=D
//	resume t= domain= [k=v...]
//	tick t=
//	status t= domain= [k=v...]
//	stats
//	snapshot                   marshal, unmarshal into a fresh engine, check Hash, continue with it
func TestScripts(t *testing.T) {
	files, err := filepath.Glob("testdata/*.txt")
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata scripts: %v", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) { runScript(t, f) })
	}
}

type scriptBlock struct {
	lead     string // comments and blank lines before the block, verbatim
	cmd      string
	body     []string
	expected string
	line     int
}

func parseScript(t *testing.T, path string) (blocks []scriptBlock, tail string) {
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(data), "\n")
	var lead strings.Builder
	for i := 0; i < len(lines); {
		l := lines[i]
		if strings.TrimSpace(l) == "" || strings.HasPrefix(l, "#") {
			if i < len(lines)-1 || l != "" {
				lead.WriteString(l + "\n")
			}
			i++
			continue
		}
		b := scriptBlock{lead: lead.String(), cmd: l, line: i + 1}
		lead.Reset()
		i++
		for i < len(lines) && lines[i] != "----" {
			if strings.TrimSpace(lines[i]) == "" {
				t.Fatalf("%s:%d: blank line before ---- in block %q", path, i+1, b.cmd)
			}
			b.body = append(b.body, lines[i])
			i++
		}
		if i == len(lines) {
			t.Fatalf("%s:%d: block %q has no ----", path, b.line, b.cmd)
		}
		i++
		var exp []string
		for i < len(lines) && lines[i] != "" {
			exp = append(exp, lines[i])
			i++
		}
		b.expected = strings.Join(exp, "\n")
		blocks = append(blocks, b)
	}
	return blocks, lead.String()
}

func runScript(t *testing.T, path string) {
	blocks, tail := parseScript(t, path)
	s := &scriptState{e: NewEngine()}
	var out strings.Builder
	for _, b := range blocks {
		got := strings.TrimRight(s.run(t, b), "\n")
		if *rewrite {
			out.WriteString(b.lead + b.cmd + "\n")
			for _, l := range b.body {
				out.WriteString(l + "\n")
			}
			out.WriteString("----\n" + got + "\n")
			continue
		}
		if got != b.expected {
			t.Errorf("%s:%d: %s\ngot:\n%s\nwant:\n%s", path, b.line, b.cmd, got, b.expected)
		}
	}
	if *rewrite {
		out.WriteString(tail)
		if err := os.WriteFile(path, []byte(out.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

type scriptState struct {
	e           *Engine
	lastCharges []string
	lastSeq     uint64
}

type scriptArgs struct {
	t       Time
	named   map[string]string
	entries []Entry
	flags   []string
}

// reserved argument names; every other k=v is a descriptor entry, in order.
var reservedArgs = map[string]bool{"t": true, "domain": true, "cost": true, "ttl": true,
	"lease": true, "until": true, "keys": true}

func parseArgs(t *testing.T, fields []string) scriptArgs {
	a := scriptArgs{named: map[string]string{}}
	for _, f := range fields {
		k, v, ok := strings.Cut(f, "=")
		switch {
		case !ok:
			a.flags = append(a.flags, f)
		case reservedArgs[k]:
			a.named[k] = v
		default:
			a.entries = append(a.entries, Entry{Key: k, Value: v})
		}
	}
	if v, ok := a.named["t"]; ok {
		a.t = Time(mustDuration(t, v))
	}
	return a
}

func mustDuration(t *testing.T, s string) time.Duration {
	t.Helper()
	d, err := time.ParseDuration(s)
	if err != nil {
		t.Fatalf("bad duration %q: %v", s, err)
	}
	return d
}

func mustUint(t *testing.T, s string) uint64 {
	t.Helper()
	if s == "" {
		return 0
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		t.Fatalf("bad number %q: %v", s, err)
	}
	return n
}

func (s *scriptState) run(t *testing.T, b scriptBlock) string {
	fields := strings.Fields(b.cmd)
	a := parseArgs(t, fields[1:])
	e := s.e
	switch fields[0] {
	case "limits":
		l, err := parseLimitsDSL(b.body)
		if err != nil {
			return "parse error: " + err.Error()
		}
		if err := e.SetLimits(a.t, l); err != nil {
			return "error: " + err.Error()
		}
		return fmt.Sprintf("version=%d", e.Limits().Version)
	case "acquire":
		req := Request{Domain: a.named["domain"], Descriptors: a.entries, Cost: mustUint(t, a.named["cost"])}
		if v, ok := a.named["ttl"]; ok {
			req.LeaseTTL = mustDuration(t, v)
		}
		d := e.Acquire(a.t, req)
		if d.Admitted {
			s.lastCharges, s.lastSeq = d.Charges, d.DebitSeq
		}
		return formatDecision(d)
	case "refund":
		keys := s.lastCharges
		if v, ok := a.named["keys"]; ok {
			keys = strings.Split(v, ",")
		}
		r := e.Refund(a.t, keys, mustUint(t, a.named["cost"]), s.lastSeq)
		return fmt.Sprintf("restored=%d kept=%d", r.Restored, r.Kept)
	case "release":
		return fmt.Sprint(e.Release(a.t, mustUint(t, a.named["lease"])))
	case "renew":
		var ttl time.Duration
		if v, ok := a.named["ttl"]; ok {
			ttl = mustDuration(t, v)
		}
		got, err := e.Renew(a.t, mustUint(t, a.named["lease"]), ttl)
		if err != nil {
			return "error: " + err.Error()
		}
		return fmt.Sprintf("ttl=%v", got)
	case "pause":
		scope, err := e.Pause(a.t, a.named["domain"], a.entries, Time(mustDuration(t, a.named["until"])))
		if err != nil {
			return "error: " + err.Error()
		}
		return "scope=" + scope
	case "resume":
		ok, err := e.Resume(a.t, a.named["domain"], a.entries)
		if err != nil {
			return "error: " + err.Error()
		}
		return fmt.Sprint(ok)
	case "tick":
		e.Tick(a.t)
		return formatStats(e.Stats())
	case "stats":
		return fmt.Sprintf("version=%d %s", e.Stats().LimitsVersion, formatStats(e.Stats()))
	case "status":
		sts, err := e.Status(a.t, a.named["domain"], a.entries)
		if err != nil {
			return "error: " + err.Error()
		}
		var sb strings.Builder
		for _, st := range sts {
			fmt.Fprintf(&sb, "%s key=%s", st.Scope, st.Key)
			if st.Window != 0 {
				fmt.Fprintf(&sb, " limit=%d/%v burst=%d remaining=%d reset=%v", st.Limit, st.Window, st.Burst, st.Remaining, st.ResetAfter)
			}
			if st.MaxInFlight != 0 {
				fmt.Fprintf(&sb, " inflight=%d/%d", st.InFlight, st.MaxInFlight)
			}
			if st.PausedFor != 0 {
				fmt.Fprintf(&sb, " paused=%v", st.PausedFor)
			}
			sb.WriteString("\n")
		}
		return sb.String()
	case "snapshot":
		data, err := e.MarshalBinary()
		if err != nil {
			return "error: " + err.Error()
		}
		n := NewEngine()
		if err := n.UnmarshalBinary(data); err != nil {
			return "error: " + err.Error()
		}
		if n.Hash() != e.Hash() {
			t.Errorf("%d: snapshot changed the hash: %x -> %x", b.line, e.Hash(), n.Hash())
		}
		s.e = n
		return "restored " + formatStats(n.Stats())
	}
	t.Fatalf("line %d: unknown command %q", b.line, fields[0])
	return ""
}

func formatStats(st Stats) string {
	return fmt.Sprintf("buckets=%d leases=%d pauses=%d", st.Buckets, st.Leases, st.Pauses)
}

func formatDecision(d Decision) string {
	var sb strings.Builder
	if d.Admitted {
		sb.WriteString("admitted")
	} else {
		sb.WriteString("denied " + string(d.Reason))
	}
	if d.Scope != "" {
		sb.WriteString(" scope=" + d.Scope)
	}
	if d.Window != 0 {
		fmt.Fprintf(&sb, " limit=%d/%v remaining=%d reset=%v", d.Limit, d.Window, d.Remaining, d.ResetAfter)
	} else if d.Limit != 0 {
		fmt.Fprintf(&sb, " limit=%d remaining=%d", d.Limit, d.Remaining)
	}
	if d.RetryAfter != 0 {
		fmt.Fprintf(&sb, " retry=%v", d.RetryAfter)
	}
	if d.LeaseID != 0 {
		fmt.Fprintf(&sb, " lease=%d ttl=%v", d.LeaseID, d.LeaseTTL)
	}
	if len(d.Charges) > 0 {
		fmt.Fprintf(&sb, " charges=%s", strings.Join(d.Charges, ","))
	}
	if len(d.ShadowDenials) > 0 {
		fmt.Fprintf(&sb, " shadow=%s", strings.Join(d.ShadowDenials, ","))
	}
	if d.Message != "" {
		fmt.Fprintf(&sb, " msg=%q", d.Message)
	}
	return sb.String()
}

// parseLimitsDSL parses the tiny limits language used by the scripts (see TestScripts).
func parseLimitsDSL(lines []string) (*Limits, error) {
	l := &Limits{}
	// stack[i] points at the children slice of the node at depth i (depth 0: the domain).
	var stack []*[]Node
	for _, line := range lines {
		trimmed := strings.TrimLeft(line, " ")
		indent := len(line) - len(trimmed)
		if indent%2 != 0 {
			return nil, fmt.Errorf("odd indentation in %q", line)
		}
		depth := indent / 2
		f := strings.Fields(trimmed)
		if depth == 0 {
			if f[0] != "domain" || len(f) < 2 {
				return nil, fmt.Errorf("want \"domain NAME ...\", got %q", line)
			}
			d := Domain{Name: f[1]}
			var n Node
			if err := parseAttrs(f[2:], &n); err != nil {
				return nil, err
			}
			d.Rate, d.Concurrency = n.Rate, n.Concurrency
			l.Domains = append(l.Domains, d)
			stack = []*[]Node{&l.Domains[len(l.Domains)-1].Descriptors}
			continue
		}
		if depth > len(stack) {
			return nil, fmt.Errorf("indentation jumps a level in %q", line)
		}
		stack = stack[:depth]
		var n Node
		n.Key, n.Value, _ = strings.Cut(f[0], "=")
		if err := parseAttrs(f[1:], &n); err != nil {
			return nil, err
		}
		parent := stack[depth-1]
		*parent = append(*parent, n)
		stack = append(stack, &(*parent)[len(*parent)-1].Children)
	}
	return l, nil
}

func parseAttrs(fields []string, n *Node) error {
	for _, f := range fields {
		k, v, _ := strings.Cut(f, "=")
		switch k {
		case "rate":
			num, unit, ok := strings.Cut(v, "/")
			rpu, err1 := strconv.ParseUint(num, 10, 64)
			d, err2 := time.ParseDuration(unit)
			if !ok || err1 != nil || err2 != nil {
				return fmt.Errorf("bad rate %q (want N/DURATION)", v)
			}
			if n.Rate == nil {
				n.Rate = &Rate{}
			}
			n.Rate.RequestsPerUnit, n.Rate.Unit = rpu, d
		case "burst":
			b, err := strconv.ParseUint(v, 10, 64)
			if err != nil || n.Rate == nil {
				return fmt.Errorf("bad burst %q (put it after rate=)", v)
			}
			n.Rate.Burst = b
		case "conc":
			num, ttl, ok := strings.Cut(v, "/")
			m, err1 := strconv.ParseUint(num, 10, 64)
			d, err2 := time.ParseDuration(ttl)
			if !ok || err1 != nil || err2 != nil {
				return fmt.Errorf("bad conc %q (want N/TTL)", v)
			}
			n.Concurrency = &Concurrency{MaxInFlight: m, LeaseTTL: d}
		case "shadow":
			n.ShadowMode = true
		case "unlimited":
			n.Unlimited = true
		default:
			return fmt.Errorf("unknown attribute %q", f)
		}
	}
	return nil
}
