package client

import (
	"fmt"
	"net"
	"strconv"
	"strings"
)

// CheckAddr reports why a is not a node address the client can dial: it must be host:port
// with a port in 1..65535 (gRPC would otherwise dial 443 for a bare host), unless it is a gRPC
// target with a scheme (dns:///host:port, unix:///path), which is passed on as it is.
func CheckAddr(a string) error {
	if strings.Contains(a, "://") || strings.HasPrefix(a, "unix:") {
		return nil
	}
	host, port, err := net.SplitHostPort(a)
	if err != nil {
		if strings.Contains(err.Error(), "missing port") {
			return fmt.Errorf("%q has no port; use host:port, e.g. %s", a, net.JoinHostPort(strings.Trim(a, "[]"), "7101"))
		}
		return fmt.Errorf("%q is not host:port: %v", a, err)
	}
	if host == "" {
		return fmt.Errorf("%q has no host; use host:port, e.g. 127.0.0.1:%s", a, port)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("%q has port %q; use a port number 1..65535", a, port)
	}
	return nil
}
