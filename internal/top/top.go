// Package top renders `quotad top`: a live terminal view of the leader's fair scheduler (per
// tenant usage, share and wait on each contended bucket) and an over-subscription check of
// the limits (the sum of child limits against the parent's capacity).
//
// It reads what a cluster serves (the Members and GetLimits calls, the leader's /debug/fair
// JSON) and only formats it; it never changes anything.
package top

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"time"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/config"
	"github.com/quotad/quotad/quota"
	"github.com/quotad/quotad/rpc"
)

// Oversubscription is one parent whose children's limits add up to more than its capacity.
type Oversubscription struct {
	Domain string
	// Parent is "domain" or the parent level's key=value path.
	Parent string
	// ParentPerSecond and ChildrenPerSecond are rates normalised to units per second.
	ParentPerSecond, ChildrenPerSecond float64
	Ratio                              float64
}

func perSecond(r *quota.Rate) float64 {
	if r == nil || r.Unit <= 0 {
		return 0
	}
	return float64(r.RequestsPerUnit) / r.Unit.Seconds()
}

// CheckOversubscription returns every parent whose configured children (explicit values;
// a per-value level counts once per value it may see, so it is left out) sum to more than
// maxRatio times the parent's rate. A parent without a rate inherits the nearest ancestor's.
func CheckOversubscription(l *quota.Limits, maxRatio float64) []Oversubscription {
	var out []Oversubscription
	for _, d := range l.Domains {
		var walk func(name string, capacity float64, nodes []quota.Node)
		walk = func(name string, capacity float64, nodes []quota.Node) {
			sum := 0.0
			for _, n := range nodes {
				if n.Value != "" && !n.Unlimited {
					sum += perSecond(n.Rate)
				}
			}
			if capacity > 0 && sum > capacity*maxRatio {
				out = append(out, Oversubscription{Domain: d.Name, Parent: name, ParentPerSecond: capacity, ChildrenPerSecond: sum, Ratio: sum / capacity})
			}
			for _, n := range nodes {
				c := capacity
				if r := perSecond(n.Rate); r > 0 {
					c = r
				}
				child := n.Key + "=" + n.Value
				if n.Value == "" {
					child = n.Key + "=*"
				}
				if name != "domain" {
					child = name + "/" + child
				}
				walk(child, c, n.Children)
			}
		}
		walk("domain", perSecond(d.Rate), d.Descriptors)
	}
	return out
}

// Source fetches what the view shows.
type Source struct {
	Admin quotadv1.AdminClient
	HTTP  *http.Client
	// Scheme of the nodes' HTTP endpoints: "https" for a secure cluster (default "http").
	Scheme string
}

// Fetch reads the leader's fair view and the limits.
func (s Source) Fetch(ctx context.Context) (rpc.FairView, *quota.Limits, error) {
	var v rpc.FairView
	m, err := s.Admin.Members(ctx, &quotadv1.MembersRequest{})
	if err != nil {
		return v, nil, fmt.Errorf("members: %w", err)
	}
	if m.GetLeader().GetHttpAddr() == "" {
		return v, nil, fmt.Errorf("no leader with an HTTP address is known; is the cluster electing?")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, cmp.Or(s.Scheme, "http")+"://"+m.Leader.HttpAddr+"/debug/fair", nil)
	if err != nil {
		return v, nil, err
	}
	resp, err := s.HTTP.Do(req)
	if err != nil {
		return v, nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		hint := ""
		switch resp.StatusCode {
		case http.StatusNotFound:
			hint = " (start the agents with --enable-debug)"
		case http.StatusUnauthorized, http.StatusForbidden:
			hint = " (it needs the admin credential: $QUOTAD_TOKEN or an admin client certificate)"
		}
		return v, nil, fmt.Errorf("%s/debug/fair: %s%s", m.Leader.HttpAddr, resp.Status, hint)
	}
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
		return v, nil, err
	}
	gl, err := s.Admin.GetLimits(ctx, &quotadv1.GetLimitsRequest{})
	if err != nil {
		return v, nil, fmt.Errorf("limits: %w", err)
	}
	l, err := config.Parse("cluster limits", []byte(gl.Yaml))
	if err != nil {
		return v, nil, err
	}
	return v, l, nil
}

// Render writes one frame.
func Render(w io.Writer, v rpc.FairView, l *quota.Limits, maxRatio float64, now time.Time) {
	fmt.Fprintf(w, "quotad top — leader %s — %s — %d waiting\n\n", v.Node, now.Format("15:04:05"), v.Waiting)
	if len(v.Buckets) == 0 {
		fmt.Fprintln(w, "no contended buckets (nothing has waited lately)")
	}
	for _, b := range v.Buckets {
		fmt.Fprintf(w, "%s  scope=%s  waiting=%d (cost %d)  oldest=%.0fms  largest share=%.0f%%  window=%.0fs\n",
			b.Key, b.Scope, b.Waiting, b.WaitingCost, b.OldestWaitMs, 100*b.LargestShare, b.WindowS)
		fmt.Fprintf(w, "  %-24s %-12s %6s %8s %8s %7s %9s %9s\n", "TENANT", "TIER", "WEIGHT", "WAITING", "ADMITTED", "SHARE", "AVG WAIT", "MAX WAIT")
		for _, f := range b.Flows {
			name := f.Flow
			if name == "" {
				name = "(all)"
			}
			fmt.Fprintf(w, "  %-24s %-12s %6d %8d %8d %6.1f%% %7.0fms %7.0fms\n",
				trunc(name, 24), trunc(f.Tier, 12), f.Weight, f.Waiting, f.AdmittedCost, 100*f.Share, f.AvgWaitMs, f.MaxWaitMs)
		}
		fmt.Fprintln(w)
	}
	if l != nil {
		over := CheckOversubscription(l, maxRatio)
		sort.Slice(over, func(i, j int) bool { return over[i].Ratio > over[j].Ratio })
		for _, o := range over {
			fmt.Fprintf(w, "WARNING %s %s: children's limits sum to %.1f/s, %.2fx the parent's %.1f/s (above %.2fx)\n",
				o.Domain, o.Parent, o.ChildrenPerSecond, o.Ratio, o.ParentPerSecond, maxRatio)
		}
	}
}

func trunc(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-1] + "…"
}

// Run redraws the view every interval until ctx ends (once if interval is 0).
func Run(ctx context.Context, w io.Writer, src Source, maxRatio float64, interval time.Duration) error {
	for {
		fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		v, l, err := src.Fetch(fctx)
		cancel()
		if err != nil && interval <= 0 {
			// One frame: the caller prints the error (quotad's main, on stderr); writing it
			// here too printed it twice, once on stdout.
			return err
		}
		var b strings.Builder
		if interval > 0 {
			b.WriteString("\x1b[H\x1b[2J") // home, clear
		}
		if err != nil {
			fmt.Fprintf(&b, "quotad top: %v\n", err)
		} else {
			Render(&b, v, l, maxRatio, time.Now())
		}
		io.WriteString(w, b.String())
		if interval <= 0 {
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(interval):
		}
	}
}
