package rpc_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
	"github.com/quotad/quotad/rpc/rpctest"
)

const otherDomain = `
domain: other
rate_limit: {unit: second, requests_per_unit: 5}
`

// TestApplyLimitsUpsertReplaceDryRunDelete: an apply adds or replaces the domains it names and
// keeps the others; a dry run reports the changes and applies nothing; replace_all drops the
// domains the file does not name; deletes remove named domains; requests that cannot be
// applied (empty, unknown domain to delete, both at once) are refused and change nothing.
// Calls go to a follower, which forwards them.
func TestApplyLimitsUpsertReplaceDryRunDelete(t *testing.T) {
	c := rpctest.Start(t, 3, testLimits)
	a := quotadv1.NewAdminClient(dial(t, c.Addrs()[(c.Leader()+1)%3]))
	ctx := context.Background()
	apply := func(req *quotadv1.ApplyLimitsRequest) *quotadv1.ApplyLimitsResponse {
		t.Helper()
		resp, err := a.ApplyLimits(ctx, req)
		if err != nil {
			t.Fatalf("apply %+v: %v", req, err)
		}
		return resp
	}
	version := func() uint64 {
		t.Helper()
		g, err := a.GetLimits(ctx, &quotadv1.GetLimitsRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return g.Version
	}
	refused := func(req *quotadv1.ApplyLimitsRequest, code codes.Code, words ...string) {
		t.Helper()
		before := version()
		_, err := a.ApplyLimits(ctx, req)
		if status.Code(err) != code {
			t.Fatalf("apply %+v: %v, want %v", req, err, code)
		}
		for _, w := range words {
			if !strings.Contains(status.Convert(err).Message(), w) {
				t.Fatalf("apply %+v: %q lacks %q", req, status.Convert(err).Message(), w)
			}
		}
		if v := version(); v != before {
			t.Fatalf("a refused apply changed the limits version %d -> %d", before, v)
		}
	}

	// Dry run of a new domain: the change is listed, nothing applied.
	r := apply(&quotadv1.ApplyLimitsRequest{Yaml: otherDomain, DryRun: true})
	if r.Applied || r.Version != 1 || strings.Join(r.Domains, ",") != "other,provider" || len(r.Changes) != 1 || !strings.HasPrefix(r.Changes[0], "+ domain other") {
		t.Fatalf("dry run: %+v", r)
	}
	if v := version(); v != 1 {
		t.Fatalf("a dry run applied: version %d", v)
	}
	// Upsert: provider stays.
	r = apply(&quotadv1.ApplyLimitsRequest{Yaml: otherDomain})
	if !r.Applied || r.Version != 2 || strings.Join(r.Domains, ",") != "other,provider" {
		t.Fatalf("upsert: %+v", r)
	}
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[0]))
	if d, err := acquireOne(ctx, q, "t", admission(1, 1, "endpoint=charges")); err != nil || !d.Admitted {
		t.Fatalf("provider after upserting other: %+v %v", d, err)
	}
	// Changing one domain: the diff names the change only.
	tighter := strings.Replace(otherDomain, "requests_per_unit: 5", "requests_per_unit: 3", 1)
	r = apply(&quotadv1.ApplyLimitsRequest{Yaml: tighter, DryRun: true})
	if len(r.Changes) != 1 || !strings.Contains(r.Changes[0], "~ other: ceiling 5/second") {
		t.Fatalf("dry run of a change: %+v", r.Changes)
	}
	// Refusals.
	refused(&quotadv1.ApplyLimitsRequest{Yaml: "", FileName: "empty.yaml"}, codes.InvalidArgument, "empty.yaml has no domains")
	refused(&quotadv1.ApplyLimitsRequest{Yaml: "# nothing\n", ReplaceAll: true}, codes.InvalidArgument, "unknown_domain", "quotad limits delete")
	refused(&quotadv1.ApplyLimitsRequest{DeleteDomains: []string{"nope"}}, codes.NotFound, `"nope" is not in force`, "other, provider")
	refused(&quotadv1.ApplyLimitsRequest{Yaml: otherDomain, DeleteDomains: []string{"other"}}, codes.InvalidArgument, "both")
	refused(&quotadv1.ApplyLimitsRequest{Yaml: otherDomain, ReplaceAll: true, DeleteDomains: []string{"provider"}}, codes.InvalidArgument, "replace_all")
	refused(&quotadv1.ApplyLimitsRequest{Yaml: strings.Replace(otherDomain, "domain: other", `domain: " other"`, 1), FileName: "sp.yaml"},
		codes.InvalidArgument, `sp.yaml: domain " other" has leading or trailing whitespace`)
	// Delete, dry run first.
	r = apply(&quotadv1.ApplyLimitsRequest{DeleteDomains: []string{"other"}, DryRun: true})
	if r.Applied || strings.Join(r.Changes, "|") != "- domain other" {
		t.Fatalf("dry-run delete: %+v", r)
	}
	r = apply(&quotadv1.ApplyLimitsRequest{DeleteDomains: []string{"other"}})
	if !r.Applied || strings.Join(r.Domains, ",") != "provider" {
		t.Fatalf("delete: %+v", r)
	}
	// Replace all: provider goes.
	r = apply(&quotadv1.ApplyLimitsRequest{Yaml: otherDomain, ReplaceAll: true})
	if strings.Join(r.Domains, ",") != "other" || !strings.Contains(strings.Join(r.Changes, "|"), "- domain provider") {
		t.Fatalf("replace all: %+v", r)
	}
	if d, err := acquireOne(ctx, q, "t", admission(2, 1, "endpoint=charges")); err != nil || d.Reason != "unknown_domain" {
		t.Fatalf("provider after replace_all without it: %+v %v", d, err)
	}
}

