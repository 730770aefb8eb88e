package main

import (
	"fmt"
	"time"

	"github.com/quotad/quotad/rpc"
)

// capFlags are the agent's caps on what one caller can make a node hold.
type capFlags struct {
	maxRequestBytes       int
	maxCallsPerIdentity   int
	maxWait               time.Duration
	waiters               rpc.WaiterCaps
	maxStreamsPerIdentity int
	streamSendTimeout     time.Duration
}

// intFlags is the part of a *pflag.FlagSet register uses.
type intFlags interface {
	IntVar(p *int, name string, value int, usage string)
	DurationVar(p *time.Duration, name string, value time.Duration, usage string)
}

func (c *capFlags) register(f intFlags) {
	f.IntVar(&c.maxStreamsPerIdentity, "max-streams-per-identity", rpc.DefaultMaxStreamsPerIdentity, "AcquireStreams one identity (token or client certificate; with --insecure, one client_id) may have open on the leader at once; a Go client process holds one (more are refused RESOURCE_EXHAUSTED and those clients send waiting admissions unary for 30 s)")
	f.DurationVar(&c.streamSendTimeout, "stream-send-timeout", rpc.DefaultStreamSendTimeout, "an AcquireStream whose client has not read its answers for this long is ended (DEADLINE_EXCEEDED) and its undecided admissions canceled")
	f.IntVar(&c.maxRequestBytes, "max-request-bytes", c.maxRequestBytes, "largest gRPC message accepted, in bytes")
	f.IntVar(&c.maxCallsPerIdentity, "max-calls-per-identity", rpc.DefaultMaxCallsPerIdentity, "gRPC calls one identity (token or client certificate) may have open on this node without their request: a unary call from its headers until its message arrives, a stream from its headers to its end (more are refused: ResourceExhausted; cluster nodes are not counted)")
	f.DurationVar(&c.maxWait, "max-wait", rpc.DefaultMaxWait, "longest an admission may wait on the leader (a longer max_wait_ms is taken as this; its denial says so); at least 1s")
	f.IntVar(&c.waiters.PerClient, "max-waiters-per-client", rpc.DefaultMaxWaitersPerClient, "admissions of one client_id that may wait on the leader at once (more are denied: too_many_waiters)")
	f.IntVar(&c.waiters.PerIdentity, "max-waiters-per-identity", 0, "admissions of one authenticated identity (token or client certificate) that may wait on the leader at once in one domain, whatever its client_ids (0: a quarter of --max-waiters-per-domain; more are denied: too_many_waiters)")
	f.IntVar(&c.waiters.PerDomain, "max-waiters-per-domain", rpc.DefaultMaxWaitersPerDomain, "admissions of one domain that may wait on the leader at once (more are denied: too_many_waiters)")
	f.IntVar(&c.waiters.PerStream, "max-stream-admissions", rpc.DefaultMaxStreamAdmissions, "undecided (or decided but unsent: a client not reading) admissions one AcquireStream may have on the leader at once (more are denied: too_many_waiters, scope stream)")
}

func (c *capFlags) apply(cfg *rpc.AgentConfig) error {
	switch {
	case c.maxRequestBytes < 1024:
		return fmt.Errorf("--max-request-bytes %d: use at least 1024 (default %d)", c.maxRequestBytes, rpc.DefaultMaxRequestBytes)
	case c.maxCallsPerIdentity < 1:
		return fmt.Errorf("--max-calls-per-identity %d: use at least 1 (default %d)", c.maxCallsPerIdentity, rpc.DefaultMaxCallsPerIdentity)
	case c.maxWait < time.Second:
		return fmt.Errorf("--max-wait %v: use at least 1s (default %v)", c.maxWait, rpc.DefaultMaxWait)
	case c.waiters.PerClient < 1:
		return fmt.Errorf("--max-waiters-per-client %d: use at least 1 (default %d)", c.waiters.PerClient, rpc.DefaultMaxWaitersPerClient)
	case c.waiters.PerIdentity < 0:
		return fmt.Errorf("--max-waiters-per-identity %d: use at least 1, or 0 for a quarter of --max-waiters-per-domain", c.waiters.PerIdentity)
	case c.waiters.PerDomain < 1:
		return fmt.Errorf("--max-waiters-per-domain %d: use at least 1 (default %d)", c.waiters.PerDomain, rpc.DefaultMaxWaitersPerDomain)
	case c.waiters.PerStream < 1:
		return fmt.Errorf("--max-stream-admissions %d: use at least 1 (default %d)", c.waiters.PerStream, rpc.DefaultMaxStreamAdmissions)
	case c.maxStreamsPerIdentity < 1:
		return fmt.Errorf("--max-streams-per-identity %d: use at least 1 (default %d)", c.maxStreamsPerIdentity, rpc.DefaultMaxStreamsPerIdentity)
	case c.streamSendTimeout < time.Second:
		return fmt.Errorf("--stream-send-timeout %v: use at least 1s (default %v)", c.streamSendTimeout, rpc.DefaultStreamSendTimeout)
	}
	cfg.MaxRequestBytes, cfg.MaxCallsPerIdentity, cfg.MaxWait, cfg.Waiters = c.maxRequestBytes, c.maxCallsPerIdentity, c.maxWait, c.waiters
	cfg.MaxStreamsPerIdentity, cfg.StreamSendTimeout = c.maxStreamsPerIdentity, c.streamSendTimeout
	return nil
}
