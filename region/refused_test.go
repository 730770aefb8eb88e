package region_test

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/internal/pkifiles"
	"github.com/quotad/quotad/quota"
	"github.com/quotad/quotad/region"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// TestRegionsRefusedCredentialSaysSo: the global cluster refuses the regional leader's
// renewals (its --global-token-file token was revoked). The region fails closed after the
// grant in hand, even on a level with shares.fallback_rate (s11-trial) — and says why: the
// client's "refused this client's share renewal" warning reaches the node's log (a
// client.Config without a Logger logs nothing since s11-open, and the region's global client
// had none), the region's share-ended warning names the refusal instead of "no
// shares.fallback_rate" or "falling back", and a refused admission names it instead of
// "global cluster unreachable".
func TestRegionsRefusedCredentialSaysSo(t *testing.T) {
	creds, err := pkifiles.EnsureLocal(filepath.Join(t.TempDir(), "creds"), "quotad")
	if err != nil {
		t.Fatal(err)
	}
	global := rpctest.Start(t, 1, limitsYAML, rpctest.Secure(t, creds))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	adminCfg := client.Config{Addrs: global.Addrs(), TLSFiles: client.TLSFiles{CAFile: creds.CAFile}, TokenFile: creds.TokenFile}
	opts, err := adminCfg.DialCredentials()
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(global.Addrs()[0], opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	admin := quotadv1.NewAdminClient(cc)
	tok, err := admin.CreateToken(ctx, &quotadv1.CreateTokenRequest{Role: "worker", Domains: []string{"api", "strict", "local"}})
	if err != nil {
		t.Fatal(err)
	}

	logs := &logBuf{}
	logger := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
	rc := rpctest.Start(t, 1, limitsYAML, func(_ int, c *rpc.AgentConfig) {
		c.Region = region.Agent("r0", client.Config{Addrs: global.Addrs(), TLSFiles: client.TLSFiles{CAFile: creds.CAFile}, Token: tok.Token})
		start := c.Region.Start
		c.Region.Start = func(node string, l func() *quota.Limits, f func(context.Context, *quota.Limits) (bool, error), _ *slog.Logger) (rpc.RegionHolder, error) {
			return start(node, l, f, logger)
		}
	})
	c, err := client.New(client.Config{Addrs: rc.Addrs(), Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	lent := func() error {
		for _, d := range []string{"api", "strict"} {
			var warm driver
			wctx, wcancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			warm.run(wctx, c, d, 1, 20*time.Millisecond).Wait()
			wcancel()
		}
		h, _ := rc.Agent(rc.Leader()).Region().(*region.Holder)
		if h == nil {
			return fmt.Errorf("no holder")
		}
		for _, sh := range h.Shares() {
			if sh.Status != "lent" || !sh.Local {
				return fmt.Errorf("%s share %s local=%v (%s)", sh.Domain, sh.Status, sh.Local, sh.Message)
			}
		}
		return nil
	}
	clustertest.Eventually(t, 15*time.Second, lent)
	time.Sleep(1500 * time.Millisecond) // a watch (every Refresh, 1s) has seen both shares held

	if _, err := admin.RevokeToken(ctx, &quotadv1.RevokeTokenRequest{Accessor: tok.Accessor}); err != nil {
		t.Fatal(err)
	}
	const ended = "ended without a renewal"
	clustertest.Eventually(t, lease+5*time.Second, func() error {
		if logs.count("level=WARN", ended, "domain=strict") != 1 || logs.count("level=WARN", ended, "domain=api") != 1 {
			return fmt.Errorf("no share-ended warning for both levels yet")
		}
		return nil
	})
	var load driver
	lctx, lcancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	load.run(lctx, c, "api", 1, 5*time.Millisecond).Wait()
	lcancel()

	var problems []string
	if logs.count("level=WARN", "refused this client's share renewal") == 0 {
		problems = append(problems, "the global client's refused-renewal warning is not in the node's log")
	}
	for _, d := range []string{"strict", "api"} {
		if logs.count("level=WARN", ended, "domain="+d, "refused") != 1 {
			problems = append(problems, fmt.Sprintf("the share-ended warning of %s does not say the global cluster refused the renewal", d))
		}
	}
	if logs.count("level=WARN", ended, "falling back") != 0 {
		problems = append(problems, "a share-ended warning says the level falls back to fallback_rate, which a refused credential does not")
	}
	if load.admitted.Load() != 0 || load.denied.Load() == 0 {
		problems = append(problems, fmt.Sprintf("api after the refusal and the grant's end: %d admitted, %d denied; want none admitted", load.admitted.Load(), load.denied.Load()))
	}
	for msg := range load.msgs {
		if !strings.Contains(msg, "refused") || strings.Contains(msg, "unreachable") {
			problems = append(problems, fmt.Sprintf("a refused admission says %q; want the global cluster's refusal named, not unreachable", msg))
		}
	}
	if len(problems) > 0 {
		t.Fatalf("%s\nlog:\n%s", strings.Join(problems, "\n"), logs.buf.String())
	}
}
