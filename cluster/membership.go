package cluster

import (
	"context"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/raft"
)

// Member is one node as this node sees it: the union of the Raft configuration and gossip.
type Member struct {
	ID         string
	RaftAddr   string
	GossipAddr string // "" if not seen in gossip
	GRPCAddr   string
	HTTPAddr   string
	Suffrage   string // SuffrageVoter, SuffrageNonvoter, or "" if not in the Raft configuration
	State      string // StateLeader, StateFollower, ...
	// AppliedIndex is the member's FSM applied index: exact for this node, as last
	// advertised through gossip (about Config.MetaInterval stale) for others.
	AppliedIndex uint64
	// CommandVersion is the newest FSM command version the member applies, as advertised
	// through gossip; 0 if it advertises none (a build before command version 6) or was not
	// seen in gossip.
	CommandVersion int
}

// Member suffrages and states.
const (
	SuffrageVoter    = "voter"
	SuffrageNonvoter = "nonvoter"

	StateLeader      = "leader"      // the Raft leader
	StateFollower    = "follower"    // in the configuration and alive in gossip
	StateCandidate   = "candidate"   // this node, campaigning
	StateUnreachable = "unreachable" // gossip reports it failed, or never saw it
	StateLeft        = "left"        // left gossip gracefully (shut down)
	StateJoining     = "joining"     // alive in gossip but not (yet) in the configuration
)

