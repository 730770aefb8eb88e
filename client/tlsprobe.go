package client

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"strings"
	"sync"
	"time"
)

// prefaceError is in the error gRPC gives when a connection ended before the server's HTTP/2
// preface arrived. A plaintext client of a TLS node gets it ("error reading server preface:
// EOF": the node drops the connection on a first record that is not TLS) — and so does one
// whose plaintext node closed an accepted connection at once (killed or restarting). The
// words cannot tell the two apart, so a TLS ClientHello to the node does (tlsProbes).
const prefaceError = "error reading server preface"

// tlsProbeTimeout bounds one probe; tlsProbeTTL is how long its answer is used.
const (
	tlsProbeTimeout = time.Second
	tlsProbeTTL     = 10 * time.Second
)

// tlsProbes remembers which nodes answered a TLS ClientHello, probed when a plaintext client
// got prefaceError from them: the evidence the "speaks TLS?" hint needs. Safe for concurrent
// use; the zero value is ready.
type tlsProbes struct {
	mu  sync.Mutex
	res map[string]tlsProbe
}

type tlsProbe struct {
	at    time.Time
	spoke bool // the node answered in TLS
}

// probe checks addr once per tlsProbeTTL, in a goroutine of its own (at most one per node at a
// time, ending within tlsProbeTimeout or when ctx, the client's, ends): the call that got the
// error goes on to the next node meanwhile. A node that accepts without answering (a listener
// open before the process serves) would otherwise hold the call for the probe's timeout.
func (p *tlsProbes) probe(ctx context.Context, addr string) {
	p.mu.Lock()
	if r, ok := p.res[addr]; ok && time.Since(r.at) < tlsProbeTTL {
		p.mu.Unlock()
		return
	}
	if p.res == nil {
		p.res = make(map[string]tlsProbe)
	}
	p.res[addr] = tlsProbe{at: time.Now()} // one prober at a time; no answer until it knows
	p.mu.Unlock()
	go func() {
		spoke := speaksTLS(ctx, addr)
		p.mu.Lock()
		p.res[addr] = tlsProbe{at: time.Now(), spoke: spoke}
		p.mu.Unlock()
	}()
}

// answered returns the addresses whose last probe (within tlsProbeTTL) found TLS.
func (p *tlsProbes) answered() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for addr, r := range p.res {
		if r.spoke && time.Since(r.at) < tlsProbeTTL {
			out = append(out, addr)
		}
	}
	return out
}

// speaksTLS reports whether addr answers a TLS ClientHello in TLS: the handshake completes (the
// certificate is not checked: this is only a question of protocol), or the node refuses it
// with a TLS alert (it wants a client certificate, say). A connection refused, reset or closed
// without an answer, or answered in another protocol (a plaintext gRPC node's HTTP/2
// settings), is no evidence.
func speaksTLS(ctx context.Context, addr string) bool {
	ctx, cancel := context.WithTimeout(ctx, tlsProbeTimeout)
	defer cancel()
	var d net.Dialer
	raw, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return false
	}
	defer raw.Close()
	host, _, _ := net.SplitHostPort(addr)
	conn := tls.Client(raw, &tls.Config{ServerName: host, InsecureSkipVerify: true, NextProtos: []string{"h2"}}) // a protocol probe: nothing is sent over it
	err = conn.HandshakeContext(ctx)
	if err == nil {
		return true
	}
	var opErr *net.OpError
	return errors.As(err, &opErr) && opErr.Op == "remote error" && strings.HasPrefix(opErr.Err.Error(), "tls: ")
}
