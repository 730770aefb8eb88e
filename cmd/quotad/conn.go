package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/quotad/quotad/client"
)

// reachTimeout bounds how long a client command waits for any of its --addr nodes to answer
// at all before it gives up, naming each address and why.
const reachTimeout = 1500 * time.Millisecond

// addrSource names where the client command's addresses came from, for messages.
var addrSource = "--addr"

// checkAddrFlag runs before every command with an --addr flag: each address must be
// host:port, and $QUOTAD_CONFIGURED_ADDRS_ONLY true or false if set. (That one of them
// answers is checked at the first call: reach.)
func checkAddrFlag(cmd *cobra.Command) error {
	f := cmd.Flags().Lookup("addr")
	if f == nil {
		return nil
	}
	source := "--addr"
	if !f.Changed && os.Getenv(client.EnvAddr) != "" {
		source = "$" + client.EnvAddr
	}
	addrSource = source
	list := splitList(f.Value.String())
	if len(list) == 0 {
		return fmt.Errorf("%s is empty: give one or more node gRPC addresses, e.g. 127.0.0.1:7101,127.0.0.1:7102", source)
	}
	for _, a := range list {
		if err := client.CheckAddr(a); err != nil {
			return fmt.Errorf("%s: %v", source, err)
		}
	}
	// Every client command reads it (through the client library, or dialing --addr only),
	// unless --configured-addrs-only was given: the flag wins, as in client.Flags.
	if cliFlags != nil && cliFlags.Changed(addrsOnlyFlag) {
		return nil
	}
	_, _, err := client.ConfiguredAddrsOnlyFromEnv()
	return err
}

// reach probes every address at once and returns nil as soon as one answers (any answer,
// even "not serving", means a node is there; the command then retries as it always did). If
// none answers within reachTimeout it names each address and why.
func reach(ctx context.Context, addrs []string) error {
	source := addrSource
	opts, err := dialOptions()
	if err != nil {
		return err
	}
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, cancel := context.WithTimeout(ctx, reachTimeout)
	defer cancel()
	type result struct {
		addr string
		err  error
	}
	results := make(chan result, len(addrs))
	var wg sync.WaitGroup
	for _, a := range addrs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results <- result{a, probe(ctx, a, opts)}
		}()
	}
	go func() { wg.Wait(); close(results) }()
	why := make(map[string]string, len(addrs))
	for r := range results {
		if r.err == nil {
			return nil // one node answers: the command takes it from here
		}
		why[r.addr] = r.err.Error()
	}
	var b strings.Builder
	fmt.Fprintf(&b, "no node answered (%s):", source)
	for _, a := range addrs {
		fmt.Fprintf(&b, "\n  %s: %s", a, why[a])
	}
	return fmt.Errorf("%s%s", b.String(), plaintextHint())
}

// probe asks addr's health service (open to everyone) once. Any answer from a gRPC server is
// success; an error says why the node could not be reached.
func probe(ctx context.Context, addr string, opts []grpc.DialOption) error {
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		return err
	}
	defer conn.Close()
	_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	switch status.Code(err) {
	case codes.OK, codes.NotFound, codes.PermissionDenied, codes.Unauthenticated:
		return nil
	case codes.Unimplemented: // every quotad node serves grpc.health.v1
		return fmt.Errorf("answers, but is not a quotad node (%s)", status.Convert(err).Message())
	case codes.DeadlineExceeded:
		return fmt.Errorf("no answer within %v (nothing listening that answers, or a firewall drops the packets)", reachTimeout)
	}
	return fmt.Errorf("%s", dialReason(err))
}

// dialReason shortens a gRPC connection error to its cause ("connection refused").
func dialReason(err error) string {
	msg := status.Convert(err).Message()
	if i := strings.Index(msg, `desc = "`); i >= 0 {
		msg = strings.TrimSuffix(msg[i+len(`desc = "`):], `"`)
	}
	msg = strings.TrimPrefix(msg, "transport: ")
	msg = strings.TrimPrefix(msg, "Error while dialing: ")
	if i := strings.LastIndex(msg, ": connect: "); i >= 0 {
		msg = msg[i+len(": connect: "):]
	}
	return msg
}