// Members returns every node in the Raft configuration or alive in gossip, sorted by ID.
func (n *Node) Members() []Member {
	var servers []raft.Server
	if cf := n.raft.GetConfiguration(); n.wait(context.Background(), cf) == nil {
		servers = cf.Configuration().Servers
	}
	peers := n.peersSnapshot()
	_, leaderID := n.raft.LeaderWithID()
	seen := make(map[string]bool, len(servers))
	var out []Member
	fill := func(m *Member) {
		if p, ok := peers[m.ID]; ok {
			m.GossipAddr, m.GRPCAddr, m.HTTPAddr, m.AppliedIndex = p.gossipAddr, p.meta.GRPC, p.meta.HTTP, p.meta.Applied
			m.CommandVersion = p.meta.Cmd
			switch {
			case p.alive:
				m.State = StateFollower
			case p.left:
				m.State = StateLeft
			default:
				m.State = StateUnreachable
			}
		} else {
			m.State = StateUnreachable
		}
		if m.ID == n.cfg.ID {
			m.GossipAddr, m.GRPCAddr, m.HTTPAddr = n.gossipAddr, n.cfg.GRPCAddr, n.cfg.HTTPAddr
			m.AppliedIndex = n.fsm.AppliedIndex()
			m.CommandVersion = n.commandVersion()
			m.State = StateFollower
			if n.raft.State() == raft.Candidate {
				m.State = StateCandidate
			}
		}
		if m.ID == string(leaderID) {
			m.State = StateLeader
		}
	}
	for _, s := range servers {
		m := Member{ID: string(s.ID), RaftAddr: string(s.Address), Suffrage: SuffrageNonvoter}
		if s.Suffrage == raft.Voter {
			m.Suffrage = SuffrageVoter
		}
		fill(&m)
		seen[m.ID] = true
		out = append(out, m)
	}
	for id, p := range peers {
		if seen[id] || !p.alive {
			continue
		}
		m := Member{ID: id, RaftAddr: p.meta.Raft}
		fill(&m)
		m.State = StateJoining
		out = append(out, m)
	}
	slices.SortFunc(out, func(a, b Member) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// reconcileLoop makes the Raft configuration follow gossip while this node is the
// established leader: add new nodes as non-voters, promote caught-up non-voters, follow
// address changes, remove nodes dead for longer than DeadNodeTimeout (keeping MinVoters).
func (n *Node) reconcileLoop() {
	var r reconciler
	t := time.NewTicker(n.cfg.ReconcileInterval)
	defer t.Stop()
	for {
		select {
		case <-n.ctx.Done():
			return
		case <-t.C:
		case <-n.reconcileCh:
		}
		n.refreshCommandVersion(n.ctx)
		term, ok := n.readyTerm()
		if !ok {
			r = reconciler{}
			continue
		}
		if r.term != term {
			r = reconciler{term: term, leaderSince: n.clock.Now(), catchUp: map[string]time.Time{}, refused: map[string]bool{}}
		}
		n.reconcile(&r)
	}
}

// reconciler is the leader's bookkeeping for one term.
type reconciler struct {
	term        uint64
	leaderSince time.Time            // for servers gossip never reported: dead since then at most
	catchUp     map[string]time.Time // non-voter ID -> since when continuously caught up
	refused     map[string]bool      // gossip members of another cluster, logged once
}

func (n *Node) reconcile(r *reconciler) {
	cf := n.raft.GetConfiguration()
	if err := n.wait(n.ctx, cf); err != nil {
		n.log.Warn("reconcile: read configuration", "err", err)
		return
	}
	servers := cf.Configuration().Servers
	now := n.clock.Now()
	peers := n.peersSnapshot()
	timeout := n.cfg.ElectionTimeout

	voters := 0
	inConfig := make(map[string]bool, len(servers))
	for _, s := range servers {
		inConfig[string(s.ID)] = true
		if s.Suffrage == raft.Voter {
			voters++
		}
	}
	for _, s := range servers {
		id := string(s.ID)
		if id == n.cfg.ID {
			if string(s.Address) != n.raftAddr {
				n.changeServer("update own address", s, raft.ServerAddress(n.raftAddr), s.Suffrage, timeout)
			}
			continue
		}
		p, known := peers[id]
		if known && p.alive {
			if p.meta.Raft != "" && p.meta.Raft != string(s.Address) {
				n.changeServer("update address", s, raft.ServerAddress(p.meta.Raft), s.Suffrage, timeout)
				s.Address = raft.ServerAddress(p.meta.Raft)
			}
			if s.Suffrage == raft.Voter {
				if n.demoteIfWiped(r, s, timeout) {
					voters--
				}
				continue
			}
			if s.Suffrage == raft.Nonvoter {
				if n.caughtUp(r, id, now) {
					if n.changeServer("promote caught-up non-voter", s, s.Address, raft.Voter, timeout) {
						voters++
					}
					delete(r.catchUp, id)
				}
			}
			continue
		}
		delete(r.catchUp, id)
		deadSince := r.leaderSince
		if known && p.since.After(deadSince) {
			deadSince = p.since
		}
		if now.Sub(deadSince) < n.cfg.DeadNodeTimeout {
			continue
		}
		if s.Suffrage == raft.Voter && voters-1 < n.cfg.MinVoters {
			continue // keep it: removing would leave fewer than MinVoters voters
		}
		f := n.raft.RemoveServer(s.ID, 0, timeout)
		if err := n.wait(n.ctx, f); err != nil {
			n.log.Warn("reconcile: remove dead server failed", "server", id, "err", err)
			continue
		}
		n.log.Info("removed dead server", "server", id, "suffrage", s.Suffrage.String(),
			"dead_for", now.Sub(deadSince).Round(time.Millisecond))
		n.noteRemoved(id, now)
		n.peers.repl.forget(s.ID)
		if s.Suffrage == raft.Voter {
			voters--
		}
	}
	ids := make([]string, 0, len(peers))
	for id := range peers {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		p := peers[id]
		if inConfig[id] || !p.alive || p.meta.Raft == "" || id == n.cfg.ID {
			continue
		}
		if own := n.clusterID(); own != "" && p.meta.Cluster != "" && p.meta.Cluster != own {
			if !r.refused[id] {
				r.refused[id] = true
				n.log.Warn("reconcile: not adding a gossip member of another cluster", "member", id,
					"its_cluster_id", p.meta.Cluster, "cluster_id", own)
			}
			continue
		}
		if n.removedRecently(id, now) {
			continue // the removed server's old replication may still be winding down
		}
		f := n.raft.AddNonvoter(raft.ServerID(id), raft.ServerAddress(p.meta.Raft), 0, timeout)
		if err := n.wait(n.ctx, f); err != nil {
			n.log.Warn("reconcile: add non-voter failed", "server", id, "err", err)
			continue
		}
		n.log.Info("added non-voter", "server", id, "raft_addr", p.meta.Raft)
	}
}

// noteRemoved records that this node, as leader, removed server id at now.
func (n *Node) noteRemoved(id string, now time.Time) {
	n.removedMu.Lock()
	defer n.removedMu.Unlock()
	n.removedAt[id] = now
}

// removedRecently reports whether this node removed server id less than RejoinDelay before
// now (and forgets older removals).
func (n *Node) removedRecently(id string, now time.Time) bool {
	n.removedMu.Lock()
	defer n.removedMu.Unlock()
	at, ok := n.removedAt[id]
	if ok && now.Sub(at) >= n.cfg.RejoinDelay {
		delete(n.removedAt, id)
		ok = false
	}
	return ok
}

// caughtUp reports whether non-voter id has kept up for PromoteStableFor, as this leader
// observed it over the authenticated transport in this term: the highest index it
// acknowledged is within PromoteMaxLag of the leader's last index, and it answered recently.
// Nothing the node says about itself in gossip counts.
func (n *Node) caughtUp(r *reconciler, id string, now time.Time) bool {
	seen := n.peers.repl.observed(raft.ServerID(id), r.term)
	fresh := !seen.lastOK.IsZero() && now.Sub(seen.lastOK) <= n.cfg.HeartbeatTimeout+n.cfg.ReconcileInterval
	ok := fresh && seen.matched > 0 && seen.matched+n.cfg.PromoteMaxLag >= n.raft.LastIndex()
	if !ok {
		delete(r.catchUp, id)
		return false
	}
	since, seenBefore := r.catchUp[id]
	if !seenBefore {
		r.catchUp[id] = now
		return false
	}
	return now.Sub(since) >= n.cfg.PromoteStableFor
}

// demoteIfWiped demotes voter s to non-voter if it answered this leader with a log shorter
// than what it had acknowledged in this term: it lost its data dir (or its disk lied about
// fsync), so its vote no longer stands for the entries it acknowledged. It is promoted again
// once it has caught up (caughtUp). True if demoted.
func (n *Node) demoteIfWiped(r *reconciler, s raft.Server, timeout time.Duration) bool {
	seen := n.peers.repl.observed(s.ID, r.term)
	if !seen.regressed {
		return false
	}
	f := n.raft.DemoteVoter(s.ID, 0, timeout)
	if err := n.wait(n.ctx, f); err != nil {
		n.log.Warn("reconcile: demoting a voter that lost acknowledged entries failed; retrying", "server", s.ID, "err", err)
		return false
	}
	n.peers.repl.clearRegressed(s.ID, r.term)
	n.log.Warn("demoted a voter whose log went backwards: it had acknowledged entries it no longer has (data dir wiped or lost). It catches up as a non-voter and is promoted again once it keeps up; nothing to do unless this repeats (then check that node's disk)",
		"server", s.ID, "acknowledged_up_to", seen.lostFrom, "now_has_up_to", seen.lostTo)
	delete(r.catchUp, string(s.ID))
	return true
}

// changeServer adds or updates s with the given address and suffrage; true on success.
func (n *Node) changeServer(what string, s raft.Server, addr raft.ServerAddress, suffrage raft.ServerSuffrage, timeout time.Duration) bool {
	var f raft.IndexFuture
	if suffrage == raft.Voter {
		f = n.raft.AddVoter(s.ID, addr, 0, timeout)
	} else {
		f = n.raft.AddNonvoter(s.ID, addr, 0, timeout)
	}
	if err := n.wait(n.ctx, f); err != nil {
		n.log.Warn("reconcile: "+what+" failed", "server", s.ID, "addr", addr, "err", err)
		return false
	}
	n.log.Info("reconcile: "+what, "server", s.ID, "old_addr", s.Address, "addr", addr, "suffrage", suffrage.String())
	return true
}
