package cluster

import (
	"testing"

	"github.com/hashicorp/raft"
)

// TestEffectiveCommandVersion: the lowest known version of the configuration's servers (voters
// and non-voters, alive or failed; this node's own advertisement for itself), capped at the
// version this node's FSM applies; unknown versions (0, or never seen) do not count.
func TestEffectiveCommandVersion(t *testing.T) {
	servers := []raft.Server{{ID: "a", Suffrage: raft.Voter}, {ID: "b", Suffrage: raft.Voter}, {ID: "c", Suffrage: raft.Nonvoter}}
	withCmd := func(v int, alive bool) peer { return peer{meta: nodeMeta{Cmd: v}, alive: alive} }
	for _, tc := range []struct {
		name  string
		own   int
		self  int
		peers map[string]peer
		want  int
	}{
		{"all current", 6, 6, map[string]peer{"b": withCmd(6, true), "c": withCmd(6, true)}, 6},
		{"an older voter", 7, 7, map[string]peer{"b": withCmd(6, true), "c": withCmd(7, true)}, 6},
		{"an older non-voter", 7, 7, map[string]peer{"b": withCmd(7, true), "c": withCmd(6, true)}, 6},
		{"a failed older voter", 7, 7, map[string]peer{"b": withCmd(6, false), "c": withCmd(7, true)}, 6},
		{"advertising none", 7, 7, map[string]peer{"b": withCmd(0, true), "c": withCmd(7, true)}, 7},
		{"never seen: the oldest advertising build", 7, 7, map[string]peer{"c": withCmd(7, true)}, 6},
		{"never seen, own older", 5, 5, map[string]peer{"c": withCmd(5, true)}, 5},
		{"newer peers, capped", 6, 6, map[string]peer{"b": withCmd(9, true), "c": withCmd(8, true)}, 6},
		{"self advertises older", 7, 5, map[string]peer{"b": withCmd(7, true), "c": withCmd(7, true)}, 5},
		{"FSM says nothing", 0, 0, map[string]peer{"b": withCmd(6, true)}, 0},
	} {
		if got := effectiveCommandVersion(tc.own, servers, "a", tc.self, tc.peers); got != tc.want {
			t.Errorf("%s: effectiveCommandVersion = %d, want %d", tc.name, got, tc.want)
		}
	}
}
