package e2e

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/internal/proccluster"
	"github.com/quotad/quotad/internal/testpki"
)

// secureCluster is a 3-process cluster run as production would: peers on mutual TLS with a
// server certificate of the cluster CA, gossip encrypted with a key from a file.
type secureCluster struct {
	*proccluster.Cluster
	ca        *testpki.CA
	gossipKey []byte
	dir       string
}

func startSecureCluster(t *testing.T) *secureCluster {
	t.Helper()
	dir := t.TempDir()
	ca, err := testpki.NewCA("e2e CA")
	if err != nil {
		t.Fatal(err)
	}
	// The harness issues node certificates from this CA and uses this gossip key: it keeps
	// credential files it finds in Dir/credentials.
	creds := filepath.Join(dir, "credentials")
	if err := os.MkdirAll(creds, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := ca.WriteCAPair(filepath.Join(creds, pkifiles.CAFile), filepath.Join(creds, pkifiles.CAKeyFile)); err != nil {
		t.Fatal(err)
	}
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(creds, pkifiles.GossipKeyFile), []byte(base64.StdEncoding.EncodeToString(key)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	lf := filepath.Join(dir, "limits.yaml")
	if err := os.WriteFile(lf, []byte(limits), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := proccluster.Start(proccluster.Config{Binary: binary, Dir: dir, Nodes: 3, LimitsFile: lf})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.KillAll()
		if t.Failed() {
			for _, n := range c.Nodes {
				if b, err := os.ReadFile(n.LogPath); err == nil {
					t.Logf("%s log:\n%s", n.ID, tail(string(b), 40))
				}
			}
		}
	})
	if _, err := c.WaitLeader(20 * time.Second); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, "every node to have the limits", func() bool {
		for i := range c.Nodes {
			if s, err := c.State(context.Background(), i); err != nil || s.LimitsVersion == 0 {
				return false
			}
		}
		return true
	})
	return &secureCluster{Cluster: c, ca: ca, gossipKey: key, dir: dir}
}

// snapshot is what an attack must not change: who leads, the limits version, and that the
// FSM clock was not pushed ahead.
type clusterView struct {
	leader string
	limits []uint64
}

func (c *secureCluster) view(t *testing.T) clusterView {
	t.Helper()
	var v clusterView
	for i := range c.Nodes {
		s, err := c.State(context.Background(), i)
		if err != nil {
			t.Fatalf("node%d: %v", i+1, err)
		}
		if time.Duration(s.Clock) > time.Hour {
			t.Fatalf("%s: FSM clock %v: a forged timestamp was applied", s.ID, time.Duration(s.Clock))
		}
		if s.Leader == "" {
			t.Fatalf("%s has no leader", s.ID)
		}
		v.leader = s.Leader
		v.limits = append(v.limits, s.LimitsVersion)
	}
	return v
}

func (c *secureCluster) requireUnharmed(t *testing.T, before clusterView) {
	t.Helper()
	for i, n := range c.Nodes {
		if !c.Running(i) {
			b, _ := os.ReadFile(n.LogPath)
			t.Fatalf("%s exited:\n%s", n.ID, tail(string(b), 60))
		}
	}
	after := c.view(t)
	if after.leader != before.leader || fmt.Sprint(after.limits) != fmt.Sprint(before.limits) {
		t.Fatalf("cluster changed: before %+v, after %+v", before, after)
	}
	if hits, _ := c.ScanLogs("panic", "fatal error"); len(hits) > 0 {
		t.Fatalf("a node crashed:\n%s", strings.Join(hits, "\n"))
	}
}

func (c *secureCluster) clientTLS(t *testing.T, p testpki.Pair) *tls.Config {
	t.Helper()
	cert, err := tls.X509KeyPair(p.CertPEM, p.KeyPEM)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(c.ca.PEM)
	return &tls.Config{RootCAs: pool, GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil }}
}

// TestForgedRaftTrafficChangesNothing: a hand-built hashicorp/raft client sends every node
// AppendEntries with forged limits, a timestamp 57 years ahead and a garbage entry, over plain
// TCP, TLS without a certificate and TLS with a client (worker) certificate of the cluster's
// own CA. Every attempt is refused before Raft reads it; the cluster keeps its leader and
// limits, no node crashes, and a restarted node comes back.
func TestForgedRaftTrafficChangesNothing(t *testing.T) {
	c := startSecureCluster(t)
	before := c.view(t)

	worker, err := c.ca.Client("quotad", auth.Identity{Name: "worker", Role: auth.RoleWorker, Domains: []string{"provider"}})
	if err != nil {
		t.Fatal(err)
	}
	workerTLS := c.clientTLS(t, worker)
	workerTLS.InsecureSkipVerify = true // the attacker does not care who answers
	attacks := map[string]*tls.Config{
		"plain TCP":                 nil,
		"TLS without a certificate": {InsecureSkipVerify: true},
		"TLS with a worker certificate of the cluster CA": workerTLS,
	}
	forged, err := json.Marshal(map[string]any{"domains": []any{map[string]any{"name": "provider",
		"rate_limit": map[string]any{"unit": "second", "requests_per_unit": 1, "burst": 1}}}})
	if err != nil {
		t.Fatal(err)
	}
	future := time.Now().AddDate(57, 0, 0).UnixNano()
	limitsEntry, err := fsm.Encode(&fsmv1.Command{Ts: future, Ops: []*fsmv1.Op{{Op: &fsmv1.Op_SetLimits{SetLimits: &fsmv1.SetLimits{LimitsJson: forged}}}}})
	if err != nil {
		t.Fatal(err)
	}
	for name, cfg := range attacks {
		f, err := clustertest.NewForger(cfg)
		if err != nil {
			t.Fatal(err)
		}
		for i, n := range c.Nodes {
			s, _ := c.State(context.Background(), i)
			for prev := s.AppliedIndex; prev <= s.AppliedIndex+1; prev++ {
				if resp, err := f.AppendEntries(n.RaftAddr, 1<<20, prev, 1<<19, limitsEntry, []byte("garbage")); err == nil {
					t.Errorf("%s → %s: forged AppendEntries answered: success %v", name, n.ID, resp.Success)
				}
			}
			if resp, err := f.RequestVote(n.RaftAddr, 1<<20, 1<<30, 1<<20); err == nil {
				t.Errorf("%s → %s: forged RequestVote answered: granted %v", name, n.ID, resp.Granted)
			}
		}
		f.Close()
	}
	time.Sleep(time.Second) // let anything that got through be applied
	c.requireUnharmed(t, before)
	if hits, _ := c.ScanLogs("refused connections without a server certificate"); len(hits) == 0 {
		t.Error("no node logged the refused connections")
	}

	// The log holds nothing a restart could choke on.
	i := (indexOf(c.Nodes, before.leader) + 1) % 3
	c.Kill(i)
	if err := c.Start(i); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, c.Nodes[i].ID+" back with the leader", func() bool {
		s, err := c.State(context.Background(), i)
		return err == nil && s.Leader == before.leader && s.LimitsVersion == before.limits[i]
	})
	c.requireUnharmed(t, before)
}

