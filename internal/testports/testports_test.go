package testports

import (
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
)

// TestReserveNeverRepeatsAndStaysOutOfTheEphemeralRange: no port twice in a process, none in
// the range the kernel hands to :0 listeners and outgoing connections, each bindable.
func TestReserveNeverRepeatsAndStaysOutOfTheEphemeralRange(t *testing.T) {
	_, hi, err := span()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for range 50 {
		ps, err := Reserve(4)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range ps {
			if seen[p] {
				t.Fatalf("port %d handed out twice", p)
			}
			seen[p] = true
			if p < lowest || p > hi {
				t.Fatalf("port %d outside %d-%d", p, lowest, hi)
			}
		}
	}
	for p := range seen {
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			t.Fatalf("reserved port %d not bindable: %v", p, err)
		}
		l.Close()
	}
}

// TestReserveLocksAcrossProcesses: another process (another open file description) cannot
// take the lock of a reserved port, so two test binaries never share one.
func TestReserveLocksAcrossProcesses(t *testing.T) {
	ps, err := Reserve(1)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(filepath.Join(os.TempDir(), "quotad-test-ports", strconv.Itoa(ps[0])))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err == nil {
		t.Fatalf("port %d: its lock was free while reserved", ps[0])
	}
}

func TestReserveBase(t *testing.T) {
	offs := []int{1, 2, 3, 101, 201, 301}
	b, err := ReserveBase(offs...)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range offs {
		if !func() bool { reserved.Lock(); defer reserved.Unlock(); _, ok := reserved.ports[b+o]; return ok }() {
			t.Fatalf("base %d: port %d not reserved", b, b+o)
		}
	}
}
