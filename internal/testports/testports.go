// Package testports hands tests loopback ports that something binds later by number: a node
// restarted on its old address, an agent started as a separate process. A port picked with
// :0 and closed is not safe for that: the kernel hands the same ephemeral range to every
// other :0 listener and to every outgoing connection's local port, so between the close and
// the bind another test, another test binary or a client socket may take it (CI: "raft
// transport on 127.0.0.1:46641: bind: address already in use" when a killed node restarted).
//
// Reserve therefore picks ports below the kernel's ephemeral range (never handed out
// implicitly), never hands a port out twice in one process, and holds an flock on a file per
// port for the life of the process so concurrently running test binaries of this module
// never share one. It must never be used outside tests: reserved ports are not given back.
//
// Where a component can bind :0 itself and report its address, that stays the better way.
package testports

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// lowest is the lowest port Reserve hands out (clear of well-known service ports).
const lowest = 10000

var reserved struct {
	sync.Mutex
	ports map[int]*os.File // the held lock file of each port this process reserved
}

// Reserve returns n distinct ports on 127.0.0.1, each free for TCP and UDP right now (gossip
// binds both), outside the kernel's ephemeral range, and reserved for this process.
func Reserve(n int) ([]int, error) {
	lo, hi, err := span()
	if err != nil {
		return nil, err
	}
	reserved.Lock()
	defer reserved.Unlock()
	var out []int
	for tries := 0; len(out) < n; tries++ {
		if tries > 200*n {
			release(out)
			return nil, fmt.Errorf("testports: no free port in %d-%d after %d tries", lo, hi, tries)
		}
		if p := lo + rand.IntN(hi-lo+1); take(p) {
			out = append(out, p)
		}
	}
	return out, nil
}

// ReserveBase returns a base port b such that every b+offset is reserved as Reserve's ports
// are (for a program that derives its ports from a base, like quotad dev --port-base).
func ReserveBase(offsets ...int) (int, error) {
	lo, hi, err := span()
	if err != nil {
		return 0, err
	}
	top := 0
	for _, o := range offsets {
		top = max(top, o)
	}
	if hi-top <= lo {
		return 0, fmt.Errorf("testports: offsets up to %d do not fit in ports %d-%d", top, lo, hi)
	}
	reserved.Lock()
	defer reserved.Unlock()
	for range 200 {
		b := lo + rand.IntN(hi-top-lo)
		var got []int
		for _, o := range offsets {
			if !take(b + o) {
				break
			}
			got = append(got, b+o)
		}
		if len(got) == len(offsets) {
			return b, nil
		}
		release(got)
	}
	return 0, fmt.Errorf("testports: no base in %d-%d with offsets %v free", lo, hi, offsets)
}

// InUse reports whether err is a bind refused because the address is in use (also when a
// library flattened the error into text, as memberlist does).
func InUse(err error) bool {
	return err != nil && (errors.Is(err, syscall.EADDRINUSE) || strings.Contains(err.Error(), "address already in use"))
}

// span is the range Reserve picks from: [lowest, first ephemeral port).
func span() (lo, hi int, err error) {
	first := 32768 // Linux's default when the range cannot be read
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil {
				first = v
			}
		}
	}
	if first-1-lowest < 1000 {
		return 0, 0, fmt.Errorf("testports: the ephemeral port range starts at %d, leaving fewer than 1000 ports above %d; raise net.ipv4.ip_local_port_range", first, lowest)
	}
	return lowest, first - 1, nil
}

// take reserves port p if no one holds it: not in this process, not locked by another process
// of this module's tests, and bindable for TCP and UDP now. Called with reserved locked.
func take(p int) bool {
	if reserved.ports == nil {
		reserved.ports = map[int]*os.File{}
	}
	if _, ok := reserved.ports[p]; ok {
		return false
	}
	dir := filepath.Join(os.TempDir(), "quotad-test-ports")
	if err := os.MkdirAll(dir, 0o777); err != nil {
		return false
	}
	// Ports are one machine-wide resource, so the lock files are shared by every user: the
	// directory is made world-writable and sticky, as /tmp (umask took that from MkdirAll),
	// and a lock needs only a read descriptor of another user's file.
	_ = os.Chmod(dir, 0o777|os.ModeSticky)
	f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(p)), os.O_CREATE|os.O_RDONLY, 0o644)
	if err != nil {
		return false
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return false
	}
	if !bindable(p) {
		f.Close() // closing drops the lock
		return false
	}
	reserved.ports[p] = f
	return true
}

func release(ps []int) {
	for _, p := range ps {
		reserved.ports[p].Close()
		delete(reserved.ports, p)
	}
}

func bindable(p int) bool {
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return false
	}
	defer l.Close()
	u, err := net.ListenPacket("udp", addr)
	if err != nil {
		return false
	}
	u.Close()
	return true
}
