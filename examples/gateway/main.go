// Command gateway is an example API gateway (seed 002) that admits every request through
// quotad with per-tenant and per-consumer limits. The caller's identity comes from a signed
// bearer token that the gateway verifies (HMAC-SHA256 here, standing in for a real token
// validator or mTLS); inbound x-tenant / x-consumer-id headers are stripped, and the
// verified values are set for the upstream. Denied requests get 429 with Retry-After,
// X-RateLimit-*, RateLimit and RateLimit-Policy headers and a problem+json body.
//
// Run a cluster with `make run`, then:
//
//	export GATEWAY_HMAC_KEY=$(head -c 32 /dev/urandom | base64)   # or -key-file PATH
//	go run ./examples/gateway -listen 127.0.0.1:8080 &
//	TOKEN=$(go run ./examples/gateway -mint acme:mobile-app)
//	curl -i -H "Authorization: Bearer $TOKEN" http://127.0.0.1:8080/orders
//
// The HMAC key comes from $GATEWAY_HMAC_KEY or a file (-key-file), never from the command
// line (any local user reads /proc/PID/cmdline); the gateway refuses to start without one.
//
// The cluster's limits must define the domain (-domain) with levels keyed "tenant" and
// "consumer"; see examples/limits.yaml.
package main

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"log"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/client/quotahttp"
)

// keyEnv holds the HMAC key when no -key-file is given.
const keyEnv = "GATEWAY_HMAC_KEY"

// minKeyBytes is the shortest key accepted: HMAC-SHA256 with a guessable key is no check.
const minKeyBytes = 16

// loadKey returns the HMAC key from file (if named) or env, refusing none or a short one.
func loadKey(file, env string) ([]byte, error) {
	key, from := []byte(strings.TrimSpace(env)), "$"+keyEnv
	if file != "" {
		b, err := os.ReadFile(file)
		if err != nil {
			return nil, fmt.Errorf("-key-file: %w", err)
		}
		key, from = []byte(strings.TrimSpace(string(b))), "-key-file "+file
	}
	switch {
	case len(key) == 0 && file == "":
		return nil, fmt.Errorf("no HMAC key: set $%s or -key-file PATH to a random secret of %d bytes or more, e.g. export %s=$(head -c 32 /dev/urandom | base64)", keyEnv, minKeyBytes, keyEnv)
	case len(key) < minKeyBytes:
		return nil, fmt.Errorf("the HMAC key in %s is %d bytes; use a random secret of %d bytes or more", from, len(key), minKeyBytes)
	}
	return key, nil
}

func main() {
	conn := client.Flags(flag.CommandLine, "127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103") // and $QUOTAD_* (source dev.env)
	listen := flag.String("listen", "127.0.0.1:8080", "HTTP listen address")
	domain := flag.String("domain", "platform", "quota domain")
	keyFile := flag.String("key-file", "", "file holding the HMAC key that signs bearer tokens (or the key in $"+keyEnv+")")
	mint := flag.String("mint", "", "print a bearer token for TENANT:CONSUMER and exit")
	maxWait := flag.Duration("max-wait", 0, "wait up to this long for quota instead of answering 429 at once")
	flag.Parse()

	key, err := loadKey(*keyFile, os.Getenv(keyEnv))
	if err != nil {
		log.Fatal(err)
	}
	v := verifier{key: key}
	if *mint != "" {
		tenant, consumer, _ := strings.Cut(*mint, ":")
		tok, err := v.mint(tenant, consumer)
		if err != nil {
			log.Fatalf("-mint %q: %v", *mint, err)
		}
		fmt.Println(tok)
		return
	}

	qcfg := conn()
	qc, err := client.New(qcfg)
	if err != nil {
		log.Fatal(err)
	}
	defer qc.Close()

	admit, err := quotahttp.Middleware(quotahttp.MiddlewareConfig{
		Client:   qc,
		Domain:   *domain,
		Identify: v.identify,
		MaxWait:  *maxWait,
		OnError:  func(r *http.Request, err error) { log.Printf("%s %s: %v", r.Method, r.URL.Path, err) },
	})
	if err != nil {
		log.Fatal(err)
	}
	upstream := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, "{\"path\":%q,\"tenant\":%q,\"consumer\":%q}\n", r.URL.Path, r.Header.Get("X-Tenant"), r.Header.Get("X-Consumer-Id"))
	})
	srv := &http.Server{Addr: *listen, Handler: admit(upstream), ReadHeaderTimeout: 5 * time.Second}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	}()
	log.Printf("gateway on http://%s (domain %q, quotad %s)", *listen, *domain, strings.Join(qcfg.Addrs, ","))
	if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Fatal(err)
	}
}

// verifier checks tokens of the form tenant.consumer.hex(hmac(key, "tenant.consumer")).
type verifier struct{ key []byte }

func (v verifier) sign(payload string) string {
	m := hmac.New(sha256.New, v.key)
	m.Write([]byte(payload))
	return hex.EncodeToString(m.Sum(nil))
}

// mint signs tenant and consumer. identify cuts the payload at its first '.', so a tenant
// holding one would come back as another tenant ("acme.x" with consumer "y" as "acme" with
// consumer "x.y": one tenant's token spending another's quota): such names are refused.
func (v verifier) mint(tenant, consumer string) (string, error) {
	switch {
	case tenant == "":
		return "", errors.New("no tenant: use TENANT:CONSUMER, e.g. acme:mobile-app")
	case strings.Contains(tenant, "."):
		return "", fmt.Errorf("tenant %q contains '.', which separates the token's fields; use a tenant name without '.'", tenant)
	}
	p := tenant + "." + consumer
	return p + "." + v.sign(p), nil
}

func (v verifier) identify(r *http.Request) (quotahttp.Identity, error) {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok {
		return quotahttp.Identity{}, errors.New("no bearer token")
	}
	i := strings.LastIndexByte(tok, '.')
	if i < 0 {
		return quotahttp.Identity{}, errors.New("malformed token")
	}
	payload, sig := tok[:i], tok[i+1:]
	if !hmac.Equal([]byte(sig), []byte(v.sign(payload))) {
		return quotahttp.Identity{}, errors.New("bad token signature")
	}
	tenant, consumer, _ := strings.Cut(payload, ".")
	if tenant == "" {
		return quotahttp.Identity{}, errors.New("token names no tenant")
	}
	return quotahttp.Identity{Tenant: tenant, Consumer: consumer}, nil
}
