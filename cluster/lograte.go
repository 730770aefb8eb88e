package cluster

import (
	"fmt"
	"sync"
	"time"
)

// DefaultPeerLogInterval is how often a repeated peer error is logged again (with the count
// of the ones left out) after its first occurrence.
const DefaultPeerLogInterval = 10 * time.Second

// peerLogKeys are the argument names hashicorp/raft uses for the other server in a warning or
// error ("failed to heartbeat to" peer=..., "failed to contact" server-id=..., votes).
var peerLogKeys = map[string]bool{"peer": true, "server-id": true, "from": true, "candidate": true}

// logLimiter rate-limits repeated warnings and errors about one peer: a dead peer makes
// raft's replication loop log "failed to heartbeat to" several times a second, for as long as
// the peer is down. The first occurrence of a message about a peer is logged; the same
// message about the same peer is then logged at most once per interval, with how many were
// left out since the last one (repeated=N, over=D). Messages that name no peer pass.
type logLimiter struct {
	every time.Duration
	now   func() time.Time

	mu   sync.Mutex
	seen map[string]*limitState
}

type limitState struct {
	logged     time.Time // when it was last written
	suppressed int       // left out since then
}

// maxLimitKeys bounds the limiter's memory: beyond it, keys not logged for 10 intervals are
// forgotten (a peer that has been quiet that long is a first occurrence again).
const maxLimitKeys = 1024

func newLogLimiter(every time.Duration) *logLimiter {
	return &logLimiter{every: every, now: time.Now, seen: make(map[string]*limitState)}
}

// peerKey returns the limiter key of a record (message + peer), or "" if it names no peer.
func peerKey(msg string, args []any) string {
	for i := 0; i+1 < len(args); i += 2 {
		if k, ok := args[i].(string); ok && peerLogKeys[k] {
			return fmt.Sprintf("%s\x00%v", msg, args[i+1])
		}
	}
	return ""
}

// allow reports whether a record with key is written now and, if so, how many were left out
// before it (and over how long).
func (l *logLimiter) allow(key string) (ok bool, suppressed int, over time.Duration) {
	if l == nil || l.every <= 0 || key == "" {
		return true, 0, 0
	}
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.seen[key]
	if s == nil {
		if len(l.seen) >= maxLimitKeys {
			for k, v := range l.seen {
				if now.Sub(v.logged) > 10*l.every {
					delete(l.seen, k)
				}
			}
		}
		l.seen[key] = &limitState{logged: now}
		return true, 0, 0
	}
	since := now.Sub(s.logged)
	if since < l.every {
		s.suppressed++
		return false, 0, 0
	}
	n := s.suppressed
	s.logged, s.suppressed = now, 0
	return true, n, since
}
