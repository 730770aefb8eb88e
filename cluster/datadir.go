package cluster

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/hashicorp/raft"
)

// Files in DataDir besides raft.db and snapshots/.
const (
	nodeIDFile     = "node-id"           // the ID this data dir belongs to
	clusterIDFile  = "cluster-id"        // the cluster this data dir's log belongs to
	gossipPeerFile = "gossip-peers.json" // last known gossip addresses of other nodes
)

// claimDataDir records cfg.ID in the data dir, or checks that it matches: starting another
// node's data dir under a different ID would make one Raft log speak for two servers.
func claimDataDir(dir, id string) error {
	path := filepath.Join(dir, nodeIDFile)
	b, err := os.ReadFile(path)
	switch {
	case err == nil:
		if got := strings.TrimSpace(string(b)); got != id {
			return fmt.Errorf("cluster: data dir %q belongs to node %q, not %q; use that ID or an empty data dir", dir, got, id)
		}
		return nil
	case errors.Is(err, fs.ErrNotExist):
		if err := os.WriteFile(path, []byte(id+"\n"), 0o600); err != nil {
			return fmt.Errorf("cluster: record node ID in %q: %w", path, err)
		}
		return nil
	default:
		return fmt.Errorf("cluster: read %q: %w", path, err)
	}
}

// loadGossipPeers returns the gossip addresses saved by saveGossipPeers, so a restarted
// node can rejoin gossip even when its Join list is empty or stale. Best effort.
func loadGossipPeers(dir string) []string {
	b, err := os.ReadFile(filepath.Join(dir, gossipPeerFile))
	if err != nil {
		return nil
	}
	var addrs []string
	if json.Unmarshal(b, &addrs) != nil {
		return nil
	}
	return addrs
}

func saveGossipPeers(dir string, addrs []string) error {
	b, err := json.Marshal(addrs)
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, gossipPeerFile+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(dir, gossipPeerFile))
}

// alivePeerAddrs returns the sorted gossip addresses of other alive members.
func (n *Node) alivePeerAddrs() []string {
	var out []string
	for id, p := range n.peersSnapshot() {
		if id != n.cfg.ID && p.alive {
			out = append(out, p.gossipAddr)
		}
	}
	slices.Sort(out)
	return out
}

// clusterID returns the ID of the cluster this node's data dir belongs to, "" if not known yet.
func (n *Node) clusterID() string {
	n.cidMu.Lock()
	defer n.cidMu.Unlock()
	return n.cid
}

func (n *Node) setClusterID(id string) error {
	n.cidMu.Lock()
	defer n.cidMu.Unlock()
	if n.cid == id {
		return nil
	}
	n.cid = id
	return writeFileAtomic(filepath.Join(n.cfg.DataDir, clusterIDFile), []byte(id+"\n"))
}

func readClusterID(dir string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, clusterIDFile))
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("cluster: read the cluster ID: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// bootstrapClusterID derives the new cluster's ID from what every bootstrapping node sees
// alike: the sorted servers and the nonces their gossip metadata carries.
func bootstrapClusterID(servers []raft.Server, peers map[string]peer) string {
	h := sha256.New()
	for _, s := range servers {
		fmt.Fprintf(h, "%s\x00%s\x00%s\x00", s.ID, s.Address, peers[string(s.ID)].meta.Nonce)
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}

// learnClusterID adopts the cluster ID the current leader advertises once this node holds
// Raft state of that cluster and is no longer recovering (a node added to an existing
// cluster, or one whose data dir was wiped). A node that already has an ID and sees its
// leader advertise another logs it: its data dir belongs to a different cluster.
func (n *Node) learnClusterID() {
	_, lid := n.raft.LeaderWithID()
	if lid == "" || string(lid) == n.cfg.ID || n.raft.LastIndex() == 0 || n.rec.active.Load() {
		return
	}
	p, ok := n.peer(string(lid))
	if !ok || p.meta.Cluster == "" {
		return
	}
	own := n.clusterID()
	switch {
	case own == "":
		if err := n.setClusterID(p.meta.Cluster); err != nil {
			n.log.Warn("recording the cluster ID failed", "err", err)
			return
		}
		n.log.Info("learned the cluster ID from the leader", "cluster_id", p.meta.Cluster, "leader", lid)
	case own != p.meta.Cluster && !n.cidMismatch:
		n.cidMismatch = true
		n.log.Error("this data dir belongs to another cluster than the leader's; stop this node and give it an empty data dir",
			"cluster_id", own, "leader", lid, "leader_cluster_id", p.meta.Cluster)
	}
}

func writeFileAtomic(path string, b []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
