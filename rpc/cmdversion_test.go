package rpc_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	fsmv1 "github.com/quotad/quotad/api/quotad/fsm/v1"
	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/cluster/clustertest"
	"github.com/quotad/quotad/fsm"
	"github.com/quotad/quotad/rpc"
	"github.com/quotad/quotad/rpc/rpctest"
)

// entryVersions records, per node, the command version of every Command entry the node
// stores in its Raft log.
type entryVersions struct {
	mu      sync.Mutex
	byIndex []map[uint64]uint32
}

func newEntryVersions(n int) *entryVersions {
	v := &entryVersions{byIndex: make([]map[uint64]uint32, n)}
	for i := range v.byIndex {
		v.byIndex[i] = map[uint64]uint32{}
	}
	return v
}

// wrap is a rpctest.Option that records node i's entries.
func (v *entryVersions) wrap(i int, cfg *rpc.AgentConfig) {
	cfg.Cluster.WrapLogStore = func(s raft.LogStore) raft.LogStore { return versionLog{s, v, i} }
}

// since returns node i's Command entries above index, by index.
func (v *entryVersions) since(i int, index uint64) map[uint64]uint32 {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := map[uint64]uint32{}
	for idx, ver := range v.byIndex[i] {
		if idx > index {
			out[idx] = ver
		}
	}
	return out
}

type versionLog struct {
	raft.LogStore
	v    *entryVersions
	node int
}

func (l versionLog) StoreLog(e *raft.Log) error { return l.StoreLogs([]*raft.Log{e}) }
func (l versionLog) StoreLogs(es []*raft.Log) error {
	l.v.mu.Lock()
	for _, e := range es {
		if e.Type != raft.LogCommand {
			continue
		}
		var cmd fsmv1.Command
		if err := proto.Unmarshal(e.Data, &cmd); err == nil {
			l.v.byIndex[l.node][e.Index] = cmd.Version
		}
	}
	l.v.mu.Unlock()
	return l.LogStore.StoreLogs(es)
}

// checkEntriesAt waits until the leader writes entries at command version want, commits a few
// (admissions and limits) and checks that every node stored each Command entry after them at
// want: a build that applies only want would follow the log.
func checkEntriesAt(t *testing.T, c *rpctest.Cluster, rec *entryVersions, want int) {
	t.Helper()
	c.WaitLeader(10 * time.Second)
	clustertest.Eventually(t, 10*time.Second, func() error {
		l := c.Leader()
		if l < 0 {
			return fmt.Errorf("no leader")
		}
		if v := c.Agent(l).Node().CommandVersion(); v != want {
			return fmt.Errorf("leader writes at command version %d, want %d", v, want)
		}
		return nil
	})
	leader := c.Leader()
	ctx := context.Background()
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[leader]))
	admin := quotadv1.NewAdminClient(dial(t, c.Addrs()[leader]))
	acquire := func(id uint64) {
		t.Helper()
		if _, err := acquireOne(ctx, q, "cmdver", &quotadv1.Admission{RequestId: id, Domain: "w9",
			Descriptors: []*quotadv1.Entry{{Key: "tenant", Value: "acme"}}}); err != nil {
			t.Fatal(err)
		}
	}
	// Entries stamped before the leader saw the version are all below this one's index.
	acquire(uint64(time.Now().UnixNano()))
	mark := c.Agent(leader).FSM().AppliedIndex()
	for i := range 3 {
		acquire(uint64(time.Now().UnixNano()) + uint64(i))
	}
	if _, err := admin.ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: waiterTenantLimits}); err != nil {
		t.Fatal(err)
	}
	last := c.Agent(leader).FSM().AppliedIndex()
	for i := range c.Len() {
		clustertest.Eventually(t, 10*time.Second, func() error {
			got := rec.since(i, mark)
			if _, ok := got[last]; !ok {
				return fmt.Errorf("node%d has not stored entry %d yet", i, last)
			}
			for idx, v := range got {
				if int(v) != want {
					return fmt.Errorf("node%d stored entry %d at command version %d, want %d (entries after %d: %v)", i, idx, v, want, mark, got)
				}
			}
			if len(got) < 4 {
				return fmt.Errorf("node%d: only %d command entries after %d: %v", i, len(got), mark, got)
			}
			return nil
		})
	}
}

