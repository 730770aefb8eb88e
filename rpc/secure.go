package rpc

import (
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"

	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/internal/pkifiles"
)

// DefaultClusterName is the cluster name when none is configured (--cluster-name).
const DefaultClusterName = "quotad"

// EnvBootstrapToken holds the bootstrap admin token when no --bootstrap-token-file is given.
const EnvBootstrapToken = "QUOTAD_BOOTSTRAP_TOKEN"

// insecureWarning is logged at every start of an agent run with --insecure.
const insecureWarning = "RUNNING INSECURE (--insecure): the gRPC API, HTTP and Raft are plaintext, gossip may be " +
	"unencrypted, and calls without credentials act as admin — anyone who can reach a port can read and change " +
	"limits, spend any quota, join as a peer and forge Raft traffic. Use only for a throwaway cluster on a trusted " +
	"network; see `quotad tls ca create --help`."

// howToSecure tells an operator how to make what a secure agent needs.
const howToSecure = `make them once per cluster and node:
  quotad tls ca create                                  # quotad-ca.pem, quotad-ca-key.pem (keep the key off the nodes)
  quotad tls cert create --server --name <node-id> [--dns <host>] [--ip <addr>]
                                                        # <node-id>.pem, <node-id>-key.pem (one per node)
  quotad keygen --out gossip.key                        # the same gossip key on every node
  quotad keygen --token --out bootstrap.token           # optional: a bootstrap admin token
then start each node with
  --tls-cert <node-id>.pem --tls-key <node-id>-key.pem --tls-ca quotad-ca.pem --gossip-key-file gossip.key [--bootstrap-token-file bootstrap.token]
or, for a throwaway cluster on a trusted network only, --insecure (` + "`quotad dev`" + ` does all of this for a local cluster)`

// CheckSecurity reports what a secure agent lacks (TLS files, gossip key), with how to make
// it; nil with Insecure. StartAgent calls it first.
func (c AgentConfig) CheckSecurity() error {
	if c.Insecure {
		return nil
	}
	var missing []string
	for _, f := range []struct{ flag, val string }{{"--tls-cert", c.TLS.CertFile}, {"--tls-key", c.TLS.KeyFile}, {"--tls-ca", c.TLS.CAFile}} {
		if f.val == "" {
			missing = append(missing, f.flag)
		}
	}
	if len(c.Cluster.GossipSecretKey) == 0 {
		missing = append(missing, "--gossip-key-file (or $QUOTAD_GOSSIP_KEY)")
	}
	if len(missing) == 0 {
		return nil
	}
	return fmt.Errorf("refusing to start without TLS material and a gossip key (missing %s); %s", strings.Join(missing, ", "), howToSecure)
}

// warnLooseSecrets logs a warning for each secret file (node key, gossip key, bootstrap token)
// that group or other can read, naming it, its mode and the chmod that fixes it. Not fatal:
// a file made by an older `quotad keygen` or copied carelessly should not stop a node.
func (c AgentConfig) warnLooseSecrets(log *slog.Logger) {
	for _, l := range pkifiles.LooseSecrets(map[string]string{
		"--tls-key": c.TLS.KeyFile, "--gossip-key-file": c.GossipKeyFile, "--bootstrap-token-file": c.BootstrapTokenFile,
	}) {
		log.Warn("secret file readable by group or other: "+l.String(), "flag", l.Flag, "file", l.Path, "mode", fmt.Sprintf("%04o", uint32(l.Mode)))
	}
}

