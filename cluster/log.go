package cluster

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
)

// hclogAdapter routes hashicorp/raft's hclog output to slog. Only what raft uses is
// implemented faithfully; everything is filtered at min. Warnings and errors about a peer are
// rate-limited (logLimiter), shared by the loggers With and Named derive.
type hclogAdapter struct {
	l     *slog.Logger
	name  string
	min   slog.Level
	args  []any
	limit *logLimiter
	// leaving, if set and true, says the node is stopping gracefully: raft's errors about
	// peers and its own transport are then what leaving means, not faults (leavingNoise).
	leaving *atomic.Bool
	// peerLeft, if set, reports whether the peer a record names (args) left gossip gracefully
	// a short while ago (Node.peerLeftRecently): raft's failures to reach it are then
	// peerLeftNoise.
	peerLeft func(args []any) bool
}

// peerLeftNoise are the raft errors the other nodes log about a node that stopped gracefully:
// it left gossip before its Raft shut down, so they know it is gone on purpose. They are logged
// at INFO with peer_left=true for a while after it left (leftQuietFor); a peer that failed
// (no leave) keeps them errors.
var peerLeftNoise = map[string]bool{
	"failed to appendEntries to":       true,
	"failed to heartbeat to":           true,
	"failed to pipeline appendEntries": true,
	"failed to make requestVote RPC":   true,
}

// leavingNoise are the raft errors a node logs because it is leaving, while it stops
// gracefully: its replication to peers after it handed leadership over ("peer has newer
// term"), heartbeats and appends that meet a peer already gone, votes asked while the others
// stop too, and connections its own transport closes under a command in flight. They are
// logged at INFO then (with during_shutdown=true); at any other time they stay errors.
var leavingNoise = map[string]bool{
	"peer has newer term, stopping replication": true,
	"failed to appendEntries to":                true,
	"failed to heartbeat to":                    true,
	"failed to pipeline appendEntries":          true,
	"failed to make requestVote RPC":            true,
	"failed to decode incoming command":         true,
	"failed to accept connection":               true,
	"failed to flush response":                  true,
}

// level is the level msg is logged at: an error raft logs only because the node's own
// transport shut down (raft.ErrTransportShutdown: a command that arrived while it closed) is
// INFO whenever it happens, and leavingNoise is INFO while the node leaves.
//
// The second result names the attribute that says why an error was lowered ("" if it was not).
func (h *hclogAdapter) level(level hclog.Level, msg string, args []any) (slog.Level, string) {
	lv := toSlogLevel(level)
	if lv < slog.LevelWarn {
		return lv, ""
	}
	for i := 1; i < len(args); i += 2 {
		if err, ok := args[i].(error); ok && errors.Is(err, raft.ErrTransportShutdown) {
			return slog.LevelInfo, "during_shutdown"
		}
	}
	if h.leaving != nil && h.leaving.Load() && leavingNoise[msg] {
		return slog.LevelInfo, "during_shutdown"
	}
	if h.peerLeft != nil && peerLeftNoise[msg] && h.peerLeft(args) {
		return slog.LevelInfo, "peer_left"
	}
	return lv, ""
}

func newHCLog(l *slog.Logger, name string, min slog.Level) hclog.Logger {
	return &hclogAdapter{l: l, name: name, min: min, limit: newLogLimiter(DefaultPeerLogInterval)}
}

func toSlogLevel(level hclog.Level) slog.Level {
	switch level {
	case hclog.Trace:
		return slog.LevelDebug - 4
	case hclog.Debug:
		return slog.LevelDebug
	case hclog.Info, hclog.NoLevel, hclog.DefaultLevel:
		return slog.LevelInfo
	case hclog.Warn:
		return slog.LevelWarn
	default:
		return slog.LevelError
	}
}

func (h *hclogAdapter) enabled(lv slog.Level) bool {
	return lv >= h.min && h.l.Enabled(context.Background(), lv)
}

func (h *hclogAdapter) Log(level hclog.Level, msg string, args ...any) {
	lv, why := h.level(level, msg, args)
	if !h.enabled(lv) {
		return
	}
	if why != "" {
		args = append(args[:len(args):len(args)], why, true)
	}
	var suppressed int
	var over time.Duration
	if lv >= slog.LevelWarn {
		var ok bool
		if ok, suppressed, over = h.limit.allow(peerKey(msg, args)); !ok {
			return
		}
	}
	all := make([]any, 0, len(h.args)+len(args)+6)
	all = append(all, "component", h.name)
	all = append(all, h.args...)
	all = append(all, args...)
	if suppressed > 0 {
		all = append(all, "repeated", suppressed, "over", over.Round(time.Millisecond))
	}
	h.l.Log(context.Background(), lv, msg, all...)
}

