package rpc

import (
	"testing"

	quotadv1 "github.com/quotad/quotad/api/quotad/v1"
)

// TestPathKeyOneAllocation: a waiter's path key is built once per waiting admission on the
// leader's hot path; it costs one allocation however many descriptors the path has.
func TestPathKeyOneAllocation(t *testing.T) {
	adm := &quotadv1.Admission{Domain: "provider", Descriptors: []*quotadv1.Entry{
		{Key: "endpoint", Value: "/v1/chat/completions"}, {Key: "tenant", Value: "tenant-0042"}, {Key: "consumer", Value: "worker-17"}}}
	if got, want := pathKey(adm), "provider\x00endpoint\x00/v1/chat/completions\x00tenant\x00tenant-0042\x00consumer\x00worker-17"; got != want {
		t.Fatalf("pathKey = %q, want %q", got, want)
	}
	if n := testing.AllocsPerRun(100, func() { _ = pathKey(adm) }); n != 1 {
		t.Fatalf("pathKey allocates %.0f times, want 1", n)
	}
}
