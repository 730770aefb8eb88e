// Command headerflood opens gRPC calls that send their headers and never their message — what
// a caller holding a node's memory does — and reports how many the node refused and how its
// RSS moved. It measures --max-calls-per-identity (docs/security.md, "Caps"):
//
//	headerflood -addr 127.0.0.1:7101 -cacert DIR/credentials/quotad-ca.pem \
//	    -token-file DIR/credentials/bootstrap.token -pid $(cat DIR/node1.pid) -calls 30000
//
// Calls go over -conns HTTP/2 connections (a node takes 32,768 concurrent calls on one).
package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:7101", "node's gRPC address")
	caFile := flag.String("cacert", "", "cluster CA (PEM)")
	tokenFile := flag.String("token-file", "", "file holding a bearer token (empty: no credential)")
	calls := flag.Int("calls", 30000, "calls to open")
	conns := flag.Int("conns", 2, "HTTP/2 connections to spread them over")
	pid := flag.Int("pid", 0, "node's pid, to read its RSS (0: not read)")
	hold := flag.Duration("hold", 5*time.Second, "how long to hold the calls before reading RSS")
	method := flag.String("method", "/quotad.v1.Quota/Acquire", "gRPC method")
	honest := flag.Int("honest", 0, "while the flood is held, send this many gRPC health Checks from this host (as a health checker sharing the flooder's address) and report how many were answered SERVING")
	again := flag.Bool("again", false, "keep opening calls (headers only) until the hold ends, instead of -calls once")
	metricsURL := flag.String("metrics", "", "node's /metrics URL (https), to read go_goroutines before and during the flood")
	flag.Parse()

	pem, err := os.ReadFile(*caFile)
	if err != nil {
		log.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	token := ""
	if *tokenFile != "" {
		b, err := os.ReadFile(*tokenFile)
		if err != nil {
			log.Fatal(err)
		}
		token = strings.TrimSpace(string(b))
	}
	before, gBefore := rss(*pid), goroutines(*metricsURL, pool)
	var refused, answered atomic.Int64
	opened = &atomic.Int64{}
	var wg sync.WaitGroup
	var open sync.WaitGroup
	open.Add(*conns)
	for c := range *conns {
		n := *calls / *conns
		if c < *calls%*conns {
			n++
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			flood(*addr, pool, token, *method, n, *again, &open, &refused, &answered, *hold)
		}()
	}
	open.Wait()
	deadline := time.Now().Add(*hold)
	if *honest > 0 {
		ok, first := healthChecks(*addr, pool, *honest)
		fmt.Printf("honest health checks from this host during the flood: %d of %d SERVING (first failure: %v)\n", ok, *honest, first)
	}
	time.Sleep(time.Until(deadline))
	during, gDuring := rss(*pid), goroutines(*metricsURL, pool)
	fmt.Printf("calls %d over %d connections: refused ResourceExhausted %d, other answers (ended) %d, held %d\n",
		opened.Load(), *conns, refused.Load(), answered.Load()-refused.Load(), opened.Load()-answered.Load())
	if *pid != 0 {
		fmt.Printf("node RSS before %d MB, holding %d MB\n", before>>20, during>>20)
	}
	if *metricsURL != "" {
		fmt.Printf("node goroutines before %d, holding %d\n", gBefore, gDuring)
	}
	wg.Wait()
}

func flood(addr string, pool *x509.CertPool, token, method string, n int, again bool, open *sync.WaitGroup, refused, answered *atomic.Int64, hold time.Duration) {
	c, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: pool, NextProtos: []string{"h2"}})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte(http2.ClientPreface)); err != nil {
		log.Fatal(err)
	}
	fr := http2.NewFramer(c, c)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if err := fr.WriteSettings(); err != nil {
		log.Fatal(err)
	}
	var mu sync.Mutex // the framer's writes
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.SettingsFrame:
				if !f.IsAck() {
					mu.Lock()
					_ = fr.WriteSettingsAck()
					mu.Unlock()
				}
			case *http2.PingFrame:
				if !f.IsAck() {
					mu.Lock()
					_ = fr.WritePing(true, f.Data)
					mu.Unlock()
				}
			case *http2.MetaHeadersFrame:
				for _, hf := range f.RegularFields() {
					if hf.Name == "grpc-status" {
						answered.Add(1)
						if hf.Value == "8" {
							refused.Add(1)
						}
					}
				}
			}
		}
	}()
	var buf bytes.Buffer
	enc := hpack.NewEncoder(&buf)
	if again {
		open.Done() // the hold starts now; calls go on until it ends
		open = &sync.WaitGroup{}
		open.Add(1)
		n = 1<<30 - 1
	}
	end := time.Now().Add(hold)
	for i := range n {
		if again && i%64 == 0 && time.Now().After(end) {
			break
		}
		buf.Reset()
		fields := []string{":method", "POST", ":scheme", "https", ":path", method, ":authority", addr,
			"content-type", "application/grpc", "te", "trailers"}
		if token != "" {
			fields = append(fields, "authorization", "Bearer "+token)
		}
		for j := 0; j+1 < len(fields); j += 2 {
			_ = enc.WriteField(hpack.HeaderField{Name: fields[j], Value: fields[j+1]})
		}
		opened.Add(1)
		mu.Lock()
		err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: uint32(2*i + 1), BlockFragment: buf.Bytes(), EndHeaders: true})
		mu.Unlock()
		if err != nil {
			log.Fatal(err)
		}
	}
	open.Done()
	select {
	case <-done:
	case <-time.After(hold + 2*time.Second):
	}
}

// opened counts the calls whose headers were sent.
var opened *atomic.Int64

// healthChecks sends n gRPC health Checks, one after another, and returns how many were
// answered SERVING and the first error.
func healthChecks(addr string, pool *x509.CertPool, n int) (int, error) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool})))
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	ok := 0
	var first error
	for range n {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		r, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && r.Status == healthpb.HealthCheckResponse_SERVING {
			ok++
		} else if first == nil {
			first = fmt.Errorf("%v %v", r, err)
		}
	}
	return ok, first
}

// goroutines reads go_goroutines from a node's /metrics (0 if url is empty or unreadable).
func goroutines(url string, pool *x509.CertPool) int {
	if url == "" {
		return 0
	}
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	resp, err := c.Get(url)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "go_goroutines "); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}

// rss returns pid's resident set size in bytes (0 if pid is 0 or unreadable).
func rss(pid int) int64 {
	if pid == 0 {
		return 0
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			var kb int64
			fmt.Sscan(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), &kb)
			return kb << 10
		}
	}
	return 0
}
