package client

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// Environment variables every quotad tool reads for its connection (LoadEnv); flags override
// them. `quotad dev` writes them to DATA_DIR/dev.env.
const (
	EnvAddr       = "QUOTAD_ADDR"        // comma-separated node gRPC addresses
	EnvToken      = "QUOTAD_TOKEN"       // bearer token
	EnvCACert     = "QUOTAD_CACERT"      // PEM CA that signed the nodes' certificates
	EnvClientCert = "QUOTAD_CLIENT_CERT" // PEM client certificate (mutual TLS)
	EnvClientKey  = "QUOTAD_CLIENT_KEY"  // its key
	// EnvConfiguredAddrsOnly, true or false (also 1/0), sets Config.ConfiguredAddrsOnly:
	// dial only the addresses given, never a leader's own address.
	EnvConfiguredAddrsOnly = "QUOTAD_CONFIGURED_ADDRS_ONLY"
)

// ConfiguredAddrsOnlyFromEnv reads EnvConfiguredAddrsOnly: set is false when it is unset or
// empty; an error names the value when it is neither true nor false.
func ConfiguredAddrsOnlyFromEnv() (value, set bool, err error) {
	s := strings.TrimSpace(os.Getenv(EnvConfiguredAddrsOnly))
	if s == "" {
		return false, false, nil
	}
	v, err := strconv.ParseBool(s)
	if err != nil {
		return false, false, fmt.Errorf("$%s is %q: want true or false (1 or 0); true dials only the configured addresses", EnvConfiguredAddrsOnly, s)
	}
	return v, true, nil
}

// TLSFiles names PEM files to build the client's TLS settings from (Config.TLSFiles).
type TLSFiles struct {
	// CAFile verifies the nodes' certificates (empty: the system's roots).
	CAFile string
	// CertFile and KeyFile are a client certificate for mutual TLS (optional: a token also
	// authenticates).
	CertFile, KeyFile string
	// ServerName, if set, is the name verified in the nodes' certificates instead of the
	// dialed host, e.g. "server.quotad.quotad", which every node certificate of cluster
	// "quotad" carries (useful when nodes are dialed by addresses their certificates do not
	// list).
	ServerName string
}

// IsZero reports whether no file is named.
func (f TLSFiles) IsZero() bool { return f == TLSFiles{} }

// Load reads the files into a tls.Config.
func (f TLSFiles) Load() (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: f.ServerName}
	if f.CAFile != "" {
		pem, err := os.ReadFile(f.CAFile)
		if err != nil {
			return nil, fmt.Errorf("client: CA file (%s): %w", EnvCACert, err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("client: CA file %q holds no PEM certificate", f.CAFile)
		}
	}
	if f.CertFile != "" || f.KeyFile != "" {
		if f.CertFile == "" || f.KeyFile == "" {
			return nil, fmt.Errorf("client: a client certificate needs both a certificate (%q) and a key (%q)", f.CertFile, f.KeyFile)
		}
		cert, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("client: client certificate %q and key %q: %w", f.CertFile, f.KeyFile, err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// SetConfiguredAddrsOnly sets ConfiguredAddrsOnly as a command-line flag does: over the
// environment, whatever LoadEnv read or could not read from EnvConfiguredAddrsOnly (its error
// is dropped: the flag decides).
func (c *Config) SetConfiguredAddrsOnly(v bool) {
	c.ConfiguredAddrsOnly, c.envErr = v, nil
}

// LoadEnv fills the connection fields of c that are still empty from the environment
// (EnvAddr, EnvToken, EnvCACert, EnvClientCert, EnvClientKey, EnvConfiguredAddrsOnly when
// ConfiguredAddrsOnly is false), so values set by flags win. A value it cannot read is
// reported by Validate (and so by New).
func (c *Config) LoadEnv() {
	if !c.ConfiguredAddrsOnly {
		v, _, err := ConfiguredAddrsOnlyFromEnv()
		c.ConfiguredAddrsOnly, c.envErr = v, err
	}
	if len(c.Addrs) == 0 {
		for _, a := range strings.Split(os.Getenv(EnvAddr), ",") {
			if a = strings.TrimSpace(a); a != "" {
				c.Addrs = append(c.Addrs, a)
			}
		}
	}
	if c.Token == "" && c.TokenFile == "" {
		c.Token = strings.TrimSpace(os.Getenv(EnvToken))
	}
	if c.TLS == nil {
		fill := func(dst *string, env string) {
			if *dst == "" {
				*dst = os.Getenv(env)
			}
		}
		fill(&c.TLSFiles.CAFile, EnvCACert)
		fill(&c.TLSFiles.CertFile, EnvClientCert)
		fill(&c.TLSFiles.KeyFile, EnvClientKey)
	}
}

// TLSConfig returns the TLS settings connections use: TLS, else one loaded from TLSFiles,
// else nil (plaintext).
func (c Config) TLSConfig() (*tls.Config, error) {
	if c.TLS != nil {
		return c.TLS, nil
	}
	if c.TLSFiles.IsZero() {
		return nil, nil
	}
	return c.TLSFiles.Load()
}

// BearerToken returns the token calls carry: Token, else the content of TokenFile, else "".
func (c Config) BearerToken() (string, error) {
	if c.Token != "" || c.TokenFile == "" {
		return c.Token, nil
	}
	b, err := os.ReadFile(c.TokenFile)
	if err != nil {
		return "", fmt.Errorf("client: token file: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", fmt.Errorf("client: token file %q is empty", c.TokenFile)
	}
	return tok, nil
}

// DialCredentials returns the gRPC dial options that carry c's credentials: transport
// security from TLSConfig (plaintext if nil) and, with a token, per-call
// "authorization: Bearer <token>" metadata. For tools that make their own connections with
// the same settings as a Client.
func (c Config) DialCredentials() ([]grpc.DialOption, error) {
	if err := c.validateCredentials(); err != nil {
		return nil, err
	}
	tlsCfg, err := c.TLSConfig()
	if err != nil {
		return nil, err
	}
	var opts []grpc.DialOption
	if tlsCfg != nil {
		opts = append(opts, grpc.WithTransportCredentials(credentials.NewTLS(tlsCfg)))
	} else {
		opts = append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))
	}
	tok, err := c.BearerToken()
	if err != nil {
		return nil, err
	}
	if tok != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(bearer{token: tok, plaintextOK: tlsCfg == nil && c.Insecure}))
	}
	return opts, nil
}

