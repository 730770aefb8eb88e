package main

import (
	"strings"
	"testing"
)

// TestTopRefusesBadFlags: quotad top refuses a refresh interval that is not positive and an
// oversubscription ratio that is not above 0, naming the value, before dialing anything.
// --interval 0 and -1s printed one frame and exited as if --once; --max-oversubscription -1
// warned about every parent ("0.40x ... (above -1.00x)") — user trial, session 11.
func TestTopRefusesBadFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--interval", "0"}, "--interval 0s"},
		{[]string{"--interval", "-1s"}, "--interval -1s"},
		{[]string{"--max-oversubscription", "-1"}, "--max-oversubscription -1"},
		{[]string{"--max-oversubscription", "NaN"}, "--max-oversubscription NaN"},
	} {
		cmd := topCmd()
		cmd.SetArgs(append(tc.args, "--addr", "127.0.0.1:1"))
		cmd.SilenceUsage, cmd.SilenceErrors = true, true
		if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("top %v: %v, want an error naming %q", tc.args, err, tc.want)
		}
	}
}
