package deploy

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/pflag"
	"gopkg.in/yaml.v3"

	"github.com/quotad/quotad/config"
	"github.com/quotad/quotad/internal/agentconfig"
)

// secretEnv are the QUOTAD_* variables that carry a secret itself rather than set a flag.
var secretEnv = map[string]bool{"QUOTAD_GOSSIP_KEY": true, "QUOTAD_BOOTSTRAP_TOKEN": true}

// binaryFlagSet is a flag set with every flag `quotad agent --help` lists (all as strings:
// the keys are checked, the values are the binary's business).
func binaryFlagSet(t *testing.T) *pflag.FlagSet {
	t.Helper()
	if len(agentFlags) < 30 {
		t.Fatalf("quotad agent --help listed only %d flags", len(agentFlags))
	}
	fs := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	for name := range agentFlags {
		fs.String(name, "", "")
	}
	return fs
}

// checkAgentArgs checks that every --flag of a `quotad agent` command line is accepted by the
// binary, and returns the command line's flag values.
func checkAgentArgs(t *testing.T, where string, args []string) map[string]string {
	t.Helper()
	i := slices.Index(args, "agent")
	if i < 0 {
		t.Fatalf("%s: %q does not run `quotad agent`", where, args)
	}
	vals := map[string]string{}
	for j := i + 1; j < len(args); j++ {
		a := args[j]
		if !strings.HasPrefix(a, "--") {
			t.Errorf("%s: stray argument %q", where, a)
			continue
		}
		name, val, hasVal := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !agentFlags[name] {
			t.Errorf("%s: `quotad agent` has no flag --%s", where, name)
		}
		if !hasVal && j+1 < len(args) && !strings.HasPrefix(args[j+1], "--") {
			val = args[j+1]
			j++
		}
		vals[name] = val
	}
	return vals
}

// checkEnv checks that a QUOTAD_* variable names an agent flag and returns the flag.
func checkEnv(t *testing.T, where, name string) string {
	t.Helper()
	if !strings.HasPrefix(name, agentconfig.EnvPrefix) || secretEnv[name] {
		return ""
	}
	flag := strings.ToLower(strings.ReplaceAll(strings.TrimPrefix(name, agentconfig.EnvPrefix), "_", "-"))
	if !agentFlags[flag] {
		t.Errorf("%s: $%s sets no flag of `quotad agent` (there is no --%s)", where, name, flag)
	}
	return flag
}

// checkConfig parses an agent configuration file as the agent would (keys against the binary's
// flags) and returns its values.
func checkConfig(t *testing.T, where string, data []byte) map[string]string {
	t.Helper()
	fs := binaryFlagSet(t)
	if err := agentconfig.Apply(fs, writeTemp(t, data), nil); err != nil {
		t.Fatalf("%s: %v", where, err)
	}
	vals := map[string]string{}
	fs.Visit(func(f *pflag.Flag) { vals[f.Name] = f.Value.String() })
	return vals
}

func writeTemp(t *testing.T, data []byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "agent.yaml")
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// docs reads every YAML document of every file in dir.
func docs(t *testing.T, dir string) map[string]map[string]any {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in %s: %v", dir, err)
	}
	out := map[string]map[string]any{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		dec := yaml.NewDecoder(bytes.NewReader(b))
		for {
			var d map[string]any
			if err := dec.Decode(&d); errors.Is(err, io.EOF) {
				break
			} else if err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			if d == nil {
				continue
			}
			kind, name := str(d, "kind"), str(d, "metadata", "name")
			if kind == "" || name == "" || str(d, "apiVersion") == "" {
				t.Fatalf("%s: a document without apiVersion, kind or metadata.name", f)
			}
			out[kind+"/"+name] = d
		}
	}
	return out
}

// get walks maps by key and lists by index ("0").
func get(v any, keys ...string) any {
	for _, k := range keys {
		switch x := v.(type) {
		case map[string]any:
			v = x[k]
		case []any:
			var i int
			if _, err := fmt.Sscan(k, &i); err != nil || i >= len(x) {
				return nil
			}
			v = x[i]
		default:
			return nil
		}
	}
	return v
}

func str(v any, keys ...string) string {
	if s, ok := get(v, keys...).(string); ok {
		return s
	}
	if x := get(v, keys...); x != nil {
		return fmt.Sprint(x)
	}
	return ""
}

func list(v any, keys ...string) []any {
	l, _ := get(v, keys...).([]any)
	return l
}

