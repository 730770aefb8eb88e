package main

import (
	"errors"
	"testing"

	"github.com/quotad/quotad/rpc/rpctest"
)

// TestAcquireExitCodes: `quotad acquire` exits 0 admitted, 3 denied (a retry later may be
// admitted), 4 refused as invalid (an unknown domain, a cost above the bucket's capacity: no
// retry can help). Invalid requests exited 3 like denials, and a script retrying on 3 looped
// on a typo forever.
func TestAcquireExitCodes(t *testing.T) {
	c := rpctest.Start(t, 1, "domain: d\nrate_limit: {unit: hour, requests_per_unit: 1, burst: 1}\n")
	run := func(args ...string) int {
		t.Helper()
		cmd := acquireCmd()
		cmd.SetArgs(append([]string{"--addr", c.Addrs()[0]}, args...))
		cmd.SilenceUsage, cmd.SilenceErrors = true, true
		err := cmd.Execute()
		var ee exitError
		switch {
		case err == nil:
			return 0
		case errors.As(err, &ee):
			return ee.code
		}
		t.Fatalf("acquire %v: %v (no decision)", args, err)
		return -1
	}
	for _, tc := range []struct {
		args []string
		want int
	}{
		{[]string{"--domain", "d"}, 0},
		{[]string{"--domain", "d"}, 3},                // the burst is spent: rate_limited
		{[]string{"--domain", "dd"}, 4},               // unknown_domain
		{[]string{"--domain", "d", "--cost", "2"}, 4}, // above the bucket's capacity: invalid
	} {
		if got := run(tc.args...); got != tc.want {
			t.Errorf("quotad acquire %v: exit %d, want %d", tc.args, got, tc.want)
		}
	}
}
