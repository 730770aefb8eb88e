package rpc_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/auth"
	"github.com/quotad/quotad/backup"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// TestSnapshotRestoreKeepsTokens: tokens are security state. A restore keeps the cluster's
// current token table (a token revoked after the save stays refused, one created after stays
// valid) unless restore_tokens is set, which installs the file's (the revoked token is admitted
// again, the newer one refused); the answer says which, with the counts.
func TestSnapshotRestoreKeepsTokens(t *testing.T) {
	tc := startTokenCluster(t)
	bootstrap, as, admin, q := tc.bootstrap, tc.as, tc.admin, tc.q
	fconn := tc.p.dialAs(tc.c.Addrs()[(tc.leader+1)%3], "")
	create := func() (token, accessor string) {
		t.Helper()
		resp, err := admin.CreateToken(as(bootstrap), &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"provider"}})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Token, resp.Accessor
	}
	id := uint64(0)
	admitted := func(token string) error {
		id++
		_, err := acquireOne(as(token), q, "c", admission(id, 1, "endpoint=search"))
		return err
	}

	revoked, racc := create()
	kept, _ := create()
	file := filepath.Join(t.TempDir(), "s.snap")
	if _, err := backup.Save(as(bootstrap), quotadv1.NewSnapshotClient(fconn), file); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.RevokeToken(as(bootstrap), &quotadv1.RevokeTokenRequest{Accessor: racc}); err != nil {
		t.Fatal(err)
	}
	newer, _ := create()

	// Default: the current tokens stay.
	resp, err := backup.Restore(as(bootstrap), quotadv1.NewSnapshotClient(fconn), file, false)
	if err != nil {
		t.Fatal(err)
	}
	if resp.TokensRestored || resp.Tokens != 2 || resp.FileTokens != 2 || resp.TokensAdded != 0 || resp.TokensRemoved != 0 {
		t.Fatalf("default restore answered tokens_restored %v tokens %d file_tokens %d +%d -%d, want the current 2 kept",
			resp.TokensRestored, resp.Tokens, resp.FileTokens, resp.TokensAdded, resp.TokensRemoved)
	}
	if s := backup.TokensSummary(resp); !strings.Contains(s, "kept the cluster's current 2") || !strings.Contains(s, "--restore-tokens") {
		t.Errorf("summary %q", s)
	}
	wantCode(t, admitted(revoked), codes.Unauthenticated, racc)
	for name, tok := range map[string]string{"kept": kept, "created after the save": newer} {
		if err := admitted(tok); err != nil {
			t.Fatalf("token %s refused after a restore that keeps tokens: %v", name, err)
		}
	}

	// --restore-tokens: the file's table, the revoked token back, the newer one gone.
	resp, err = backup.Restore(as(bootstrap), quotadv1.NewSnapshotClient(fconn), file, true)
	if err != nil {
		t.Fatal(err)
	}
	if !resp.TokensRestored || resp.Tokens != 2 || resp.TokensAdded != 1 || resp.TokensRemoved != 1 {
		t.Fatalf("restore_tokens answered tokens_restored %v tokens %d +%d -%d, want the file's 2, +1 -1",
			resp.TokensRestored, resp.Tokens, resp.TokensAdded, resp.TokensRemoved)
	}
	if s := backup.TokensSummary(resp); !strings.Contains(s, "restored the file's 2") || !strings.Contains(s, "+1 added, -1 removed") {
		t.Errorf("summary %q", s)
	}
	if err := admitted(revoked); err != nil {
		t.Fatalf("with restore_tokens the token revoked after the save is refused: %v", err)
	}
	wantCode(t, admitted(newer), codes.Unauthenticated)
}

// TestSnapshotRestoreKeepsRevokeInFlight: a revoke that took its timestamp just before a
// restore (which keeps the current tokens) began, and is queued in raft only while the
// restore runs, is either refused or stays in force: the restore waits until it is in the
// log before its barrier, so the token table it keeps has it. The hooks widen the windows:
// 300 ms between the revoke's timestamp and its enqueue, 800 ms between the restore's copy of
// the current tokens and raft.Restore (time for a revoke queued after the barrier to commit).
func TestSnapshotRestoreKeepsRevokeInFlight(t *testing.T) {
	var armStamp, armCopy atomic.Bool
	stamped := make(chan struct{}, 1)
	rpc.SetStampedHook(func() {
		if armStamp.CompareAndSwap(true, false) {
			stamped <- struct{}{}
			time.Sleep(300 * time.Millisecond)
		}
	})
	rpc.SetRestoreCopiedHook(func() {
		if armCopy.CompareAndSwap(true, false) {
			time.Sleep(800 * time.Millisecond)
		}
	})
	t.Cleanup(func() { rpc.SetStampedHook(nil); rpc.SetRestoreCopiedHook(nil) })

	tc := startTokenCluster(t) // after the hooks: their cleanup runs after the cluster's
	bootstrap, as, admin, q, lconn := tc.bootstrap, tc.as, tc.admin, tc.q, tc.lconn
	created, err := admin.CreateToken(as(bootstrap), &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"provider"}})
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "s.snap")
	if _, err := backup.Save(as(bootstrap), quotadv1.NewSnapshotClient(lconn), file); err != nil {
		t.Fatal(err)
	}

	armStamp.Store(true)
	revoked := make(chan error, 1)
	go func() {
		_, err := admin.RevokeToken(as(bootstrap), &quotadv1.RevokeTokenRequest{Accessor: created.Accessor})
		revoked <- err
	}()
	<-stamped // the revoke has its timestamp and is not in raft yet
	armCopy.Store(true)
	if _, err := backup.Restore(as(bootstrap), quotadv1.NewSnapshotClient(lconn), file, false); err != nil {
		t.Fatal(err)
	}
	if err := <-revoked; err != nil {
		t.Fatalf("revoke beside a restore: %v", err)
	}
	// The revoke was confirmed: the token must stay refused.
	_, err = acquireOne(as(created.Token), q, "c", admission(1, 1, "endpoint=search"))
	wantCode(t, err, codes.Unauthenticated, created.Accessor)
}

// tokenCluster is authCluster with tokenLimits and a bootstrap token (an admin), dialed on its
// leader.
type tokenCluster struct {
	c         *rpctest.Cluster
	p         *pki
	bootstrap string
	leader    int
	lconn     *grpc.ClientConn
	admin     quotadv1.AdminClient
	q         quotadv1.QuotaClient
}

func startTokenCluster(t *testing.T) *tokenCluster {
	t.Helper()
	bootstrapFile := filepath.Join(t.TempDir(), "bootstrap")
	bootstrap, _, err := auth.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bootstrapFile, []byte(bootstrap+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, p := authCluster(t, tokenLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.BootstrapTokenFile = bootstrapFile })
	leader := c.WaitLeader(10 * time.Second)
	lconn := p.dialAs(c.Addrs()[leader], "")
	return &tokenCluster{c: c, p: p, bootstrap: bootstrap, leader: leader, lconn: lconn,
		admin: quotadv1.NewAdminClient(lconn), q: quotadv1.NewQuotaClient(lconn)}
}

// as is a context carrying tok as the bearer token.
func (tc *tokenCluster) as(tok string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+tok)
}
