// Package pkifiles lays out a quotad cluster's credentials as files in one directory: the CA
// (`quotad tls ca create`), node and client certificates (`quotad tls cert create`), and, for
// throwaway local clusters (`quotad dev`, the test harnesses), a whole set at once: CA, node
// certificates, an admin client certificate, a gossip key and a bootstrap admin token.
//
// It only makes and names files (keys and secrets mode 0600, never overwritten); what a
// certificate means is auth's business.
package pkifiles

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/quotad/quotad/auth"
)

// File names in a credentials directory.
const (
	CAFile    = "quotad-ca.pem"
	CAKeyFile = "quotad-ca-key.pem"
	// GossipKeyFile holds a base64 gossip key (`quotad keygen`).
	GossipKeyFile = "gossip.key"
	// BootstrapTokenFile holds the bootstrap admin token.
	BootstrapTokenFile = "bootstrap.token"
	// AdminName is the name of the admin client certificate of a local cluster.
	AdminName = "admin"
)

// CertFile and KeyFile name the certificate and key of name: <name>.pem, <name>-key.pem.
func CertFile(name string) string { return name + ".pem" }

// KeyFile: see CertFile.
func KeyFile(name string) string { return name + "-key.pem" }

// CreateCA writes a new CA for cluster into dir (CAFile, CAKeyFile) and returns their paths.
func CreateCA(dir, cluster string, validity time.Duration) (certPath, keyPath string, err error) {
	certPEM, keyPEM, err := auth.CreateCA(cluster, validity)
	if err != nil {
		return "", "", err
	}
	certPath, keyPath = filepath.Join(dir, CAFile), filepath.Join(dir, CAKeyFile)
	return certPath, keyPath, auth.WriteKeyPair(certPath, certPEM, keyPath, keyPEM)
}

