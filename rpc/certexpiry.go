package rpc

import (
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// certExpiryWarn: a node logs a warning at start when its certificate or the CA ends within
// this long. Certificates are read only at start, so a node keeps presenting the one it
// started with: rotate by restarting (docs/security.md, "Rotation").
const certExpiryWarn = 30 * 24 * time.Hour

// certExpiries returns when f's certificate and the earliest CA certificate of its CA file
// end (NotAfter).
func certExpiries(f TLSFiles) (node, ca time.Time, err error) {
	read := func(path, flag string, all bool) (time.Time, error) {
		b, err := os.ReadFile(path)
		if err != nil {
			return time.Time{}, err
		}
		var end time.Time
		for {
			var blk *pem.Block
			if blk, b = pem.Decode(b); blk == nil {
				break
			}
			if blk.Type != "CERTIFICATE" {
				continue
			}
			c, err := x509.ParseCertificate(blk.Bytes)
			if err != nil {
				return time.Time{}, fmt.Errorf("%s %q: %w", flag, path, err)
			}
			if end.IsZero() || c.NotAfter.Before(end) {
				end = c.NotAfter
			}
			if !all {
				break // the leaf comes first
			}
		}
		if end.IsZero() {
			return end, fmt.Errorf("%s %q holds no PEM certificate", flag, path)
		}
		return end, nil
	}
	if node, err = read(f.CertFile, "--tls-cert", false); err != nil {
		return
	}
	ca, err = read(f.CAFile, "--tls-ca", true)
	return
}

// certExpiryGauge is quotad_tls_certificate_expiry_timestamp_seconds{cert="node"|"ca"}: when
// the certificate this node presents, and its CA, end (Unix seconds). Every node's
// certificate is usually made at once and ends at once; when it does, peers refuse each
// other's Raft connections and callers refuse the node, so alert well before.
func certExpiryGauge(node, ca time.Time) prometheus.Collector {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "quotad_tls_certificate_expiry_timestamp_seconds",
		Help: "When this node's TLS certificate (cert=\"node\") and the cluster CA (cert=\"ca\") end, in Unix seconds (as read at start).",
	}, []string{"cert"})
	g.WithLabelValues("node").Set(float64(node.Unix()))
	g.WithLabelValues("ca").Set(float64(ca.Unix()))
	return g
}

// warnCertExpiry logs a warning for each certificate that ends within certExpiryWarn of now.
func warnCertExpiry(log *slog.Logger, f TLSFiles, node, ca, now time.Time) {
	if left := node.Sub(now); left < certExpiryWarn {
		log.Warn("the node's TLS certificate ends soon: issue a new one from the cluster's CA (quotad tls cert create --server) and restart this node with it",
			"tls_cert", f.CertFile, "not_after", node.UTC().Format(time.RFC3339), "left", left.Round(time.Minute).String())
	}
	if left := ca.Sub(now); left < certExpiryWarn {
		log.Warn("the cluster CA ends soon: every certificate it signed stops verifying then; make a new CA and new certificates for every node and caller (docs/security.md, Rotation)",
			"tls_ca", f.CAFile, "not_after", ca.UTC().Format(time.RFC3339), "left", left.Round(time.Minute).String())
	}
}
