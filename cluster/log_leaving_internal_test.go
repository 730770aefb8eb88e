package cluster

import (
	"bytes"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/hashicorp/raft"
)

// TestLeavingNodeLogsNoErrors: what raft and memberlist log only because the node is leaving
// — replication after it handed leadership over, peers gone, its own transport closed under
// a command, memberlist probing on a closed socket — is INFO (during_shutdown=true) while it
// stops gracefully, and still ERROR at any other time; other errors stay errors. The real
// processes' version is e2e.TestGracefulStopLogsNoError.
func TestLeavingNodeLogsNoErrors(t *testing.T) {
	var buf bytes.Buffer
	l := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	var leaving atomic.Bool
	h := newHCLog(l, "raft", slog.LevelInfo).(*hclogAdapter)
	h.leaving = &leaving
	rl := h.Named("replication")
	ml := newStdLogger(l, "memberlist", slog.LevelInfo, &leaving)
	emit := func() {
		rl.Error("peer has newer term, stopping replication", "peer", "{node2}")
		rl.Error("failed to heartbeat to", "peer", "127.0.0.1:7202", "error", "EOF")
		rl.Error("failed to commit logs", "error", "disk full")
		ml.Printf("[ERR] memberlist: Failed to send UDP ping: write udp 127.0.0.1:1->127.0.0.1:2: use of closed network connection")
	}
	level := func(msg string) string {
		for _, ln := range strings.Split(buf.String(), "\n") {
			if strings.Contains(ln, msg) {
				return strings.Fields(strings.SplitN(ln, "level=", 2)[1])[0]
			}
		}
		return "missing"
	}
	emit()
	for _, m := range []string{"peer has newer term", "failed to heartbeat to", "failed to commit logs", "Failed to send UDP ping"} {
		if got := level(m); got != "ERROR" {
			t.Fatalf("%q while the node runs: level %s, want ERROR", m, got)
		}
	}
	// A command arriving while the node's own transport closes: never an error.
	buf.Reset()
	h.Named("transport").Error("failed to decode incoming command", "error", raft.ErrTransportShutdown)
	if got := level("failed to decode incoming command"); got != "INFO" || !strings.Contains(buf.String(), "during_shutdown=true") {
		t.Fatalf("transport shutdown: level %s, want INFO with during_shutdown=true\n%s", got, buf.String())
	}
	buf.Reset()
	leaving.Store(true)
	emit()
	for _, m := range []string{"peer has newer term", "failed to heartbeat to", "Failed to send UDP ping"} {
		if got := level(m); got != "INFO" {
			t.Fatalf("%q while the node leaves: level %s, want INFO\n%s", m, got, buf.String())
		}
	}
	if got := level("failed to commit logs"); got != "ERROR" {
		t.Fatalf("a disk error while the node leaves: level %s, want ERROR", got)
	}
}
