package main

import (
	"testing"
	"time"
)

// TestDevTellsStartFailureFromKill runs real processes under devCluster: a node that exits
// with an error right away failed to start; one killed by a signal, however soon, did not
// (CI flake: dev gave up with "every node exited within 5s" when a test killed all nodes
// 2.6 s after they started).
func TestDevTellsStartFailureFromKill(t *testing.T) {
	dc := newDevCluster("/bin/sh", t.TempDir(), [][]string{
		{"-c", "exit 3", "bad-flag"},
		{"-c", "kill -9 $$", "killed"},
		{"-c", "exit 0", "clean"},
	})
	for i := range dc.nodes {
		if err := dc.start(i); err != nil {
			t.Fatal(err)
		}
	}
	want := map[string]bool{"bad-flag": true, "killed": false, "clean": false}
	for range dc.nodes {
		select {
		case x := <-dc.exits:
			id := dc.nodes[x.i].id
			if got := x.failedToStart(); got != want[id] {
				t.Errorf("%s (exit %v after %v): failedToStart = %v, want %v", id, x.err, x.ran, got, want[id])
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a node did not exit")
		}
	}
	dc.wg.Wait()

	// A restarted node's exit is not its first run: never a start failure.
	if err := dc.start(0); err != nil {
		t.Fatal(err)
	}
	if x := <-dc.exits; x.failedToStart() {
		t.Errorf("a restart's exit (%v) counted as a start failure", x.err)
	}
	dc.wg.Wait()
}