func (c Config) validateCredentials() error {
	var errs []error
	if c.TLS != nil && !c.TLSFiles.IsZero() {
		errs = append(errs, errors.New("both TLS and TLSFiles are set: use one"))
	}
	if c.Token != "" && c.TokenFile != "" {
		errs = append(errs, errors.New("both Token and TokenFile are set: use one"))
	}
	if (c.Token != "" || c.TokenFile != "") && c.TLS == nil && c.TLSFiles.IsZero() && !c.Insecure {
		errs = append(errs, fmt.Errorf("a token is only sent over TLS: set the CA that signed the nodes' certificates (TLSFiles.CAFile, $%s) or TLS, or Insecure for a cluster run with --insecure", EnvCACert))
	}
	return errors.Join(errs...)
}

// bearer is a per-call credential: "authorization: Bearer <token>".
type bearer struct {
	token       string
	plaintextOK bool
}

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

// RequireTransportSecurity: gRPC refuses to send the token over a plaintext connection
// unless the caller said Insecure.
func (b bearer) RequireTransportSecurity() bool { return !b.plaintextOK }

// Flags registers the connection flags of a quotad tool on fs — -addrs, -cacert,
// -client-cert, -client-key, -token-file, -configured-addrs-only — and returns a function that, once fs is parsed,
// returns DefaultConfig with them, the environment filling what the flags left empty
// (LoadEnv), and defaultAddrs if neither names a node. The examples use it:
//
//	conn := client.Flags(flag.CommandLine, "127.0.0.1:7101")
//	flag.Parse()
//	qc, err := client.New(conn())
func Flags(fs *flag.FlagSet, defaultAddrs string) func() Config {
	addrs := fs.String("addrs", "", "comma-separated quotad gRPC addresses (or $"+EnvAddr+"; default "+defaultAddrs+")")
	var files TLSFiles
	fs.StringVar(&files.CAFile, "cacert", "", "PEM CA that signed the nodes' certificates (or $"+EnvCACert+")")
	fs.StringVar(&files.CertFile, "client-cert", "", "PEM client certificate (or $"+EnvClientCert+")")
	fs.StringVar(&files.KeyFile, "client-key", "", "PEM key of -client-cert (or $"+EnvClientKey+")")
	tokenFile := fs.String("token-file", "", "file holding a bearer token (or the token in $"+EnvToken+")")
	addrsOnly := fs.Bool("configured-addrs-only", false, "dial only -addrs, never the leader's own address: for nodes behind a proxy or load balancer (or $"+EnvConfiguredAddrsOnly+"=true)")
	return func() Config {
		cfg := DefaultConfig()
		for _, a := range strings.Split(*addrs, ",") {
			if a = strings.TrimSpace(a); a != "" {
				cfg.Addrs = append(cfg.Addrs, a)
			}
		}
		cfg.TLSFiles, cfg.TokenFile = files, *tokenFile
		cfg.LoadEnv()
		fs.Visit(func(f *flag.Flag) { // given on the command line: it wins over the environment
			if f.Name == "configured-addrs-only" {
				cfg.SetConfiguredAddrsOnly(*addrsOnly)
			}
		})
		if len(cfg.Addrs) == 0 {
			cfg.Addrs = strings.Split(defaultAddrs, ",")
		}
		return cfg
	}
}
