package quota

import (
	"testing"
	"time"
)

// ShareStatus reports per holder its acknowledgement and demand and per bucket the reserve;
// a holder that never renews counts as an expiry, a released one does not.
func TestShareStatusAckDemandReserveExpiry(t *testing.T) {
	w := newSimWorld(t, sharedDomain(100, 100, &Shares{Lease: 3 * time.Second}))
	h := w.holder("a", wholeDomain)
	if _, err := h.renew(false); err != nil {
		t.Fatal(err)
	}
	lends, hs := w.e.ShareStatus("d")
	if len(lends) != 1 || len(hs) != 1 {
		t.Fatalf("status: %+v %+v", lends, hs)
	}
	l := lends[0]
	if l.Rate != 100*microPerUnit || l.Burst != 100*microPerUnit || l.ReserveRate != 10*microPerUnit || l.ReserveBurst != 10*microPerUnit {
		t.Fatalf("bucket: %+v, want rate and burst 100 with a 10%% reserve", l)
	}
	if s := hs[0]; !s.Acked || s.Unacked != 1 || s.Demand == 0 || s.Rate == 0 {
		t.Fatalf("holder after its first grant: %+v, want only the newest unacknowledged, with demand and rate", s)
	}
	if _, err := h.renew(true); err != nil { // the reply is lost: grant 2 is never acknowledged
		t.Fatal(err)
	}
	if _, err := h.renew(false); err != nil {
		t.Fatal(err)
	}
	if _, hs = w.e.ShareStatus("d"); hs[0].Acked || hs[0].Unacked != 2 {
		t.Fatalf("after a lost reply: %+v, want grants 2 and 3 unacknowledged", hs[0])
	}
	if _, err := h.renew(false); err != nil { // acknowledges 3
		t.Fatal(err)
	}
	if _, hs = w.e.ShareStatus("d"); !hs[0].Acked || hs[0].AckSeq != 3 {
		t.Fatalf("after the acknowledgement: %+v", hs[0])
	}
	if w.e.ShareExpiries() != 0 {
		t.Fatalf("expiries %d before any end", w.e.ShareExpiries())
	}
	w.e.Tick(Time(time.Minute))
	if n := w.e.ShareExpiries(); n != 1 {
		t.Fatalf("expiries %d after the holder stopped renewing, want 1", n)
	}
}
