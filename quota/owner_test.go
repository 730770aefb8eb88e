package quota

import (
	"errors"
	"testing"
	"time"
)

// TestLeaseOwnership: a lease belongs to the owner that took it. Another owner can neither
// release nor renew it (nothing changes); an empty owner (an admin) can; a lease taken without
// an owner is anyone's. Owners survive a snapshot round trip and count in the state hash.
func TestLeaseOwnership(t *testing.T) {
	e := mustEngine(t, &Limits{Domains: []Domain{{Name: "d",
		Rate:        &Rate{Unit: time.Second, RequestsPerUnit: 100, Burst: 100},
		Concurrency: &Concurrency{MaxInFlight: 5, LeaseTTL: 10 * time.Second}}}})
	alice := e.Acquire(0, Request{Domain: "d", Owner: "token:alice"})
	bob := e.Acquire(0, Request{Domain: "d", Owner: "token:bob"})
	anon := e.Acquire(0, Request{Domain: "d"})
	if !alice.Admitted || !bob.Admitted || !anon.Admitted {
		t.Fatalf("acquire: %+v %+v %+v", alice, bob, anon)
	}
	if ok, err := e.ReleaseBy(s, alice.LeaseID, "token:bob"); ok || !errors.Is(err, ErrNotOwner) {
		t.Fatalf("bob released alice's lease: %v %v", ok, err)
	}
	if _, err := e.RenewBy(s, alice.LeaseID, time.Hour, "token:bob"); !errors.Is(err, ErrNotOwner) {
		t.Fatalf("bob renewed alice's lease: %v", err)
	}
	if e.Stats().Leases != 3 {
		t.Fatalf("a refused release changed the leases: %+v", e.Stats())
	}
	if ttl, err := e.RenewBy(s, alice.LeaseID, 0, "token:alice"); err != nil || ttl != 10*time.Second {
		t.Fatalf("alice renews her lease: %v %v", ttl, err)
	}

	// Snapshot round trip keeps owners (format 4) and the hash.
	data, err := e.MarshalBinary()
	if err != nil || data[0] != snapshotFormat4 {
		t.Fatalf("marshal: format %d, %v", data[0], err)
	}
	r := NewEngine()
	if err := r.UnmarshalBinary(data); err != nil {
		t.Fatal(err)
	}
	if r.Hash() != e.Hash() {
		t.Fatal("hash changed across a snapshot round trip")
	}
	if _, err := r.ReleaseBy(2*s, alice.LeaseID, "token:bob"); !errors.Is(err, ErrNotOwner) {
		t.Fatalf("restored engine forgot the owner: %v", err)
	}
	// Owners are part of the state: the same lease under another owner hashes differently.
	x, y := mustEngine(t, e.Limits()), mustEngine(t, e.Limits())
	x.Acquire(0, Request{Domain: "d", Owner: "token:alice"})
	y.Acquire(0, Request{Domain: "d", Owner: "token:bob"})
	if x.Hash() == y.Hash() {
		t.Fatal("the state hash ignores lease owners")
	}
	for _, x := range []struct {
		id    uint64
		owner string
	}{{alice.LeaseID, ""}, {bob.LeaseID, "token:bob"}, {anon.LeaseID, "token:anyone"}} {
		if ok, err := r.ReleaseBy(2*s, x.id, x.owner); !ok || err != nil {
			t.Fatalf("release %d by %q: %v %v", x.id, x.owner, ok, err)
		}
	}
	// With no owned lease left, the engine writes the older format again.
	if data, _ := r.MarshalBinary(); data[0] == snapshotFormat4 {
		t.Fatal("format 4 without owned leases")
	}
}

func TestMaxPauseOf(t *testing.T) {
	l := &Limits{Domains: []Domain{{Name: "a", MaxPause: time.Minute}, {Name: "b"}}}
	if l.MaxPauseOf("a") != time.Minute || l.MaxPauseOf("b") != DefaultMaxPause || l.MaxPauseOf("c") != DefaultMaxPause {
		t.Fatal("MaxPauseOf")
	}
	bad := &Limits{Domains: []Domain{{Name: "a", Rate: &Rate{Unit: time.Second, RequestsPerUnit: 1}, MaxPause: 48 * time.Hour}}}
	if err := NewEngine().SetLimits(0, bad); !errors.Is(err, ErrInvalidLimits) {
		t.Fatalf("max_pause 48h accepted: %v", err)
	}
}
