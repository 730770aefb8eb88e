package client

import (
	"context"
	cryptorand "crypto/rand"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// The share RPCs, kept behind small types so the Limiter's logic reads without protobuf.

type shareRequest struct {
	holderID    string
	incarnation uint64
	seq, ack    uint64
	paths       []sharePathRequest
}

type sharePathRequest struct {
	domain  string
	descs   []Entry
	demand  uint64 // micro-units per second
	maxCost uint64
}

type shareResponse struct {
	seq        uint64
	term       time.Duration
	margin     time.Duration
	renewAfter time.Duration
	paths      []pathShare
}

type pathShare struct {
	status, message string
	levels          []levelShare
	pausedFor       time.Duration
	fallback        uint64
}

type levelShare struct {
	key                  string
	rate, burst, initial uint64
	first                bool
}

type levelTokens struct {
	key    string
	tokens uint64
}

// sendShare sends one share request, retried (same seq) until answered or ctx ends.
func (c *Client) sendShare(ctx context.Context, r *shareRequest) (*shareResponse, error) {
	req := &quotadv1.ShareRequest{HolderId: r.holderID, Incarnation: r.incarnation, Seq: r.seq, AckSeq: r.ack,
		Paths: make([]*quotadv1.SharePath, len(r.paths))}
	for i, p := range r.paths {
		req.Paths[i] = &quotadv1.SharePath{Domain: p.domain, Descriptors: entriesToProto(p.descs), Demand: p.demand, MaxCost: p.maxCost}
	}
	var resp *quotadv1.ShareResponse
	err := c.invoke(ctx, "Share", 0, func(ctx context.Context, qc quotadv1.QuotaClient, opts ...grpc.CallOption) error {
		var err error
		resp, err = qc.Share(ctx, req, opts...)
		return err
	})
	if err != nil {
		return nil, err
	}
	out := &shareResponse{seq: resp.GetSeq(), term: time.Duration(resp.GetTermNs()), margin: time.Duration(resp.GetMarginNs()),
		renewAfter: time.Duration(resp.GetRenewAfterNs()),
		paths:      make([]pathShare, len(resp.GetPaths()))}
	for i, p := range resp.GetPaths() {
		ps := pathShare{status: p.GetStatus(), message: p.GetMessage(), pausedFor: millis(p.GetPausedForMs()), fallback: p.GetFallback()}
		for _, l := range p.GetLevels() {
			ps.levels = append(ps.levels, levelShare{key: l.GetKey(), rate: l.GetRate(), burst: l.GetBurst(), initial: l.GetInitial(), first: l.GetFirst()})
		}
		out.paths[i] = ps
	}
	return out, nil
}

func (c *Client) sendReleaseShare(ctx context.Context, incarnation, seq uint64, toks []levelTokens) error {
	req := &quotadv1.ReleaseShareRequest{HolderId: c.id, Incarnation: incarnation, Seq: seq}
	for _, t := range toks {
		req.Tokens = append(req.Tokens, &quotadv1.LevelTokens{Key: t.key, Tokens: t.tokens})
	}
	return c.invoke(ctx, "ReleaseShare", 0, func(ctx context.Context, qc quotadv1.QuotaClient, opts ...grpc.CallOption) error {
		_, err := qc.ReleaseShare(ctx, req, opts...)
		return err
	})
}

func randRead(b []byte) (int, error) { return cryptorand.Read(b) }

func randInt63n(n int64) int64 { return rand.Int64N(max(n, 1)) }
