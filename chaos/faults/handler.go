package faults

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Handler returns the HTTP API described in the package doc, expecting to be mounted at
// HTTPPrefix. Errors answer 400 with a message naming the bad parameter and value.
func (f *Faults) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+HTTPPrefix+"{$}", func(w http.ResponseWriter, _ *http.Request) { f.reply(w) })
	mux.HandleFunc("POST "+HTTPPrefix+"clock", f.handleClock)
	mux.HandleFunc("POST "+HTTPPrefix+"partition", f.handlePartition)
	mux.HandleFunc("POST "+HTTPPrefix+"disk", f.handleDisk)
	mux.HandleFunc("POST "+HTTPPrefix+"replies", f.handleReplies)
	mux.HandleFunc("POST "+HTTPPrefix+"heal", f.handleHeal)
	return mux
}

func (f *Faults) reply(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(f.State())
}

func badRequest(w http.ResponseWriter, format string, args ...any) {
	http.Error(w, "chaos: "+fmt.Sprintf(format, args...), http.StatusBadRequest)
}

func (f *Faults) handleClock(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	// Validate everything before changing anything: a bad request changes no state.
	var (
		offset, jump      time.Duration
		rate              float64
		setOffset, doJump bool
		setRate, doReset  bool
	)
	if v := q.Get("offset"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			badRequest(w, "offset=%q is not a Go duration like -3h or 90m", v)
			return
		}
		offset, setOffset = d, true
	}
	if v := q.Get("jump"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			badRequest(w, "jump=%q is not a Go duration like -10m", v)
			return
		}
		jump, doJump = d, true
	}
	if v := q.Get("rate"); v != "" {
		x, err := strconv.ParseFloat(v, 64)
		if err != nil || x <= 0 || x > 100 {
			badRequest(w, "rate=%q: want a number in (0, 100], e.g. 1.5", v)
			return
		}
		rate, setRate = x, true
	}
	if v := q.Get("reset"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			badRequest(w, "reset=%q: want true or false", v)
			return
		}
		doReset = b
	}
	if !setOffset && !doJump && !setRate && !doReset {
		badRequest(w, "clock: give offset, jump, rate or reset")
		return
	}
	if doReset {
		f.Clock.Reset()
	}
	if setRate {
		f.Clock.SetRate(rate)
	}
	if setOffset {
		f.Clock.SetOffset(offset)
	}
	if doJump {
		f.Clock.Jump(jump)
	}
	f.reply(w)
}

func (f *Faults) handlePartition(w http.ResponseWriter, r *http.Request) {
	var addrs []string
	for _, a := range strings.Split(r.URL.Query().Get("block"), ",") {
		if a = strings.TrimSpace(a); a == "" {
			continue
		}
		if !strings.Contains(a, ":") {
			badRequest(w, "block: %q is not a host:port Raft address", a)
			return
		}
		addrs = append(addrs, a)
	}
	f.Network.Block(addrs)
	f.reply(w)
}

func (f *Faults) handleDisk(w http.ResponseWriter, r *http.Request) {
	v := r.URL.Query().Get("delay")
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 || d > time.Minute {
		badRequest(w, "delay=%q: want a Go duration in [0, 1m], e.g. 200ms", v)
		return
	}
	f.Disk.SetDelay(d)
	f.reply(w)
}

func (f *Faults) handleReplies(w http.ResponseWriter, r *http.Request) {
	v := r.URL.Query().Get("drop")
	x, err := strconv.ParseFloat(v, 64)
	if err != nil || x < 0 || x > 1 {
		badRequest(w, "drop=%q: want the fraction of decided Acquire replies to lose, in [0, 1], e.g. 0.3", v)
		return
	}
	f.Replies.SetDrop(x)
	f.reply(w)
}

func (f *Faults) handleHeal(w http.ResponseWriter, r *http.Request) {
	what := r.URL.Query().Get("what")
	switch what {
	case "", "all":
		f.Network.Heal()
		f.Clock.Reset()
		f.Disk.SetDelay(0)
		f.Replies.SetDrop(0)
	case "net":
		f.Network.Heal()
	case "clock":
		f.Clock.Reset()
	case "disk":
		f.Disk.SetDelay(0)
	case "replies":
		f.Replies.SetDrop(0)
	default:
		badRequest(w, "what=%q: want net, clock, disk, replies or all", what)
		return
	}
	f.reply(w)
}
