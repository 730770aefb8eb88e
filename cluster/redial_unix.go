//go:build linux || darwin || freebsd || netbsd || openbsd

package cluster

import (
	"errors"
	"net"
	"os"
	"syscall"
)

// peerClosed reports whether the peer closed c (an end of stream, a reset, or bytes nobody
// asked for pending on an idle raft connection), and what was seen; false when c is open or
// the probe cannot tell. It does not wait and consumes nothing (MSG_PEEK|MSG_DONTWAIT on the
// TCP socket under c).
func peerClosed(c net.Conn) (bool, string) {
	tc := rawConn(c)
	if tc == nil {
		return false, ""
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return false, ""
	}
	var (
		n    int
		rerr error
		buf  [1]byte
	)
	err = rc.Read(func(fd uintptr) bool {
		n, _, rerr = syscall.Recvfrom(int(fd), buf[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		return true // never wait for readiness: this is a probe
	})
	switch {
	case errors.Is(err, net.ErrClosed):
		return true, "closed"
	case err != nil:
		return false, "" // a past read deadline, say: cannot tell
	case errors.Is(rerr, syscall.EAGAIN), errors.Is(rerr, syscall.EWOULDBLOCK), errors.Is(rerr, syscall.EINTR):
		return false, ""
	case rerr != nil:
		return true, os.NewSyscallError("recvfrom", rerr).Error()
	case n == 0:
		return true, "end of stream"
	default:
		return true, "bytes pending on an idle connection (a TLS close_notify)"
	}
}