// CreateCert writes a certificate described by opts, signed by the CA in caCertPath and
// caKeyPath, as <opts.Name>.pem and <opts.Name>-key.pem in dir, and returns their paths.
func CreateCert(dir, caCertPath, caKeyPath string, opts auth.CertOptions) (certPath, keyPath string, err error) {
	caCert, err := os.ReadFile(caCertPath)
	if err != nil {
		return "", "", fmt.Errorf("reading the CA certificate: %w (create one with `quotad tls ca create`)", err)
	}
	caKey, err := os.ReadFile(caKeyPath)
	if err != nil {
		return "", "", fmt.Errorf("reading the CA key: %w", err)
	}
	if strings.ContainsAny(opts.Name, `/\`) || opts.Name == "." || opts.Name == ".." {
		return "", "", fmt.Errorf("--name %q: use a plain name (it names the files)", opts.Name)
	}
	certPEM, keyPEM, err := auth.CreateCert(caCert, caKey, opts)
	if err != nil {
		return "", "", err
	}
	certPath, keyPath = filepath.Join(dir, CertFile(opts.Name)), filepath.Join(dir, KeyFile(opts.Name))
	return certPath, keyPath, auth.WriteKeyPair(certPath, certPEM, keyPath, keyPEM)
}

// Local is the full credential set of a throwaway local cluster in one directory. Every node
// gets its own server certificate (ServerCert); callers use the admin certificate and/or the
// bootstrap token.
type Local struct {
	Dir     string
	Cluster string
	CAFile  string
	caKey   string
	// AdminCertFile and AdminKeyFile: a client certificate with the admin role.
	AdminCertFile, AdminKeyFile string
	GossipKeyFile               string
	// TokenFile holds Token, the bootstrap admin token the agents are started with.
	TokenFile string
	Token     string
}

// EnsureLocal returns the local credential set in dir, creating whatever is missing (the
// directory mode 0700, every key and secret 0600). Existing files are kept, so a cluster
// restarted on the same directory keeps its identities.
func EnsureLocal(dir, cluster string) (*Local, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	l := &Local{Dir: dir, Cluster: cluster,
		CAFile: filepath.Join(dir, CAFile), caKey: filepath.Join(dir, CAKeyFile),
		AdminCertFile: filepath.Join(dir, CertFile(AdminName)), AdminKeyFile: filepath.Join(dir, KeyFile(AdminName)),
		GossipKeyFile: filepath.Join(dir, GossipKeyFile), TokenFile: filepath.Join(dir, BootstrapTokenFile)}
	if !exists(l.CAFile) {
		if _, _, err := CreateCA(dir, cluster, 0); err != nil {
			return nil, err
		}
	}
	if !exists(l.AdminCertFile) {
		if _, _, err := CreateCert(dir, l.CAFile, l.caKey, auth.CertOptions{Cluster: cluster, Name: AdminName,
			Identity: auth.Identity{Role: auth.RoleAdmin}}); err != nil {
			return nil, err
		}
	}
	if !exists(l.GossipKeyFile) {
		k, err := auth.NewGossipKey()
		if err != nil {
			return nil, err
		}
		if err := auth.WriteSecretFile(l.GossipKeyFile, []byte(k+"\n")); err != nil {
			return nil, err
		}
	}
	if !exists(l.TokenFile) {
		tok, _, err := auth.NewToken()
		if err != nil {
			return nil, err
		}
		if err := auth.WriteSecretFile(l.TokenFile, []byte(tok+"\n")); err != nil {
			return nil, err
		}
	}
	tok, err := ReadSecret(l.TokenFile)
	if err != nil {
		return nil, err
	}
	l.Token = tok
	return l, nil
}

// ServerCert returns node name's certificate and key, creating them if missing (valid for
// localhost, 127.0.0.1 and the extra hosts, which may be names or IP addresses).
func (l *Local) ServerCert(name string, hosts ...string) (certPath, keyPath string, err error) {
	certPath, keyPath = filepath.Join(l.Dir, CertFile(name)), filepath.Join(l.Dir, KeyFile(name))
	if exists(certPath) && exists(keyPath) {
		return certPath, keyPath, nil
	}
	opts := auth.CertOptions{Server: true, Cluster: l.Cluster, Name: name,
		DNSNames: []string{"localhost"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			opts.IPs = append(opts.IPs, ip)
		} else {
			opts.DNSNames = append(opts.DNSNames, h)
		}
	}
	return CreateCert(l.Dir, l.CAFile, l.caKey, opts)
}

// AgentArgs returns the security flags of `quotad agent` for node name: its certificate, the
// CA, the gossip key file and the bootstrap token file (no secret on the command line).
func (l *Local) AgentArgs(name string, hosts ...string) ([]string, error) {
	cert, key, err := l.ServerCert(name, hosts...)
	if err != nil {
		return nil, err
	}
	return []string{"--cluster-name", l.Cluster, "--tls-cert", cert, "--tls-key", key, "--tls-ca", l.CAFile,
		"--gossip-key-file", l.GossipKeyFile, "--bootstrap-token-file", l.TokenFile}, nil
}

// Env returns shell lines that point the quotad CLI (and the examples) at the cluster at
// addrs with the admin credentials: `source` it.
func (l *Local) Env(addrs []string) string {
	q := func(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
	return fmt.Sprintf("export QUOTAD_ADDR=%s\nexport QUOTAD_TOKEN=%s\nexport QUOTAD_CACERT=%s\nexport QUOTAD_CLIENT_CERT=%s\nexport QUOTAD_CLIENT_KEY=%s\n",
		q(strings.Join(addrs, ",")), q(l.Token), q(l.CAFile), q(l.AdminCertFile), q(l.AdminKeyFile))
}

// ReadSecret reads a one-line secret file (a token, a gossip key), without surrounding
// white space. The error never contains the file's content.
func ReadSecret(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	s := strings.TrimSpace(string(b))
	if s == "" {
		return "", fmt.Errorf("%s is empty", path)
	}
	if strings.ContainsAny(s, "\n\r") {
		return "", fmt.Errorf("%s holds more than one line", path)
	}
	return s, nil
}

// LooseSecret is a secret file (a private key, a gossip key, a token) that group or other may
// read.
type LooseSecret struct {
	Flag string // the flag that named it, e.g. --tls-key
	Path string
	Mode fs.FileMode
}

// String says what is wrong and how to fix it.
func (l LooseSecret) String() string {
	return fmt.Sprintf("%s %s is mode %04o: group or other can read this secret; run `chmod 600 %s`", l.Flag, l.Path, uint32(l.Mode.Perm()), l.Path)
}

// LooseSecrets returns the secret files (flag -> path; empty paths skipped) that group or
// other may read, sorted by flag. A file it cannot stat is skipped: reading it reports that.
func LooseSecrets(files map[string]string) []LooseSecret {
	var out []LooseSecret
	for flag, path := range files {
		if path == "" {
			continue
		}
		fi, err := os.Stat(path)
		if err != nil || fi.Mode().Perm()&0o077 == 0 {
			continue
		}
		out = append(out, LooseSecret{Flag: flag, Path: path, Mode: fi.Mode().Perm()})
	}
	slices.SortFunc(out, func(a, b LooseSecret) int { return strings.Compare(a.Flag, b.Flag) })
	return out
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return !errors.Is(err, os.ErrNotExist)
}
