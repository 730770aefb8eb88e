// Package grpcflow holds the HTTP/2 flow-control settings of every gRPC connection quotad
// makes or accepts: the client library's, the agents' server side, and a follower's forwarding
// connection to the leader.
//
// The windows are static. With grpc-go's default (dynamic windows), a receiver that gets a
// DATA frame after its previous bandwidth-delay-product PING was answered sends a
// WINDOW_UPDATE and a new PING, and the peer answers the PING. With one call at a time — the
// serial exact path — that is every call, in both directions: per call two more frames
// written by each side, two more reads, and the wake-ups of the goroutines (and processes)
// that handle them, on the path of the call or right beside it. Static windows send neither.
// The windows below cover the largest request (rpc.DefaultMaxRequestBytes, 1 MiB) and many
// concurrent calls on one connection; on a link with a long round trip a single stream's
// throughput is bounded by StreamWindow per round trip (20 MB/s at 100 ms), which only a
// snapshot restore streamed to a far node could notice.
package grpcflow

import "google.golang.org/grpc"

const (
	// StreamWindow is the flow-control window of each stream (call).
	StreamWindow = 2 << 20
	// ConnWindow is the flow-control window of each connection.
	ConnWindow = 8 << 20
)

// ServerOptions are the gRPC server options that set the static windows.
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.StaticStreamWindowSize(StreamWindow), grpc.StaticConnWindowSize(ConnWindow)}
}

// DialOptions are the gRPC dial options that set the static windows.
func DialOptions() []grpc.DialOption {
	return []grpc.DialOption{grpc.WithStaticStreamWindowSize(StreamWindow), grpc.WithStaticConnWindowSize(ConnWindow)}
}
