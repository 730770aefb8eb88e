package region_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/quota"
	"github.com/quotad/quotad/region"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// logBuf collects a logger's lines (slog's text handler writes a record in one Write).
type logBuf struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuf) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// count is the number of lines holding every one of subs.
func (b *logBuf) count(subs ...string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for line := range strings.SplitSeq(b.buf.String(), "\n") {
		all := true
		for _, s := range subs {
			all = all && strings.Contains(line, s)
		}
		if all {
			n++
		}
	}
	return n
}

// A share that ends without a renewal (the global cluster down) is logged once per level, as a
// WARN saying what the region does now (its fallback slice, or failing closed), and its return
// once, as an INFO — not per request, however many requests the level refuses meanwhile.
func TestRegionsShareEndLogged(t *testing.T) {
	global := rpctest.Start(t, 1, limitsYAML)
	logs := &logBuf{}
	logger := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
	rc := rpctest.Start(t, 1, limitsYAML, func(_ int, c *rpc.AgentConfig) {
		c.Region = region.Agent("r0", client.Config{Addrs: global.Addrs(), Insecure: true})
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
	// lent: both global levels decided on a share (some demand, or a share may be too small).
	lent := func() error {
		for _, d := range []string{"api", "strict"} {
			var warm driver
			ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			warm.run(ctx, c, d, 1, 20*time.Millisecond).Wait()
			cancel()
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

	const ended, regained = "ended without a renewal", "regained a share"
	if n := logs.count(ended); n != 0 {
		t.Fatalf("%d share-ended lines before the global cluster stopped:\n%s", n, logs.buf.String())
	}
	global.Kill(0)
	// Requests keep arriving (and are refused) while the shares are gone.
	ctx, cancel := context.WithCancel(context.Background())
	var load driver
	wg := load.run(ctx, c, "strict", 2, 5*time.Millisecond)
	clustertest.Eventually(t, lease+5*time.Second, func() error {
		if logs.count("level=WARN", ended, "domain=strict", "failing closed") != 1 ||
			logs.count("level=WARN", ended, "domain=api", "falling back to its slice of shares.fallback_rate") != 1 {
			return fmt.Errorf("no share-ended warning for both levels yet")
		}
		return nil
	})
	time.Sleep(2500 * time.Millisecond) // more watches, many refused requests
	cancel()
	wg.Wait()
	if load.denied.Load() == 0 {
		t.Fatalf("strict refused nothing with the global cluster down (admitted %d)", load.admitted.Load())
	}
	if n := logs.count(ended); n != 2 {
		t.Fatalf("%d share-ended lines after %d refusals, want 2 (one per level):\n%s", n, load.denied.Load(), logs.buf.String())
	}

	global.Restart(0)
	clustertest.Eventually(t, 20*time.Second, lent)
	clustertest.Eventually(t, 5*time.Second, func() error {
		for _, d := range []string{"api", "strict"} {
			if n := logs.count("level=INFO", regained, "domain="+d); n != 1 {
				return fmt.Errorf("%d regained lines for %s, want 1", n, d)
			}
		}
		return nil
	})
	time.Sleep(1500 * time.Millisecond)
	if n, m := logs.count(regained), logs.count(ended); n != 2 || m != 2 {
		t.Fatalf("%d regained and %d ended lines, want 2 and 2:\n%s", n, m, logs.buf.String())
	}
	t.Logf("%d refusals during the outage, logged as:\n%s", load.denied.Load(), grep(logs, ended, regained))
}

func grep(b *logBuf, subs ...string) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for line := range strings.SplitSeq(b.buf.String(), "\n") {
		for _, s := range subs {
			if strings.Contains(line, s) {
				out = append(out, line)
				break
			}
		}
	}
	return strings.Join(out, "\n")
}
