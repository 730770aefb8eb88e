package chaos

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// fakeBackend is a Backend without processes: it records what the nemesis asked for.
type fakeBackend struct {
	running, paused, isolated []bool
	starts                    []int
	calls                     []string
}

func newFakeBackend(n int) *fakeBackend {
	f := &fakeBackend{}
	for range n {
		_, _ = f.Prepare()
	}
	return f
}

func (f *fakeBackend) Name() string { return "fake" }
func (f *fakeBackend) Len() int     { return len(f.running) }
func (f *fakeBackend) Addrs(i int) NodeAddrs {
	a := fmt.Sprintf("10.0.0.%d", i+1)
	return NodeAddrs{ID: fmt.Sprintf("node%d", i+1), GRPC: a + ":1", Raft: a + ":2", Gossip: a + ":3", HTTP: a + ":4"}
}
func (f *fakeBackend) Prepare() (int, error) {
	f.running, f.paused, f.isolated = append(f.running, false), append(f.paused, false), append(f.isolated, false)
	f.starts = append(f.starts, 0)
	return len(f.running) - 1, nil
}
func (f *fakeBackend) log(format string, a ...any) {
	f.calls = append(f.calls, fmt.Sprintf(format, a...))
}
func (f *fakeBackend) Start(i int) error {
	if !f.running[i] {
		f.running[i] = true
		f.starts[i]++
		f.log("start %d", i)
	}
	return nil
}
func (f *fakeBackend) Kill(i int) error { f.running[i] = false; f.log("kill %d", i); return nil }
func (f *fakeBackend) Stop(i int, _ time.Duration) error {
	f.running[i] = false
	f.log("stop %d", i)
	return nil
}
func (f *fakeBackend) Pause(i int) error  { f.paused[i] = true; return nil }
func (f *fakeBackend) Resume(i int) error { f.paused[i] = false; return nil }
func (f *fakeBackend) Running(i int) bool { return f.running[i] }
func (f *fakeBackend) Paused(i int) bool  { return f.paused[i] }
func (f *fakeBackend) Starts(i int) int   { return f.starts[i] }
func (f *fakeBackend) Close()             {}

// fakeIsolator adds network isolation (the Docker backend's partitions).
type fakeIsolator struct{ *fakeBackend }

func (f fakeIsolator) Isolate(i int) error { f.isolated[i] = true; f.log("isolate %d", i); return nil }
func (f fakeIsolator) Reconnect() error {
	for i := range f.isolated {
		f.isolated[i] = false
	}
	f.log("reconnect")
	return nil
}

func testNemesis(b Backend) *nemesis {
	c := NewCluster(b)
	return &nemesis{c: c, rec: newRecorder(1), rng: newRand(1), log: func(string, ...any) {}, bootstrap: 3}
}

func TestReviveStraysRestartsNodesDownOutsideFaults(t *testing.T) {
	fb := newFakeBackend(4)
	nm := testNemesis(fb)
	for i := range 3 {
		_ = fb.Start(i)
	}
	nm.reviveStrays()
	if len(nm.rec.snapshot().Strays) != 0 || fb.running[3] {
		t.Fatalf("a never-started slot is not a stray: %v", fb.calls)
	}
	// Stopped from outside (e.g. a stray SIGTERM), and one removed by the membership fault.
	fb.running[0], fb.running[1] = false, false
	nm.c.Nodes[1].Removed = true
	nm.reviveStrays()
	if !fb.running[0] || fb.running[1] {
		t.Fatalf("running %v: want node1 restarted, node2 (removed) left down", fb.running)
	}
	if s := nm.rec.snapshot().Strays; len(s) != 1 {
		t.Fatalf("strays %v", s)
	}
}

func TestPartitionWithIsolatorDisconnectsEveryNodeOutsideTheLargestGroup(t *testing.T) {
	fb := newFakeBackend(5)
	for i := range 5 {
		_ = fb.Start(i)
	}
	nm := testNemesis(fakeIsolator{fb})
	n := nm.c.Nodes
	nm.partition([][]*Node{{n[0], n[1]}, {n[2], n[3], n[4]}})
	if want := []bool{true, true, false, false, false}; !slices.Equal(fb.isolated, want) {
		t.Fatalf("isolated %v, want %v", fb.isolated, want)
	}
	nm.healAll("net")
	if slices.Contains(fb.isolated, true) {
		t.Fatalf("still isolated after heal: %v", fb.isolated)
	}
	nm.partition([][]*Node{{n[3]}, {n[0], n[1], n[2], n[4]}})
	if want := []bool{false, false, false, true, false}; !slices.Equal(fb.isolated, want) {
		t.Fatalf("isolated %v, want %v", fb.isolated, want)
	}
	nm.healAll("clock") // not a network heal
	if !fb.isolated[3] {
		t.Fatal("a clock heal reconnected the network")
	}
}