// TestKubernetesManifests parses every manifest in deploy/kubernetes and checks it against the
// binary: every `quotad agent` flag and QUOTAD_* variable, every agent.yaml key; the probes
// and ports against the addresses the flags set; the services, the disruption budget, the
// volumes and mounts against the StatefulSet.
func TestKubernetesManifests(t *testing.T) {
	m := docs(t, "kubernetes")
	sts, ok := m["StatefulSet/quotad"]
	if !ok {
		t.Fatalf("no StatefulSet quotad in %v", keys(m))
	}
	if r := str(sts, "spec", "replicas"); r != "3" {
		t.Errorf("replicas %s, want 3", r)
	}
	if p := str(sts, "spec", "podManagementPolicy"); p != "Parallel" {
		t.Errorf("podManagementPolicy %q: a new cluster needs every pod running before any is ready (Parallel)", p)
	}
	podLabels := get(sts, "spec", "template", "metadata", "labels").(map[string]any)
	var grace int
	fmt.Sscan(str(sts, "spec", "template", "spec", "terminationGracePeriodSeconds"), &grace)
	if grace < 15 {
		t.Errorf("terminationGracePeriodSeconds %d: leave the leader time to hand over (>= 15)", grace)
	}
	c := get(sts, "spec", "template", "spec", "containers", "0")
	args := []string{}
	for _, a := range list(c, "args") {
		args = append(args, a.(string))
	}
	flags := checkAgentArgs(t, "statefulset args", args)
	env := map[string]string{}
	for _, e := range list(c, "env") {
		name := str(e, "name")
		if f := checkEnv(t, "statefulset env", name); f != "" {
			env[f] = str(e, "value")
		}
		if strings.Contains(strings.ToLower(name), "token") || strings.Contains(strings.ToLower(name), "key") {
			t.Errorf("env %s: secrets are mounted as files, not put in the environment", name)
		}
	}
	for _, a := range args {
		if strings.Contains(a, "token=") || strings.Contains(a, "BEGIN") {
			t.Errorf("argument %q looks like a secret on the command line", a)
		}
	}
	ports := map[string]int{}
	for _, p := range list(c, "ports") {
		var n int
		fmt.Sscan(str(p, "containerPort"), &n)
		ports[str(p, "name")] = n
	}

	// The configuration file the args name, from the ConfigMap mounted at its directory.
	cfgPath := flags["config"]
	mounts := map[string]string{} // mount path → volume name
	readOnly := map[string]bool{}
	for _, vm := range list(c, "volumeMounts") {
		mounts[str(vm, "mountPath")] = str(vm, "name")
		readOnly[str(vm, "mountPath")] = str(vm, "readOnly") == "true"
	}
	volumes := map[string]any{}
	for _, v := range list(sts, "spec", "template", "spec", "volumes") {
		volumes[str(v, "name")] = v
	}
	cmName := str(volumes[mounts[path.Dir(cfgPath)]], "configMap", "name")
	cm, ok := m["ConfigMap/"+cmName]
	if !ok {
		t.Fatalf("--config %s: no ConfigMap mounted at %s", cfgPath, path.Dir(cfgPath))
	}
	cfgText := str(cm, "data", path.Base(cfgPath))
	cfg := checkConfig(t, "ConfigMap "+cmName+" "+path.Base(cfgPath), []byte(cfgText))
	setting := func(name string) string { // flag > env > file
		if v, ok := flags[name]; ok {
			return v
		}
		if v, ok := env[name]; ok {
			return v
		}
		return cfg[name]
	}
	for _, name := range []string{"id", "data-dir", "grpc-addr", "raft-addr", "gossip-addr", "http-addr", "join", "tls-cert", "tls-key", "tls-ca", "gossip-key-file", "bootstrap-token-file"} {
		if setting(name) == "" {
			t.Errorf("--%s is not set (args, env or %s)", name, cfgPath)
		}
	}
	if setting("bootstrap-expect") != str(sts, "spec", "replicas") {
		t.Errorf("bootstrap-expect %q, replicas %s", setting("bootstrap-expect"), str(sts, "spec", "replicas"))
	}
	if setting("insecure") == "true" {
		t.Error("the manifests run --insecure")
	}
	// Addresses and ports.
	for flag, port := range map[string]string{"grpc-addr": "grpc", "raft-addr": "raft", "gossip-addr": "gossip-tcp", "http-addr": "https"} {
		if want := fmt.Sprintf(":%d", ports[port]); ports[port] == 0 || !strings.HasSuffix(setting(flag), want) {
			t.Errorf("--%s %q does not listen on container port %s (%d)", flag, setting(flag), port, ports[port])
		}
	}
	if ports["gossip-udp"] != ports["gossip-tcp"] {
		t.Errorf("gossip needs UDP and TCP on one port: %d/%d", ports["gossip-tcp"], ports["gossip-udp"])
	}
	// Readiness: /healthz over HTTPS on the --http-addr port; liveness on a port that exists.
	rp := get(c, "readinessProbe", "httpGet")
	if str(rp, "path") != "/healthz" || str(rp, "scheme") != "HTTPS" || ports[str(rp, "port")] == 0 {
		t.Errorf("readinessProbe %v: want GET /healthz over HTTPS on a named container port", rp)
	}
	if lp := str(c, "livenessProbe", "tcpSocket", "port"); lp != "" && ports[lp] == 0 {
		t.Errorf("livenessProbe port %q is not a container port", lp)
	}
	if get(c, "livenessProbe", "httpGet", "path") == "/healthz" {
		t.Error("livenessProbe on /healthz restarts every pod while quorum is lost")
	}
	// Files the settings name exist in their mounts: limits in the ConfigMap, secrets in the
	// Secret (read-only).
	if l := setting("limits"); l != "" {
		if str(cm, "data", path.Base(l)) == "" || mounts[path.Dir(l)] == "" {
			t.Errorf("--limits %s is not in a mounted ConfigMap", l)
		}
		if _, err := checkLimits(str(cm, "data", path.Base(l))); err != nil {
			t.Errorf("limits in the ConfigMap: %v", err)
		}
	}
	secret := m["Secret/"+str(volumes[mounts["/secrets"]], "secret", "secretName")]
	if secret == nil {
		t.Fatal("no Secret mounted at /secrets")
	}
	for _, name := range []string{"tls-cert", "tls-key", "tls-ca", "gossip-key-file", "bootstrap-token-file"} {
		p := setting(name)
		if !readOnly[path.Dir(p)] || get(secret, "stringData", path.Base(p)) == nil {
			t.Errorf("--%s %s: not a key of Secret %s mounted read-only at %s", name, p, str(secret, "metadata", "name"), path.Dir(p))
		}
	}
	// Data on the claim template.
	dataDir := setting("data-dir")
	vct := list(sts, "spec", "volumeClaimTemplates")
	if len(vct) != 1 || str(vct[0], "metadata", "name") != mounts[dataDir] {
		t.Errorf("--data-dir %s is mounted from %q, not from the volumeClaimTemplate", dataDir, mounts[dataDir])
	}
	// Services: headless for peers (published before ready), one for clients; every target
	// port is a container port; selectors match the pods.
	var headless, clientSvc bool
	for k, d := range m {
		if !strings.HasPrefix(k, "Service/") {
			continue
		}
		if !matches(get(d, "spec", "selector"), podLabels) {
			t.Errorf("%s selects %v, the pods are %v", k, get(d, "spec", "selector"), podLabels)
		}
		for _, p := range list(d, "spec", "ports") {
			if tp := str(p, "targetPort"); ports[tp] == 0 {
				t.Errorf("%s port %s targets %q, not a container port", k, str(p, "name"), tp)
			}
		}
		if str(d, "spec", "clusterIP") == "None" {
			headless = true
			if str(d, "metadata", "name") != str(sts, "spec", "serviceName") {
				t.Errorf("headless %s is not the StatefulSet's serviceName %s", k, str(sts, "spec", "serviceName"))
			}
			if str(d, "spec", "publishNotReadyAddresses") != "true" {
				t.Errorf("%s: peers must resolve before they are ready (publishNotReadyAddresses)", k)
			}
			if !strings.Contains(setting("join"), str(d, "metadata", "name")) {
				t.Errorf("--join %q does not use the headless service's names", setting("join"))
			}
		} else {
			clientSvc = true
		}
	}
	if !headless || !clientSvc {
		t.Errorf("want a headless peer Service and a client Service (headless %v, client %v)", headless, clientSvc)
	}
	pdb, ok := m["PodDisruptionBudget/quotad"]
	if !ok || !matches(get(pdb, "spec", "selector", "matchLabels"), podLabels) || str(pdb, "spec", "maxUnavailable") != "1" {
		t.Errorf("PodDisruptionBudget: %v", pdb)
	}
}

