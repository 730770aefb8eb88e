package rpc

import (
	"testing"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// TestForwardBatchesStayWithinBytes: a lane's batch carries calls whose requests together stay
// within its batch bytes, so the leader's message cap never refuses a whole batch — one
// caller's large request failed every other caller's in the same batch (review finding).
func TestForwardBatchesStayWithinBytes(t *testing.T) {
	l := &forwardLane{r: &rlsServer{batchBytes: 1000}}
	for _, n := range []int{300, 300, 300, 300, 900, 10, 10} {
		l.queue = append(l.queue, &forwardedCall{call: &quotadv1.ForwardedCall{Request: make([]byte, n)}})
	}
	var sizes [][]int
	for len(l.queue) > 0 {
		var b []int
		for _, fc := range l.take() {
			b = append(b, len(fc.call.Request))
		}
		sizes = append(sizes, b)
	}
	want := [][]int{{300, 300, 300}, {300}, {900, 10, 10}}
	if len(sizes) != len(want) {
		t.Fatalf("batches %v, want %v", sizes, want)
	}
	for i := range want {
		if len(sizes[i]) != len(want[i]) {
			t.Fatalf("batches %v, want %v", sizes, want)
		}
	}
}
