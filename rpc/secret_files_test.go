package rpc_test

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestAgentWarnsAboutReadableSecretFiles: an agent whose node key, gossip key or bootstrap
// token file group or other can read still starts, and logs a warning for each, naming the
// flag, the file, its mode and `chmod 600 FILE`. The certificate and CA are not secrets.
func TestAgentWarnsAboutReadableSecretFiles(t *testing.T) {
	creds, err := pkifiles.EnsureLocal(filepath.Join(t.TempDir(), "creds"), rpc.DefaultClusterName)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile, err := creds.ServerCert("node0")
	if err != nil {
		t.Fatal(err)
	}
	modes := map[string]os.FileMode{keyFile: 0o644, creds.GossipKeyFile: 0o640, creds.TokenFile: 0o604, certFile: 0o644, creds.CAFile: 0o644}
	for p, m := range modes {
		if err := os.Chmod(p, m); err != nil {
			t.Fatal(err)
		}
	}
	var logs syncBuffer
	rpctest.Start(t, 1, "", rpctest.Secure(t, creds), func(_ int, cfg *rpc.AgentConfig) {
		cfg.GossipKeyFile = creds.GossipKeyFile
		cfg.Cluster.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	out := logs.String()
	for _, want := range []string{
		"--tls-key " + keyFile + " is mode 0644", "chmod 600 " + keyFile,
		"--gossip-key-file " + creds.GossipKeyFile + " is mode 0640", "chmod 600 " + creds.GossipKeyFile,
		"--bootstrap-token-file " + creds.TokenFile + " is mode 0604", "chmod 600 " + creds.TokenFile,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("agent log does not say %q:\n%s", want, out)
		}
	}
	for _, p := range []string{certFile, creds.CAFile} {
		if strings.Contains(out, p+" is mode") {
			t.Errorf("warned about %s, which is not a secret:\n%s", p, out)
		}
	}
}

// A private secret file is not reported.
func TestLooseSecretsQuietForPrivateFiles(t *testing.T) {
	p := filepath.Join(t.TempDir(), "gossip.key")
	if err := os.WriteFile(p, []byte("k\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := pkifiles.LooseSecrets(map[string]string{"--gossip-key-file": p, "--tls-key": ""}); len(got) != 0 {
		t.Fatalf("LooseSecrets = %v, want none", got)
	}
}