func keys(m map[string]map[string]any) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func matches(sel any, labels map[string]any) bool {
	s, ok := sel.(map[string]any)
	if !ok || len(s) == 0 {
		return false
	}
	for k, v := range s {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// TestSystemdUnit checks deploy/systemd against the binary: ExecStart's flags, the env file's
// QUOTAD_* variables, agent.yaml's keys; the hardening; that the data dir is the state
// directory and every credential the config names is loaded with LoadCredential.
func TestSystemdUnit(t *testing.T) {
	unit := readUnit(t, "systemd/quotad.service")
	exec := unit["ExecStart"]
	if len(exec) != 1 {
		t.Fatalf("ExecStart %q", exec)
	}
	flags := checkAgentArgs(t, "ExecStart", strings.Fields(exec[0]))
	if flags["config"] != "/etc/quotad/agent.yaml" {
		t.Errorf("ExecStart --config %q", flags["config"])
	}
	b, err := os.ReadFile("systemd/agent.yaml")
	if err != nil {
		t.Fatal(err)
	}
	cfg := checkConfig(t, "systemd/agent.yaml", b)
	envFile, err := os.ReadFile("systemd/quotad.env")
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{}
	for _, line := range strings.Split(string(envFile), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			t.Errorf("quotad.env: %q is not KEY=value", line)
			continue
		}
		if f := checkEnv(t, "quotad.env", k); f != "" {
			env[f] = v
		}
	}
	for _, name := range []string{"id", "grpc-addr", "raft-addr", "gossip-addr", "http-addr", "join"} {
		if env[name] == "" && cfg[name] == "" {
			t.Errorf("--%s is set neither in quotad.env nor in agent.yaml", name)
		}
	}
	for _, d := range []string{"ProtectSystem=strict", "NoNewPrivileges=yes", "StateDirectory=quotad", "ProtectHome=yes", "PrivateTmp=yes"} {
		k, v, _ := strings.Cut(d, "=")
		if !slices.Contains(unit[k], v) {
			t.Errorf("quotad.service lacks %s", d)
		}
	}
	if len(unit["LimitNOFILE"]) == 0 || (len(unit["User"]) == 0 && !slices.Contains(unit["DynamicUser"], "yes")) {
		t.Errorf("quotad.service: LimitNOFILE %v, User %v, DynamicUser %v", unit["LimitNOFILE"], unit["User"], unit["DynamicUser"])
	}
	if want := "/var/lib/" + unit["StateDirectory"][0]; cfg["data-dir"] != want {
		t.Errorf("data-dir %q is not the state directory %s (the only place the service can write)", cfg["data-dir"], want)
	}
	creds := map[string]bool{}
	for _, lc := range unit["LoadCredential"] {
		name, _, _ := strings.Cut(lc, ":")
		creds[name] = true
	}
	for _, name := range []string{"tls-cert", "tls-key", "tls-ca", "gossip-key-file", "bootstrap-token-file"} {
		p := cfg[name]
		dir, file := path.Split(p)
		if dir != "/run/credentials/quotad.service/" || !creds[file] {
			t.Errorf("--%s %q is not a LoadCredential of quotad.service", name, p)
		}
	}
	if unit["KillSignal"] != nil && unit["KillSignal"][0] != "SIGTERM" {
		t.Errorf("KillSignal %v: the agent hands leadership over on SIGTERM", unit["KillSignal"])
	}
}

// readUnit reads a systemd unit file: every key's values in order.
func readUnit(t *testing.T, file string) map[string][]string {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string][]string{}
	s := bufio.NewScanner(f)
	for s.Scan() {
		line := strings.TrimSpace(s.Text())
		if line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, "[") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			t.Errorf("%s: %q is not Key=value", file, line)
			continue
		}
		out[k] = append(out[k], v)
	}
	return out
}

