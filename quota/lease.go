package quota

import "time"

// lease holds one concurrency permit at each level named by keys until expiry.
type lease struct {
	id     uint64
	expiry Time          // the lease ends at now >= expiry
	ttl    time.Duration // TTL granted at acquire; Renew(…, 0) reuses it
	keys   []string      // concurrency keys (bucket-key format), one permit each
}

// expiryEntry is a lease's expiry in the expiry heap. Renew pushes a new entry and leaves the old
// one behind; entries whose lease is gone or has a different expiry are skipped when popped.
type expiryEntry struct {
	at Time
	id uint64
}

// expiryHeap is a min-heap by (at, id). It is an index only: Hash and snapshots never see it.
type expiryHeap []expiryEntry

func (h expiryHeap) less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].id < h[j].id
}

func (h *expiryHeap) push(e expiryEntry) {
	*h = append(*h, e)
	s := *h
	for i := len(s) - 1; i > 0; {
		p := (i - 1) / 2
		if !s.less(i, p) {
			break
		}
		s[i], s[p] = s[p], s[i]
		i = p
	}
}

func (h *expiryHeap) pop() expiryEntry {
	s := *h
	top := s[0]
	n := len(s) - 1
	s[0] = s[n]
	s = s[:n]
	for i := 0; ; {
		l, r, m := 2*i+1, 2*i+2, i
		if l < n && s.less(l, m) {
			m = l
		}
		if r < n && s.less(r, m) {
			m = r
		}
		if m == i {
			break
		}
		s[i], s[m] = s[m], s[i]
		i = m
	}
	*h = s
	return top
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
}
