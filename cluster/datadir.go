package cluster

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Files in DataDir besides raft.db and snapshots/.
const (
	nodeIDFile     = "node-id"           // the ID this data dir belongs to
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
		if err := os.WriteFile(path, []byte(id+"\n"), 0o644); err != nil {
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
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
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
