package quota

import "time"

// lease holds one concurrency permit at each level named by keys until expiry.
type lease struct {
	id     uint64
	expiry Time          // the lease ends at now >= expiry
	ttl    time.Duration // TTL granted at acquire; Renew(…, 0) reuses it
	keys   []string      // concurrency keys (bucket-key format), one permit each
	owner  string        // Request.Owner: who may release and renew it ("": anyone)
}

// ownedBy reports whether owner may release or renew l: the owner that took it, an empty
// owner (an admin), or anyone if it was taken without an owner.
func (l *lease) ownedBy(owner string) bool {
	return owner == "" || l.owner == "" || l.owner == owner
}

// expiryEntry is a lease's expiry in the expiry heap. Renew pushes a new entry and leaves the old
// one behind; entries whose lease is gone or has a different expiry are skipped when popped.
type expiryEntry struct {
	at Time
	id uint64
}

func (x expiryEntry) due() Time { return x.at }

// timeHeap is a min-heap by due time. The engine uses it as an index only (lease expiries; the
// bucket store keeps its own full-at heap): every entry due at or before now is processed, so
// the order among equal times never shows, and Hash and snapshots never see the heaps.
type timeHeap[T interface{ due() Time }] []T

func (h *timeHeap[T]) push(x T) {
	*h = append(*h, x)
	s := *h
	for i := len(s) - 1; i > 0; {
		p := (i - 1) / 2
		if s[p].due() <= s[i].due() {
			break
		}
		s[i], s[p] = s[p], s[i]
		i = p
	}
}

func (h *timeHeap[T]) pop() T {
	s := *h
	top := s[0]
	n := len(s) - 1
	s[0] = s[n]
	var zero T
	s[n] = zero // drop the reference
	s = s[:n]
	s.down(0)
	*h = s
	return top
}

func (h timeHeap[T]) down(i int) {
	n := len(h)
	for {
		l, r, m := 2*i+1, 2*i+2, i
		if l < n && h[l].due() < h[m].due() {
			m = l
		}
		if r < n && h[r].due() < h[m].due() {
			m = r
		}
		if m == i {
			return
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
}

// expireLeases ends every lease whose expiry is at or before now.
func (e *Engine) expireLeases(now Time) {
	for len(e.expiries) > 0 && e.expiries[0].at <= now {
		x := e.expiries.pop()
		if l := e.leases[x.id]; l != nil && l.expiry == x.at {
			e.endLease(l)
		}
	}
}

// endLease returns l's permits and forgets it.
func (e *Engine) endLease(l *lease) {
	for _, k := range l.keys {
		if n := e.inflight[k]; n <= 1 {
			delete(e.inflight, k)
			delete(e.held, k) // no lease holds k: its index entries are all stale
		} else {
			e.inflight[k] = n - 1
		}
	}
	delete(e.leases, l.id)
}

// addLease records l and takes its permits.
func (e *Engine) addLease(l *lease) {
	e.leases[l.id] = l
	for _, k := range l.keys {
		e.inflight[k]++
	}
	e.expiries.push(expiryEntry{at: l.expiry, id: l.id})
	e.indexHeld(l)
}

// indexHeld records l's (new) expiry under each of its concurrency keys. Entries of ended or
// renewed leases are left behind and skipped later; a key's heap is compacted when stale
// entries outnumber the live permits, so it stays within twice the permits held (plus slack).
func (e *Engine) indexHeld(l *lease) {
	for _, k := range l.keys {
		h := e.held[k]
		if h == nil {
			h = new(timeHeap[expiryEntry])
			e.held[k] = h
		}
		h.push(expiryEntry{at: l.expiry, id: l.id})
		if n := uint64(len(*h)); n > 2*e.inflight[k]+8 {
			live, kept := (*h)[:0], make(map[uint64]bool, e.inflight[k])
			for _, x := range *h {
				if e.liveExpiry(x) && !kept[x.id] { // a renewal to the same expiry repeats an entry
					kept[x.id] = true
					live = append(live, x)
				}
			}
			clear((*h)[len(live):])
			*h = live
			for i := len(live)/2 - 1; i >= 0; i-- {
				h.down(i)
			}
		}
	}
}

// liveExpiry reports whether x is the current expiry of a live lease.
func (e *Engine) liveExpiry(x expiryEntry) bool {
	l := e.leases[x.id]
	return l != nil && l.expiry == x.at
}

// heldUntil returns how long after now the first lease holding a permit at concurrency key k
// expires (0 if none does: then a permit is free). Stale index entries on top are dropped.
func (e *Engine) heldUntil(k string, now Time) time.Duration {
	h := e.held[k]
	for h != nil && len(*h) > 0 {
		if x := (*h)[0]; e.liveExpiry(x) {
			return max(0, x.at.Sub(now))
		}
		h.pop()
	}
	return 0
}
