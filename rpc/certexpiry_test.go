package rpc_test

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestCertificateExpiryMetric: /metrics says when the node's certificate and the CA end, so
// an alert can fire before every node's certificate (usually made together) ends at once and
// peers and callers refuse them.
func TestCertificateExpiryMetric(t *testing.T) {
	c, p := authCluster(t, tokenLimits)
	b, err := os.ReadFile(p.files("node").CertFile)
	if err != nil {
		t.Fatal(err)
	}
	blk, _ := pem.Decode(b)
	leaf, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int64{
		`quotad_tls_certificate_expiry_timestamp_seconds{cert="node"}`: leaf.NotAfter.Unix(),
		`quotad_tls_certificate_expiry_timestamp_seconds{cert="ca"}`:   p.ca.NotAfter.Unix(),
	}
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: p.pool}}}
	resp, err := hc.Get("https://" + c.Agent(0).HTTPAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got := map[string]int64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), " "); ok {
			if _, wanted := want[k]; wanted {
				f, err := strconv.ParseFloat(v, 64)
				if err != nil {
					t.Fatalf("%s: %v", sc.Text(), err)
				}
				got[k] = int64(f)
			}
		}
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %d, want %d", k, got[k], v)
		}
	}
}
