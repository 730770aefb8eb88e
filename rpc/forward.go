package rpc

import (
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/quotad/quotad/internal/grpcflow"
)

// MaxForwardedAnswer caps the leader's answer to a forwarded call (gRPC's default, 4 MiB, is
// for untrusted peers): a listing such as ShareStatus of every domain outgrows 4 MiB with a few
// thousand Limiters over per-tenant levels, and the follower refused to pass it on
// ("received message larger than max"). Clients that read listings raise theirs alike.
const MaxForwardedAnswer = 256 << 20

// forwarder keeps one client connection per leader address for forwarding calls.
type forwarder struct {
	creds credentials.TransportCredentials

	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
}

func newForwarder(creds credentials.TransportCredentials) *forwarder {
	if creds == nil {
		creds = insecure.NewCredentials()
	}
	return &forwarder{creds: creds, conns: make(map[string]*grpc.ClientConn)}
}

func (f *forwarder) conn(addr string) (*grpc.ClientConn, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if c, ok := f.conns[addr]; ok {
		return c, nil
	}
	c, err := grpc.NewClient(addr, append(grpcflow.DialOptions(), grpc.WithTransportCredentials(f.creds),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxForwardedAnswer)))...)
	if err != nil {
		return nil, err
	}
	f.conns[addr] = c
	return c, nil
}

func (f *forwarder) close() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for addr, c := range f.conns {
		c.Close()
		delete(f.conns, addr)
	}
}
