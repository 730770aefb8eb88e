package cluster

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// TestPeerErrorsRateLimited: a dead peer's "failed to heartbeat to" at 5/s through the raft
// logger is written once, then once per interval with the count left out; another peer, another
// message and messages naming no peer are not held back by it.
func TestPeerErrorsRateLimited(t *testing.T) {
	var buf bytes.Buffer
	l := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	h := newHCLog(l, "raft", slog.LevelInfo).(*hclogAdapter)
	now := time.Unix(1000, 0)
	h.limit.now = func() time.Time { return now }
	log := h.Named("replication").With("x", 1) // derived loggers share the limiter

	// 30 s of a dead peer: 5 heartbeat errors a second to n1, and 1 a second to n2.
	for i := 0; i < 150; i++ {
		log.Error("failed to heartbeat to", "peer", "127.0.0.1:7201", "backoff time", "200ms", "error", "connection refused")
		if i%5 == 0 {
			log.Error("failed to heartbeat to", "peer", "127.0.0.1:7202", "error", "connection refused")
			log.Warn("failed to contact", "server-id", "n1", "time", fmt.Sprint(i))
			log.Error("failed to commit logs", "error", "disk full") // no peer: never held back
			log.Info("entering follower state", "peer", "127.0.0.1:7201")
		}
		now = now.Add(200 * time.Millisecond)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	count := func(words ...string) (n int, matched []string) {
		for _, ln := range lines {
			all := true
			for _, w := range words {
				all = all && strings.Contains(ln, w)
			}
			if all {
				n++
				matched = append(matched, ln)
			}
		}
		return n, matched
	}
	// 30 s at one line per 10 s: t=0, 10, 20.
	if n, m := count("failed to heartbeat to", "7201"); n != 3 {
		t.Fatalf("%d heartbeat lines for the dead peer, want 3 (first, then one per 10 s):\n%s", n, strings.Join(m, "\n"))
	} else if !strings.Contains(m[0], "backoff time") || strings.Contains(m[0], "repeated=") ||
		!strings.Contains(m[1], "repeated=49 over=10s") || !strings.Contains(m[2], "repeated=49") {
		t.Fatalf("want the first line as raft wrote it, then repeated=49 over=10s:\n%s", strings.Join(m, "\n"))
	}
	if n, m := count("failed to heartbeat to", "7202"); n != 3 || !strings.Contains(m[1], "repeated=9") {
		t.Fatalf("another peer is limited on its own: %d lines\n%s", n, strings.Join(m, "\n"))
	}
	if n, _ := count("failed to contact", "server-id=n1"); n != 3 {
		t.Fatalf("%d 'failed to contact' lines, want 3", n)
	}
	if n, _ := count("failed to commit logs"); n != 30 {
		t.Fatalf("%d errors naming no peer, want all 30", n)
	}
	if n, _ := count("entering follower state"); n != 30 {
		t.Fatalf("%d info lines, want all 30 (only warnings and errors are limited)", n)
	}
}

// TestLogLimiterForgetsQuietKeys: the limiter's memory stays bounded.
func TestLogLimiterForgetsQuietKeys(t *testing.T) {
	l := newLogLimiter(time.Second)
	now := time.Unix(0, 0)
	l.now = func() time.Time { return now }
	for i := 0; i < 3*maxLimitKeys; i++ {
		if ok, _, _ := l.allow(fmt.Sprint("k", i)); !ok {
			t.Fatalf("first occurrence of key %d held back", i)
		}
		now = now.Add(100 * time.Millisecond)
	}
	if len(l.seen) > maxLimitKeys+1 {
		t.Fatalf("%d keys remembered, want at most %d", len(l.seen), maxLimitKeys+1)
	}
}
