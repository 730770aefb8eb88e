package deploy

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"google.golang.org/grpc"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/internal/proccluster"
)

const metricsLimits = `
domain: platform
rate_limit: {unit: second, requests_per_unit: 1000}
concurrency: {max_in_flight: 100, lease_ttl: 30s}
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 5, burst: 1}
    concurrency: {max_in_flight: 2, lease_ttl: 30s}
    descriptors:
      - key: consumer
        rate_limit: {unit: minute, requests_per_unit: 600}
`

var (
	scrapeOnce sync.Once
	scraped    map[string]*dto.MetricFamily
	scrapeErr  error
)

// scrapeAgent starts a real 3-node cluster, exercises every code path that creates labelled
// series (admitted, denied, waiting, leases, provider feedback), and scrapes the leader's
// /metrics.
func scrapeAgent(t *testing.T) map[string]*dto.MetricFamily {
	t.Helper()
	scrapeOnce.Do(func() { scraped, scrapeErr = doScrape() })
	if scrapeErr != nil {
		t.Fatal(scrapeErr)
	}
	return scraped
}

func doScrape() (map[string]*dto.MetricFamily, error) {
	dir, err := os.MkdirTemp("", "quotad-metrics-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	lf := filepath.Join(dir, "limits.yaml")
	if err := os.WriteFile(lf, []byte(metricsLimits), 0o644); err != nil {
		return nil, err
	}
	c, err := proccluster.Start(proccluster.Config{Binary: binary, Dir: dir, Nodes: 3, LimitsFile: lf})
	if err != nil {
		return nil, err
	}
	defer c.KillAll()
	leader, err := c.WaitLeader(20 * time.Second)
	if err != nil {
		return nil, err
	}
	opts, err := c.DialOptions()
	if err != nil {
		return nil, err
	}
	conn, err := grpc.NewClient(c.Nodes[leader].GRPCAddr, opts...)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	q := quotadv1.NewQuotaClient(conn)
	path := func(tenant string) []*quotadv1.Entry {
		return []*quotadv1.Entry{{Key: "tenant", Value: tenant}, {Key: "consumer", Value: "app"}}
	}
	var wg sync.WaitGroup
	for i := range 40 {
		wg.Go(func() {
			adm := &quotadv1.Admission{RequestId: uint64(i + 1), Domain: "platform", Descriptors: path(fmt.Sprint("t", i%4)), Cost: 1}
			if i%2 == 0 {
				adm.MaxWaitMs = 1500 // waiting admissions: the fair scheduler's metrics
			}
			_, _ = q.Acquire(ctx, &quotadv1.AcquireRequest{ClientId: "metrics", Admissions: []*quotadv1.Admission{adm}})
		})
	}
	wg.Wait()
	_, _ = q.Feedback(ctx, &quotadv1.FeedbackRequest{Domain: "platform", Descriptors: path("t1"), StatusCode: 429, RetryAfterMs: 100})
	resp, err := c.HTTPClient().Get(c.URL(leader, "/metrics"))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/metrics: %s", resp.Status)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	return p.TextToMetricFamilies(resp.Body)
}

// quotadFamilies returns the quotad_* families (not Go's and the process's own).
func quotadFamilies(fams map[string]*dto.MetricFamily) []string {
	var out []string
	for name := range fams {
		if strings.HasPrefix(name, "quotad_") {
			out = append(out, name)
		}
	}
	sort.Strings(out)
	return out
}

// seriesNames are the names a query may use for a family: histogram and summary series too.
func seriesNames(fams map[string]*dto.MetricFamily) map[string]bool {
	names := map[string]bool{}
	for name, f := range fams {
		names[name] = true
		switch f.GetType() {
		case dto.MetricType_HISTOGRAM:
			names[name+"_bucket"], names[name+"_sum"], names[name+"_count"] = true, true, true
		case dto.MetricType_SUMMARY:
			names[name+"_sum"], names[name+"_count"] = true, true
		}
	}
	return names
}

var metricRef = regexp.MustCompile(`\b((?:quotad|go|process)_[a-zA-Z0-9_]+)`)

// TestGrafanaDashboardQueriesExportedMetrics: every query of deploy/grafana/quotad.json names
// only metrics a running agent exports.
func TestGrafanaDashboardQueriesExportedMetrics(t *testing.T) {
	fams := scrapeAgent(t)
	names := seriesNames(fams)
	b, err := os.ReadFile("grafana/quotad.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash map[string]any
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("grafana/quotad.json: %v", err)
	}
	var exprs []string
	var walk func(v any)
	walk = func(v any) {
		switch x := v.(type) {
		case map[string]any:
			for k, e := range x {
				if s, ok := e.(string); ok && k == "expr" {
					exprs = append(exprs, s)
				}
				walk(e)
			}
		case []any:
			for _, e := range x {
				walk(e)
			}
		}
	}
	walk(dash)
	if len(exprs) < 10 {
		t.Fatalf("only %d queries in the dashboard", len(exprs))
	}
	used := map[string]bool{}
	for _, e := range exprs {
		refs := metricRef.FindAllString(e, -1)
		if len(refs) == 0 {
			t.Errorf("query %q names no metric", e)
		}
		for _, r := range refs {
			used[r] = true
			if !names[r] {
				t.Errorf("query %q: %s is not exported by the agent", e, r)
			}
		}
	}
	t.Logf("%d queries over %d metrics", len(exprs), len(used))
}

// TestMetricsDocumented: docs/metrics.md names every quotad_* metric a running agent exports,
// with its type and labels as exported, and names nothing else.
func TestMetricsDocumented(t *testing.T) {
	fams := scrapeAgent(t)
	b, err := os.ReadFile("../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	names := seriesNames(fams)
	for _, name := range quotadFamilies(fams) {
		f := fams[name]
		labels := map[string]bool{}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = true
			}
		}
		var ls []string
		for l := range labels {
			ls = append(ls, l)
		}
		slices.Sort(ls)
		row := "| `" + name + "` |"
		i := strings.Index(doc, row)
		if i < 0 {
			t.Errorf("docs/metrics.md has no row %q (type %s, labels %v)", row, strings.ToLower(f.GetType().String()), ls)
			continue
		}
		line := doc[i : i+strings.Index(doc[i:], "\n")]
		if !strings.Contains(line, strings.ToLower(f.GetType().String())) {
			t.Errorf("docs/metrics.md %s: the type is %s", name, strings.ToLower(f.GetType().String()))
		}
		for _, l := range ls {
			if !strings.Contains(line, "`"+l+"`") {
				t.Errorf("docs/metrics.md %s: label `%s` not listed", name, l)
			}
		}
	}
	// Labelled families whose series appear only once used: the Envoy RLS (a ShouldRateLimit
	// call), shares (a lendable level with holders) and regions (a regional leader); this
	// scrape uses none.
	onceUsed := func(ref string) bool {
		for _, p := range []string{"quotad_rls_requests_total", "quotad_rate_limit_", "quotad_share_lent_",
			"quotad_share_holders", "quotad_share_central_demand", "quotad_share_paths_total",
			"quotad_share_grants_total", "quotad_share_expiries_total", "quotad_share_reserve_rate",
			"quotad_region_"} { // a regional leader's shares of global levels (docs/regions.md)
			if strings.HasPrefix(ref, p) {
				return true
			}
		}
		return false
	}
	for _, ref := range metricRef.FindAllString(doc, -1) {
		if strings.HasPrefix(ref, "quotad_") && !names[ref] && !strings.HasPrefix(ref, "quotad_build_info") && !onceUsed(ref) {
			t.Errorf("docs/metrics.md names %s, which the agent does not export", ref)
		}
	}
}

// TestPrintMetrics lists what the agent exports (go test -run TestPrintMetrics -v ./deploy/).
func TestPrintMetrics(t *testing.T) {
	fams := scrapeAgent(t)
	for _, name := range quotadFamilies(fams) {
		f := fams[name]
		labels := map[string]bool{}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = true
			}
		}
		var ls []string
		for l := range labels {
			ls = append(ls, l)
		}
		slices.Sort(ls)
		t.Logf("%s %s %v — %s", name, strings.ToLower(f.GetType().String()), ls, f.GetHelp())
	}
}
