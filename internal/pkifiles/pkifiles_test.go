package pkifiles

import (
	"crypto/tls"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/quotad/quotad/auth"
)

func TestEnsureLocalCreatesOnceWithPrivateModes(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "creds")
	l, err := EnsureLocal(dir, "quotad")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := auth.TokenAccessor(l.Token); err != nil {
		t.Fatalf("bootstrap token: %v", err)
	}
	cert, key, err := l.ServerCert("node1", "10.1.2.3", "n1.example")
	if err != nil {
		t.Fatal(err)
	}
	pair, err := tls.LoadX509KeyPair(cert, key)
	if err != nil {
		t.Fatal(err)
	}
	if err := pair.Leaf.VerifyHostname("10.1.2.3"); err != nil {
		t.Fatal(err)
	}
	if !auth.IsServerCert(pair.Leaf, "quotad") {
		t.Fatalf("node certificate without the server SAN: %v", pair.Leaf.DNSNames)
	}
	st, _ := os.Stat(dir)
	if st.Mode().Perm() != 0o700 {
		t.Errorf("dir mode %v", st.Mode().Perm())
	}
	for _, p := range []string{l.caKey, l.AdminKeyFile, l.GossipKeyFile, l.TokenFile, key} {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want 0600", p, st.Mode().Perm())
		}
	}
	again, err := EnsureLocal(dir, "quotad")
	if err != nil || again.Token != l.Token {
		t.Fatalf("second EnsureLocal changed the token or failed: %v", err)
	}
	args, err := l.AgentArgs("node1")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(strings.Join(args, " "), l.Token) {
		t.Fatal("the token is on the command line")
	}
	env := l.Env([]string{"127.0.0.1:7101", "127.0.0.1:7102"})
	for _, want := range []string{"QUOTAD_ADDR='127.0.0.1:7101,127.0.0.1:7102'", "QUOTAD_TOKEN='" + l.Token + "'", "QUOTAD_CACERT=", "QUOTAD_CLIENT_CERT=", "QUOTAD_CLIENT_KEY="} {
		if !strings.Contains(env, want) {
			t.Errorf("env lacks %q:\n%s", want, env)
		}
	}
}

func TestCreateCertRefusesPathNames(t *testing.T) {
	dir := t.TempDir()
	ca, caKey, err := CreateCA(dir, "quotad", 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := CreateCert(dir, ca, caKey, auth.CertOptions{Server: true, Cluster: "quotad", Name: "../x"}); err == nil {
		t.Fatal("a name with a path was accepted")
	}
	if _, _, err := CreateCA(dir, "quotad", 0); err == nil || !strings.Contains(err.Error(), "refusing to overwrite") {
		t.Fatalf("second CA in the same dir: %v", err)
	}
}
