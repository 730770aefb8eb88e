package rpc

import (
	"log/slog"
	"sync"
	"time"
)

// keyLogger logs a repeated warning at most once per interval per key, with how many were
// left out since (repeated=N): an Envoy sending thousands of requests a second for a domain
// the limits lack must not write thousands of lines. It remembers at most maxKeyLogKeys keys;
// beyond them a new key is logged once per interval under the shared key "" (a flood of
// distinct names cannot grow it). The zero value and nil log nothing; safe for concurrent use.
type keyLogger struct {
	log   *slog.Logger
	every time.Duration
	now   func() time.Time

	mu   sync.Mutex
	seen map[string]*keyLogState
}

type keyLogState struct {
	logged     time.Time
	suppressed int
}

// maxKeyLogKeys bounds a keyLogger's memory.
const maxKeyLogKeys = 256

func newKeyLogger(log *slog.Logger, every time.Duration) *keyLogger {
	return &keyLogger{log: log, every: every, now: time.Now, seen: make(map[string]*keyLogState)}
}

// Warn logs msg with args and key=value if key was not logged in the last interval.
func (l *keyLogger) Warn(msg, name, key string, args ...any) {
	if l == nil || l.log == nil {
		return
	}
	now := l.now()
	l.mu.Lock()
	st := l.seen[key]
	if st == nil && len(l.seen) >= maxKeyLogKeys {
		for k, v := range l.seen {
			if now.Sub(v.logged) > 10*l.every {
				delete(l.seen, k)
			}
		}
		if len(l.seen) >= maxKeyLogKeys {
			key = "" // too many distinct keys: they share one
			st = l.seen[key]
		}
	}
	if st != nil && now.Sub(st.logged) < l.every {
		st.suppressed++
		l.mu.Unlock()
		return
	}
	repeated := 0
	if st == nil {
		l.seen[key] = &keyLogState{logged: now}
	} else {
		repeated, st.logged, st.suppressed = st.suppressed, now, 0
	}
	l.mu.Unlock()
	if repeated > 0 {
		args = append(args, "repeated", repeated)
	}
	l.log.Warn(msg, append([]any{name, key}, args...)...)
}