func (h *hclogAdapter) Trace(msg string, args ...any) { h.Log(hclog.Trace, msg, args...) }
func (h *hclogAdapter) Debug(msg string, args ...any) { h.Log(hclog.Debug, msg, args...) }
func (h *hclogAdapter) Info(msg string, args ...any)  { h.Log(hclog.Info, msg, args...) }
func (h *hclogAdapter) Warn(msg string, args ...any)  { h.Log(hclog.Warn, msg, args...) }
func (h *hclogAdapter) Error(msg string, args ...any) { h.Log(hclog.Error, msg, args...) }
func (h *hclogAdapter) IsTrace() bool                 { return h.enabled(toSlogLevel(hclog.Trace)) }
func (h *hclogAdapter) IsDebug() bool                 { return h.enabled(slog.LevelDebug) }
func (h *hclogAdapter) IsInfo() bool                  { return h.enabled(slog.LevelInfo) }
func (h *hclogAdapter) IsWarn() bool                  { return h.enabled(slog.LevelWarn) }
func (h *hclogAdapter) IsError() bool                 { return h.enabled(slog.LevelError) }
func (h *hclogAdapter) ImpliedArgs() []any            { return h.args }
func (h *hclogAdapter) Name() string                  { return h.name }
func (h *hclogAdapter) SetLevel(hclog.Level)          {}
func (h *hclogAdapter) GetLevel() hclog.Level {
	switch {
	case h.min <= slog.LevelDebug:
		return hclog.Debug
	case h.min <= slog.LevelInfo:
		return hclog.Info
	case h.min <= slog.LevelWarn:
		return hclog.Warn
	}
	return hclog.Error
}

func (h *hclogAdapter) With(args ...any) hclog.Logger {
	c := *h
	c.args = append(append([]any(nil), h.args...), args...)
	return &c
}

func (h *hclogAdapter) Named(name string) hclog.Logger {
	c := *h
	if c.name != "" {
		name = c.name + "." + name
	}
	c.name = name
	return &c
}

func (h *hclogAdapter) ResetNamed(name string) hclog.Logger {
	c := *h
	c.name = name
	return &c
}

func (h *hclogAdapter) StandardLogger(*hclog.StandardLoggerOptions) *log.Logger {
	return log.New(h.StandardWriter(nil), "", 0)
}

func (h *hclogAdapter) StandardWriter(*hclog.StandardLoggerOptions) io.Writer {
	return &stdLogWriter{l: h.l, name: h.name, min: h.min, leaving: h.leaving}
}

// stdLogWriter turns standard-library log lines of the form "[LEVEL] prefix: msg" (what
// memberlist writes) into slog records.
type stdLogWriter struct {
	l    *slog.Logger
	name string
	min  slog.Level
	// leaving: as hclogAdapter.leaving. While the node leaves, an error about a connection
	// it closed itself (memberlist's probes racing its shutdown: "Failed to send UDP ping:
	// … use of closed network connection") is logged at INFO.
	leaving *atomic.Bool
}

func newStdLogger(l *slog.Logger, name string, min slog.Level, leaving *atomic.Bool) *log.Logger {
	return log.New(&stdLogWriter{l: l, name: name, min: min, leaving: leaving}, "", 0)
}

func (w *stdLogWriter) Write(p []byte) (int, error) {
	line := string(bytes.TrimRight(p, "\r\n"))
	lv := slog.LevelInfo
	if i := strings.IndexByte(line, '['); i >= 0 {
		if j := strings.IndexByte(line[i:], ']'); j > 0 {
			switch line[i+1 : i+j] {
			case "TRACE":
				lv = slog.LevelDebug - 4
			case "DEBUG":
				lv = slog.LevelDebug
			case "INFO":
				lv = slog.LevelInfo
			case "WARN", "WARNING":
				lv = slog.LevelWarn
			case "ERR", "ERROR":
				lv = slog.LevelError
			}
			line = strings.TrimSpace(line[i+j+1:])
		}
	}
	args := []any{"component", w.name}
	if lv >= slog.LevelWarn && w.leaving != nil && w.leaving.Load() && strings.Contains(line, net.ErrClosed.Error()) {
		lv, args = slog.LevelInfo, append(args, "during_shutdown", true)
	}
	if lv >= w.min && w.l.Enabled(context.Background(), lv) {
		w.l.Log(context.Background(), lv, line, args...)
	}
	return len(p), nil
}
