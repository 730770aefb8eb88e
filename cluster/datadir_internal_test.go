package cluster

import (
	"slices"
	"testing"
)

func TestJoinAddrsMergesSavedPeers(t *testing.T) {
	dir := t.TempDir()
	if err := saveGossipPeers(dir, []string{"127.0.0.1:2", "127.0.0.1:9", "127.0.0.1:3"}); err != nil {
		t.Fatal(err)
	}
	n := &Node{cfg: Config{DataDir: dir, GossipAddr: "127.0.0.1:9", Join: []string{"127.0.0.1:1", "127.0.0.1:2"}}}
	n.gossipAddr = "127.0.0.1:9"
	got := n.joinAddrs()
	want := []string{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}
	if !slices.Equal(got, want) {
		t.Fatalf("joinAddrs = %v, want %v (config first, saved peers deduplicated, self dropped)", got, want)
	}
}

func TestClaimDataDir(t *testing.T) {
	dir := t.TempDir()
	if err := claimDataDir(dir, "a"); err != nil {
		t.Fatal(err)
	}
	if err := claimDataDir(dir, "a"); err != nil {
		t.Fatalf("same ID again: %v", err)
	}
	if err := claimDataDir(dir, "b"); err == nil {
		t.Fatal("another ID claimed the data dir")
	}
}
