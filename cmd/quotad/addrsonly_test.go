package main

import (
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/quotad/quotad/client"
)

// The client commands' --configured-addrs-only and $QUOTAD_CONFIGURED_ADDRS_ONLY reach the
// client library's Config.ConfiguredAddrsOnly (the flag wins), and a value that is not a
// boolean stops every client command before it dials, naming the value.
func TestConfiguredAddrsOnlyFlagAndEnv(t *testing.T) {
	parse := func(args ...string) {
		t.Helper()
		pf := pflag.NewFlagSet("quotad", pflag.ContinueOnError)
		clientFlags(pf)
		if err := pf.Parse(args); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		env  string
		args []string
		want bool
	}{
		{"", nil, false},
		{"true", nil, true},
		{"0", nil, false},
		{"", []string{"--configured-addrs-only"}, true},
		{"true", []string{"--configured-addrs-only=false"}, false},
	} {
		t.Setenv(client.EnvConfiguredAddrsOnly, tc.env)
		parse(tc.args...)
		if got := connConfig("127.0.0.1:7101").ConfiguredAddrsOnly; got != tc.want {
			t.Errorf("$%s=%q %v: ConfiguredAddrsOnly %v, want %v", client.EnvConfiguredAddrsOnly, tc.env, tc.args, got, tc.want)
		}
	}

	t.Setenv(client.EnvConfiguredAddrsOnly, "yes")
	parse()
	cmd := &cobra.Command{Use: "status"}
	addrFlag(cmd.Flags(), new(string))
	err := checkAddrFlag(cmd)
	if err == nil || !strings.Contains(err.Error(), `$QUOTAD_CONFIGURED_ADDRS_ONLY is "yes"`) {
		t.Fatalf("$%s=yes: %v, want a refusal naming the value", client.EnvConfiguredAddrsOnly, err)
	}
	// The flag given: it wins, and the environment's bogus value is not read (as
	// client.Flags does); the client library accepts the config.
	for _, arg := range []string{"--configured-addrs-only", "--configured-addrs-only=false"} {
		parse(arg)
		if err := checkAddrFlag(cmd); err != nil {
			t.Fatalf("$%s=yes with %s: %v, want the flag to win", client.EnvConfiguredAddrsOnly, arg, err)
		}
		cfg := connConfig("127.0.0.1:7101")
		if err := cfg.Validate(); err != nil || cfg.ConfiguredAddrsOnly != (arg == "--configured-addrs-only") {
			t.Fatalf("$%s=yes with %s: ConfiguredAddrsOnly %v, Validate %v", client.EnvConfiguredAddrsOnly, arg, cfg.ConfiguredAddrsOnly, err)
		}
	}
}