// loadBootstrapToken returns the bootstrap admin token: the content of BootstrapTokenFile,
// else BootstrapToken, else "" (no bootstrap token: admins authenticate by certificate).
func (c AgentConfig) loadBootstrapToken() (string, error) {
	tok := c.BootstrapToken
	if c.BootstrapTokenFile != "" {
		b, err := os.ReadFile(c.BootstrapTokenFile)
		if err != nil {
			return "", fmt.Errorf("--bootstrap-token-file: %w", err)
		}
		tok = strings.TrimSpace(string(b))
		if tok == "" {
			return "", fmt.Errorf("--bootstrap-token-file %q is empty; make a token with `quotad keygen --token`", c.BootstrapTokenFile)
		}
	}
	if tok == "" {
		return "", nil
	}
	if _, err := auth.TokenAccessor(tok); err != nil {
		return "", fmt.Errorf("the bootstrap token (--bootstrap-token-file or $%s): %v; make one with `quotad keygen --token`", EnvBootstrapToken, err)
	}
	return tok, nil
}

// errNeedAdmin: an operator endpoint was called without the admin credential.
var errNeedAdmin = errors.New("this endpoint needs the admin credential: send \"Authorization: Bearer <admin token>\" or present an admin client certificate")

// httpAdmin decides whether r carries the admin credential: the bootstrap token as a bearer
// token, or a client certificate (verified against the cluster's CA by the TLS handshake)
// with the admin role. With --insecure a request without any credential is the insecure
// admin; a wrong credential is refused in every mode. It returns the HTTP status to answer
// on refusal.
func (a *Agent) httpAdmin(r *http.Request) (int, error) {
	if h := r.Header.Get("Authorization"); h != "" {
		tok, ok := strings.CutPrefix(h, "Bearer ")
		if ok && a.bootstrapToken != "" && subtle.ConstantTimeCompare([]byte(tok), []byte(a.bootstrapToken)) == 1 {
			return 0, nil
		}
		if id, known := a.authn.token(auth.HashToken(tok)); ok && known {
			if id.Role != auth.RoleAdmin {
				return http.StatusForbidden, fmt.Errorf("%s may not use this endpoint: it needs the admin role", id)
			}
			return 0, nil
		}
		return http.StatusUnauthorized, errors.New("the bearer token is neither the bootstrap token nor a token of this cluster")
	}
	if r.TLS != nil && len(r.TLS.VerifiedChains) > 0 {
		leaf := r.TLS.VerifiedChains[0][0]
		// Hashed per request: only pprof and /debug/ take certificates, never a hot path.
		if k := auth.KeyOf(leaf); a.fsm.CertRevoked(k) {
			return http.StatusUnauthorized, fmt.Errorf("the client certificate %q (serial %s) was revoked (quotad tls cert revoked lists it)", leaf.Subject.CommonName, k.Serial)
		}
		id, err := auth.IdentityFromCert(leaf, a.cfg.ClusterName)
		if err != nil {
			return http.StatusForbidden, err
		}
		if id.Role != auth.RoleAdmin {
			return http.StatusForbidden, fmt.Errorf("%s may not use this endpoint: it needs the admin role", id)
		}
		return 0, nil
	}
	if a.cfg.Insecure {
		return 0, nil
	}
	return http.StatusUnauthorized, errNeedAdmin
}

// requireAdmin serves h only to the admin (httpAdmin).
func (a *Agent) requireAdmin(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if code, err := a.httpAdmin(r); err != nil {
			http.Error(w, err.Error(), code)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// ReadyMaxLag is how many committed log entries a node may have left to apply and still
// report ready on /healthz.
const ReadyMaxLag = 512

// notReady returns why this node should not take traffic ("" when ready): no leader known, its
// last write to the Raft log failed, or it is more than ReadyMaxLag entries behind the commit
// index it knows of.
func (a *Agent) notReady() string {
	h := a.node.Health()
	switch {
	case h.Leader == "":
		return "no leader"
	case h.LogWriteErr != nil:
		return fmt.Sprintf("cannot write the Raft log: %v", h.LogWriteErr)
	case h.CommitIndex > h.AppliedIndex+ReadyMaxLag:
		return fmt.Sprintf("catching up: applied index %d, commit index %d", h.AppliedIndex, h.CommitIndex)
	}
	return ""
}
