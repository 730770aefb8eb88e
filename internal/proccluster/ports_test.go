package proccluster

import "testing"

// TestFreePortsNeverRepeat: ports handed out earlier in the process are never handed out again
// (each call closes its listeners, so the kernel may offer a port twice).
func TestFreePortsNeverRepeat(t *testing.T) {
	seen := map[int]bool{}
	for range 100 {
		ps, err := FreePorts(4)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range ps {
			if seen[p] {
				t.Fatalf("port %d handed out twice", p)
			}
			seen[p] = true
		}
	}
}