func indexOf(nodes []*proccluster.Node, id string) int {
	for i, n := range nodes {
		if n.ID == id {
			return i
		}
	}
	return -1
}

// fakeMember is a memberlist node advertising what quotad's gossip metadata carries, with a
// huge applied index and Raft state: what made the old leader promote fake members.
type fakeMember struct{ meta []byte }

func (f fakeMember) NodeMeta(int) []byte                  { return f.meta }
func (fakeMember) NotifyMsg([]byte)                       {}
func (fakeMember) GetBroadcasts(int, int) [][]byte        { return nil }
func (fakeMember) LocalState(bool) []byte                 { return nil }
func (fakeMember) MergeRemoteState(buf []byte, join bool) {}

func startFakeMember(t *testing.T, name string, key []byte, raftAddr string, join []string) {
	t.Helper()
	meta, _ := json.Marshal(map[string]any{"v": 1, "id": name, "r": raftAddr, "s": true, "a": uint64(1) << 40})
	mc := memberlist.DefaultLocalConfig()
	mc.Name = name
	mc.BindAddr = "127.0.0.1"
	mc.BindPort = 0
	mc.AdvertiseAddr = "127.0.0.1"
	mc.SecretKey = key
	mc.Delegate = fakeMember{meta: meta}
	mc.LogOutput = io.Discard
	ml, err := memberlist.Create(mc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ml.Shutdown() })
	_, err = ml.Join(join)
	t.Logf("%s joined gossip: %v", name, err)
}

// TestFakeGossipMembersNeverVote: memberlist members without the gossip key, with a wrong
// key, and with the right key but no server certificate (an insider with a client
// certificate) all advertise a huge applied index. None becomes a voter and the cluster keeps
// its leader: only the leader's own replication over mutual TLS promotes.
func TestFakeGossipMembersNeverVote(t *testing.T) {
	c := startSecureCluster(t)
	before := c.view(t)
	var gossip []string
	for _, n := range c.Nodes {
		gossip = append(gossip, n.GossipAddr)
	}
	// The insider's "Raft port" presents a client certificate with both usages.
	insider, err := c.ca.ClientBothUsages("quotad", auth.Identity{Name: "insider", Role: auth.RoleAdmin})
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := tls.X509KeyPair(insider.CertPEM, insider.KeyPEM)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(io.Discard, conn); conn.Close() }()
		}
	}()
	wrong := make([]byte, 32)
	_, _ = rand.Read(wrong)
	dead := deadAddr(t)
	startFakeMember(t, "fake-nokey", nil, dead, gossip)
	startFakeMember(t, "fake-wrongkey", wrong, dead, gossip)
	startFakeMember(t, "fake-insider", c.gossipKey, ln.Addr().String(), gossip)

	admin, err := c.ca.Client("quotad", auth.Identity{Name: "admin", Role: auth.RoleAdmin})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(c.Nodes[0].GRPCAddr, grpc.WithTransportCredentials(credentials.NewTLS(c.clientTLS(t, admin))))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	adminAPI := quotadv1.NewAdminClient(conn)
	sawInsider := false
	// Several promotion rounds (reconcile 1 s, stable-for 2 s).
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		resp, err := adminAPI.Members(ctx, &quotadv1.MembersRequest{})
		cancel()
		if err != nil {
			t.Fatalf("members: %v", err)
		}
		voters := 0
		for _, m := range resp.Members {
			if strings.HasPrefix(m.Id, "fake-") {
				if m.Id != "fake-insider" {
					t.Fatalf("%s (no or a wrong gossip key) is a member: %+v", m.Id, m)
				}
				sawInsider = true
			}
			if m.Suffrage == "voter" {
				voters++
				if strings.HasPrefix(m.Id, "fake-") {
					t.Fatalf("%s became a voter", m.Id)
				}
			}
		}
		if voters != 3 {
			t.Fatalf("%d voters, want 3: %+v", voters, resp.Members)
		}
		time.Sleep(250 * time.Millisecond)
	}
	if !sawInsider {
		t.Error("the member with the gossip key never showed up (the test did not exercise promotion)")
	}
	c.requireUnharmed(t, before)
}

// deadAddr returns a loopback address nobody listens on.
func deadAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}