// TestConcurrentUpsertsKeepEachOther: applies of different domains at the same time through
// different nodes all end up in force (the leader merges each into the result of the last).
func TestConcurrentUpsertsKeepEachOther(t *testing.T) {
	c := rpctest.Start(t, 3, testLimits)
	ctx := context.Background()
	var wg sync.WaitGroup
	names := []string{"a1", "a2", "a3", "a4", "a5", "a6"}
	for i, n := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a := quotadv1.NewAdminClient(dial(t, c.Addrs()[i%3]))
			if _, err := a.ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: strings.Replace(otherDomain, "other", n, 1)}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	g, err := quotadv1.NewAdminClient(dial(t, c.Addrs()[0])).GetLimits(ctx, &quotadv1.GetLimitsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range append(names, "provider") {
		if !strings.Contains(g.Yaml, "domain: "+n+"\n") {
			t.Fatalf("domain %s lost by concurrent upserts:\n%s", n, g.Yaml)
		}
	}
}

// TestStrictKeysThroughTheAPI: a strict_keys domain applied at run time refuses the typo
// endpont=charges as invalid, naming the key.
func TestStrictKeysThroughTheAPI(t *testing.T) {
	c := rpctest.Start(t, 3, testLimits)
	ctx := context.Background()
	a := quotadv1.NewAdminClient(dial(t, c.Addrs()[0]))
	q := quotadv1.NewQuotaClient(dial(t, c.Addrs()[1]))
	if d, err := acquireOne(ctx, q, "t", admission(1, 1, "endpont=charges")); err != nil || !d.Admitted {
		t.Fatalf("without strict_keys the typo is admitted (envoy's behaviour): %+v %v", d, err)
	}
	strict := strings.Replace(testLimits, "descriptors:", "strict_keys: true\ndescriptors:", 1)
	r, err := a.ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: strict, DryRun: true})
	if err != nil || strings.Join(r.Changes, "|") != "~ provider: strict_keys false -> true" {
		t.Fatalf("dry run: %+v %v", r, err)
	}
	if _, err := a.ApplyLimits(ctx, &quotadv1.ApplyLimitsRequest{Yaml: strict}); err != nil {
		t.Fatal(err)
	}
	d, err := acquireOne(ctx, q, "t", admission(2, 1, "endpont=charges"))
	if err != nil || d.Admitted || d.Reason != "invalid" || !strings.Contains(d.Message, `"endpont"`) || !strings.Contains(d.Message, "endpoint, tenant") {
		t.Fatalf("with strict_keys: %+v %v", d, err)
	}
	g, err := a.GetLimits(ctx, &quotadv1.GetLimitsRequest{})
	if err != nil || !strings.Contains(g.Yaml, "strict_keys: true") {
		t.Fatalf("limits get: %v %v", g, err)
	}
}
