//go:build !(linux || darwin || freebsd || netbsd || openbsd)

package cluster

import "net"

// peerClosed cannot tell on this platform (no MSG_PEEK probe): raft reuses pooled
// connections as it would without redialLayer.
func peerClosed(net.Conn) (bool, string) { return false, "" }