// TestEntriesCarryClusterCommandVersion: while a node advertises an older fsm command version
// (node 2 stands in for a build that applies only version 5), the leader writes every entry at
// that version, so the older node follows the log instead of stopping at the first entry (a
// rolling upgrade whose first upgraded node becomes leader). Once that node advertises the
// current version (upgraded), entries go back to it.
func TestEntriesCarryClusterCommandVersion(t *testing.T) {
	const old = fsm.CommandVersion - 1
	rec := newEntryVersions(3)
	c := rpctest.Start(t, 3, waiterTenantLimits, rec.wrap, func(i int, cfg *rpc.AgentConfig) {
		if i == 2 {
			cfg.Cluster.AdvertisedCommandVersion = old
		}
	})
	checkEntriesAt(t, c, rec, old)

	// Node 2 is upgraded: it restarts advertising this build's version.
	c.Kill(2)
	c.Reconfigure(2, func(_ int, cfg *rpc.AgentConfig) { cfg.Cluster.AdvertisedCommandVersion = 0 })
	c.Restart(2)
	checkEntriesAt(t, c, rec, fsm.CommandVersion)
}

// TestUnknownCommandVersionDoesNotLower: a node that advertises no command version (a build
// before version 6, which would stop at a newer entry as it always did) does not lower the
// version the leader writes at.
func TestUnknownCommandVersionDoesNotLower(t *testing.T) {
	rec := newEntryVersions(3)
	c := rpctest.Start(t, 3, waiterTenantLimits, rec.wrap, func(i int, cfg *rpc.AgentConfig) {
		if i == 2 {
			cfg.Cluster.AdvertisedCommandVersion = -1
		}
	})
	id2 := c.ClusterConfig(2).ID
	leader := c.WaitLeader(10 * time.Second)
	clustertest.Eventually(t, 10*time.Second, func() error {
		for _, m := range c.Agent(leader).Node().Members() {
			if m.ID == id2 && (m.GossipAddr == "" || m.CommandVersion != 0 || m.Suffrage == "") {
				return fmt.Errorf("node 2 not yet seen advertising no version: %+v", m)
			}
		}
		return nil
	})
	checkEntriesAt(t, c, rec, fsm.CommandVersion)
}

// TestMembersShowCommandVersions: the Members API (what `quotad status` prints) shows the
// cluster's effective command version — the one the leader writes entries at — and the
// version each node advertises, from any node, so an operator doing a rolling upgrade sees
// which nodes still hold the cluster back.
func TestMembersShowCommandVersions(t *testing.T) {
	const old = fsm.CommandVersion - 1
	c := rpctest.Start(t, 3, waiterTenantLimits, func(i int, cfg *rpc.AgentConfig) {
		if i == 2 {
			cfg.Cluster.AdvertisedCommandVersion = old
		}
	})
	leader := c.WaitLeader(10 * time.Second)
	ids := map[string]int{}
	for i := range c.Len() {
		ids[c.ClusterConfig(i).ID] = i
	}
	for i := range c.Len() {
		admin := quotadv1.NewAdminClient(dial(t, c.Addrs()[i]))
		clustertest.Eventually(t, 10*time.Second, func() error {
			resp, err := admin.Members(context.Background(), &quotadv1.MembersRequest{})
			if err != nil {
				return err
			}
			if resp.CommandVersion != old {
				return fmt.Errorf("node%d (leader node%d) answers command_version %d, want %d", i, leader, resp.CommandVersion, old)
			}
			if len(resp.Members) != 3 {
				return fmt.Errorf("node%d lists %d members", i, len(resp.Members))
			}
			for _, m := range resp.Members {
				want := int32(fsm.CommandVersion)
				if ids[m.Id] == 2 {
					want = old
				}
				if m.CommandVersion != want {
					return fmt.Errorf("node%d says %s advertises command version %d, want %d", i, m.Id, m.CommandVersion, want)
				}
			}
			return nil
		})
	}
	if v := c.Agent(c.Leader()).Node().CommandVersion(); v != old {
		t.Fatalf("the leader writes at %d, want %d", v, old)
	}
}