// checkLimits parses a limits file as the agent does.
func checkLimits(yamlText string) (any, error) { return config.Parse("limits.yaml", []byte(yamlText)) }

// TestSystemdAnalyze runs systemd-analyze verify and the offline security assessment on the
// unit (with ExecStart pointing at the built binary), where systemd-analyze exists.
func TestSystemdAnalyze(t *testing.T) {
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("no systemd-analyze here")
	}
	b, err := os.ReadFile("systemd/quotad.service")
	if err != nil {
		t.Fatal(err)
	}
	unit := filepath.Join(t.TempDir(), "quotad.service")
	if err := os.WriteFile(unit, bytes.ReplaceAll(b, []byte("/usr/local/bin/quotad"), []byte(binary)), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(sa, "verify", unit)
	cmd.Env = append(os.Environ(), "SYSTEMD_LOG_LEVEL=warning")
	if out, err := cmd.CombinedOutput(); err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
	out, err := exec.Command(sa, "security", "--offline=yes", unit).CombinedOutput()
	if err != nil {
		t.Skipf("systemd-analyze security --offline not available: %v", err)
	}
	var level float64
	if i := bytes.Index(out, []byte("Overall exposure level for quotad.service: ")); i < 0 {
		t.Fatalf("no exposure level in:\n%s", out)
	} else if _, err := fmt.Sscan(string(out[i+len("Overall exposure level for quotad.service: "):]), &level); err != nil {
		t.Fatal(err)
	}
	t.Logf("systemd-analyze security: exposure %.1f", level)
	if level > 3 {
		t.Errorf("exposure level %.1f: the unit lost hardening (it was 1.6)", level)
	}
}
