package rpc_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/client"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

const hourlyLimits = `
domain: slow
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 1}
`

// TestMaxWaitIsCapped: a max_wait_ms above the leader's --max-wait is taken as --max-wait, and
// the denial says what was asked and the cap. Here the bucket refills in an hour: asked to
// wait a day the admission would queue for that hour; capped at 2 s it is denied at once,
// since it cannot be admitted within 2 s. The Go client, whose waits go over AcquireStream,
// gets the same answer.
func TestMaxWaitIsCapped(t *testing.T) {
	c := rpctest.Start(t, 3, hourlyLimits, func(_ int, cfg *rpc.AgentConfig) { cfg.MaxWait = 2 * time.Second })
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[c.Leader()]))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	adm := func(id uint64, wait time.Duration) *quotadv1.Admission {
		return &quotadv1.Admission{RequestId: id, Domain: "slow", Cost: 1, MaxWaitMs: wait.Milliseconds(),
			Descriptors: []*quotadv1.Entry{{Key: "k", Value: "a"}}}
	}
	if d, err := acquireOne(ctx, q, "c", adm(1, 0)); err != nil || !d.Admitted {
		t.Fatalf("first admission: %v %v", d, err)
	}
	start := time.Now()
	d, err := acquireOne(ctx, q, "c", adm(2, 24*time.Hour))
	if err != nil {
		t.Fatalf("a day's wait on a bucket that refills in an hour: %v (after %v); want a denial at once: the wait is capped at --max-wait 2s", err, time.Since(start))
	}
	if d.Admitted || !strings.Contains(d.Message, "max_wait_ms 86400000 was capped at 2000") || !strings.Contains(d.Message, "--max-wait 2s") {
		t.Fatalf("decision %+v: want a denial saying max_wait_ms 86400000 was capped at 2000 (--max-wait 2s)", d)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Fatalf("denied after %v; want at once (within the 2 s cap)", took)
	}

	cl, err := client.New(client.Config{Addrs: c.Addrs(), Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	cd, err := cl.Allow(ctx, client.Request{Domain: "slow", Descriptors: []client.Entry{{Key: "k", Value: "a"}}, MaxWait: 24 * time.Hour})
	if !errors.Is(err, client.ErrDenied) || !strings.Contains(cd.Message, "capped at 2000") {
		t.Fatalf("client with MaxWait 24h: %+v %v; want a denial saying the wait was capped", cd, err)
	}
}
