package e2e

import (
	"context"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/internal/proccluster"
)

const caRotationLimits = `
domain: provider
rate_limit: {unit: second, requests_per_unit: 1000000, burst: 1000000}
`

// TestCARotationWithoutDowntime follows docs/security.md "Rotating the CA" with real processes:
// a 3-node cluster on CA1 and a worker spending with a CA1 client certificate throughout. Every
// step is a rolling restart, one node at a time (followers first, the leader last):
//
//  1. every node trusts the bundle CA1+CA2 (still serving its CA1 certificate); the caller
//     trusts the bundle too;
//  2. every node gets a certificate from CA2 (`quotad tls cert create --server`, made from the
//     new CA's directory), the caller a CA2 client certificate;
//  3. every node trusts CA2 only; the caller too.
//
// The caller's admissions must keep succeeding: the longest run of failed Allow calls (each
// with the client's own retries, 2 s deadline) may not exceed the retry window per restart.
// The caller is redeployed 4 s after each nodes' step, so a step out of order (say the caller
// left trusting CA1 only while the nodes move to CA2 certificates) shows as a longer outage.
// At the end a caller with a CA1-issued certificate is refused, and one with a CA2 certificate
// is admitted (the control). About 25 s of restarts and holds: it runs only with
// QUOTAD_CA_ROTATION=1 (make test-ca-rotation).
func TestCARotationWithoutDowntime(t *testing.T) {
	if os.Getenv("QUOTAD_CA_ROTATION") == "" {
		t.Skip("about 25 s of rolling restarts; run with QUOTAD_CA_ROTATION=1 (make test-ca-rotation)")
	}
	dir := t.TempDir()
	tlsCLI := func(workdir string, args ...string) {
		t.Helper()
		cmd := exec.Command(binary, append([]string{"tls"}, args...)...)
		cmd.Dir = workdir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("quotad tls %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	// CA1: the cluster's credentials as proccluster makes them (CA, admin cert, gossip key,
	// bootstrap token); CA2 in a directory of its own (`tls ca create` refuses to overwrite).
	creds, err := pkifiles.EnsureLocal(filepath.Join(dir, "ca1"), proccluster.ClusterName)
	if err != nil {
		t.Fatal(err)
	}
	ca1 := creds.CAFile
	ca2Dir := filepath.Join(dir, "ca2")
	if err := os.MkdirAll(ca2Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	tlsCLI(ca2Dir, "ca", "create", "--cluster", proccluster.ClusterName)
	ca2 := filepath.Join(ca2Dir, pkifiles.CAFile)
	bundle := filepath.Join(dir, "bundle.pem")
	b1, err := os.ReadFile(ca1)
	if err != nil {
		t.Fatal(err)
	}
	b2, err := os.ReadFile(ca2)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bundle, append(append([]byte{}, b1...), b2...), 0o644); err != nil {
		t.Fatal(err)
	}
	// The caller's CA1 certificate (a worker in provider) and, later, its CA2 one.
	tlsCLI(creds.Dir, "cert", "create", "--client", "--cluster", proccluster.ClusterName, "--name", "gw1",
		"--role", "worker", "--domain", "provider")
	tlsCLI(ca2Dir, "cert", "create", "--client", "--cluster", proccluster.ClusterName, "--name", "gw1",
		"--role", "worker", "--domain", "provider")

	// Each node's TLS flags, appended after proccluster's (the last --tls-* wins).
	type nodeTLS struct{ cert, key, ca string }
	var mu sync.Mutex
	nodeFlags := map[string]nodeTLS{}
	lf := filepath.Join(dir, "limits.yaml")
	if err := os.WriteFile(lf, []byte(caRotationLimits), 0o644); err != nil {
		t.Fatal(err)
	}
	probeCreds := *creds
	probeCreds.CAFile, probeCreds.AdminCertFile, probeCreds.AdminKeyFile = bundle, "", ""
	c, err := proccluster.Start(proccluster.Config{Binary: binary, Dir: dir, Nodes: 3, LimitsFile: lf, Credentials: creds,
		HTTPCredentials: &probeCreds,
		NodeArgs: func(n *proccluster.Node) []string {
			mu.Lock()
			defer mu.Unlock()
			f, ok := nodeFlags[n.ID]
			if !ok {
				return nil
			}
			return []string{"--tls-cert", f.cert, "--tls-key", f.key, "--tls-ca", f.ca}
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.KillAll()
		if t.Failed() {
			for _, n := range c.Nodes {
				if b, err := os.ReadFile(n.LogPath); err == nil {
					t.Logf("%s log:\n%s", n.ID, tail(string(b), 30))
				}
			}
		}
	})
	if _, err := c.WaitLeader(15 * time.Second); err != nil {
		t.Fatal(err)
	}
	// The harness's own HTTP client trusts the bundle and authenticates by the bootstrap token
	// (HTTPCredentials; its CA1 admin certificate would be refused at the end), so it reads
	// /healthz and /debug/state at every step.
	probe := c.HTTPClient()
	leader := func() int { return c.Leader(context.Background()) }
	healthy := func(i int, timeout time.Duration) {
		t.Helper()
		waitFor(t, timeout, c.Nodes[i].ID+" /healthz ok", func() bool {
			resp, err := probe.Get(c.URL(i, "/healthz"))
			if err != nil {
				return false
			}
			resp.Body.Close()
			return resp.StatusCode == http.StatusOK
		})
	}

	newCaller := func(ca, cert, key string) *client.Client {
		t.Helper()
		cfg := client.DefaultConfig(c.GRPCAddrs()...)
		cfg.TLSFiles = client.TLSFiles{CAFile: ca, CertFile: cert, KeyFile: key, ServerName: auth.ServerName(proccluster.ClusterName)}
		cl, err := client.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return cl
	}
	gw1CA1 := [2]string{filepath.Join(creds.Dir, "gw1.pem"), filepath.Join(creds.Dir, "gw1-key.pem")}
	gw1CA2 := [2]string{filepath.Join(ca2Dir, "gw1.pem"), filepath.Join(ca2Dir, "gw1-key.pem")}

	// The caller: Allow in a loop on whichever client is current (a redeploy of the caller
	// swaps it), recording the longest run of failures.
	var current atomic.Pointer[client.Client]
	current.Store(newCaller(ca1, gw1CA1[0], gw1CA1[1]))
	var (
		statsMu          sync.Mutex
		admitted, failed int
		failingSince     time.Time
		longestOutage    time.Duration
		lastErr          error
		stop             = make(chan struct{})
		spenderDone      = make(chan struct{})
		swapped          []*client.Client
	)
	go func() {
		defer close(spenderDone)
		for {
			select {
			case <-stop:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			d, err := current.Load().Allow(ctx, client.Request{Domain: "provider"})
			cancel()
			now := time.Now()
			statsMu.Lock()
			if err == nil && d.Admitted {
				admitted++
				if !failingSince.IsZero() {
					longestOutage = max(longestOutage, now.Sub(failingSince))
					failingSince = time.Time{}
				}
			} else {
				failed++
				lastErr = err
				if failingSince.IsZero() {
					failingSince = now
				}
			}
			statsMu.Unlock()
			time.Sleep(20 * time.Millisecond)
		}
	}()
	// The caller is redeployed a while after the nodes' step (hold, longer than the window):
	// a step done in the wrong order then shows as an outage longer than the window.
	const (
		window = 3 * time.Second // per restart: an election plus the client's retries
		hold   = 4 * time.Second
	)
	swapCaller := func(ca string, cert [2]string) {
		time.Sleep(hold)
		swapped = append(swapped, current.Swap(newCaller(ca, cert[0], cert[1])))
	}

	rolling := func(step string, flags func(id string) nodeTLS) {
		t.Helper()
		l := leader()
		order := []int{}
		for i := range c.Nodes {
			if i != l {
				order = append(order, i)
			}
		}
		if l >= 0 {
			order = append(order, l)
		}
		for _, i := range order {
			start := time.Now()
			c.Stop(i)
			mu.Lock()
			nodeFlags[c.Nodes[i].ID] = flags(c.Nodes[i].ID)
			mu.Unlock()
			if err := c.Start(i); err != nil {
				t.Fatal(err)
			}
			healthy(i, 30*time.Second)
			t.Logf("%s: %s restarted in %v", step, c.Nodes[i].ID, time.Since(start).Round(time.Millisecond))
		}
	}
	ca1Cert := func(id string) [2]string {
		cert, key, err := creds.ServerCert(id)
		if err != nil {
			t.Fatal(err)
		}
		return [2]string{cert, key}
	}
	time.Sleep(time.Second)

	// 1. Trust both CAs: nodes (rolling), then the caller.
	rolling("bundle", func(id string) nodeTLS {
		cc := ca1Cert(id)
		return nodeTLS{cc[0], cc[1], bundle}
	})
	swapCaller(bundle, gw1CA1)
	// 2. Certificates from CA2: nodes (rolling), then the caller.
	rolling("CA2 certificates", func(id string) nodeTLS {
		tlsCLI(ca2Dir, "cert", "create", "--server", "--cluster", proccluster.ClusterName, "--name", id)
		return nodeTLS{filepath.Join(ca2Dir, id+".pem"), filepath.Join(ca2Dir, id+"-key.pem"), bundle}
	})
	swapCaller(bundle, gw1CA2)
	// 3. Drop CA1: the caller first (every node already serves a CA2 certificate), then nodes.
	swapCaller(ca2, gw1CA2)
	rolling("CA2 only", func(id string) nodeTLS {
		return nodeTLS{filepath.Join(ca2Dir, id+".pem"), filepath.Join(ca2Dir, id+"-key.pem"), ca2}
	})
	time.Sleep(time.Second)
	close(stop)
	<-spenderDone
	for _, cl := range swapped {
		cl.Close()
	}
	current.Load().Close()

	statsMu.Lock()
	if !failingSince.IsZero() {
		longestOutage = max(longestOutage, time.Since(failingSince))
	}
	t.Logf("caller: %d admitted, %d failed, longest run of failures %v (last error: %v)",
		admitted, failed, longestOutage.Round(time.Millisecond), lastErr)
	if admitted < 100 || longestOutage > window {
		t.Errorf("the caller was refused for %v at a stretch (window %v); %d admitted, %d failed; last error: %v",
			longestOutage, window, admitted, failed, lastErr)
	}
	statsMu.Unlock()

	// The end state: a CA1-issued certificate is refused (the nodes trust CA2 only), a CA2 one
	// is admitted.
	try := func(ca string, cert [2]string) error {
		cl := newCaller(ca, cert[0], cert[1])
		defer cl.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		_, err := cl.Allow(ctx, client.Request{Domain: "provider"})
		return err
	}
	if err := try(ca2, gw1CA2); err != nil {
		t.Fatalf("a CA2 caller after the rotation: %v", err)
	}
	if err := try(bundle, gw1CA1); err == nil {
		t.Fatal("a caller with a CA1-issued certificate was admitted after CA1 was dropped")
	} else {
		t.Logf("CA1-issued certificate refused: %v", err)
	}
	if err := try(ca1, gw1CA1); err == nil {
		t.Fatal("a caller trusting CA1 only was admitted: the nodes still serve CA1 certificates")
	}
}
