package auth

import (
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"strings"
)

// CertKey names one certificate for the cluster's deny-list (fsm certificate revocations):
// the SHA-256 of its DER and its serial number in lower-case hex without leading zeros (how
// `openssl x509 -noout -fingerprint -sha256` and `-serial` print them, without colons). A
// node computes it once per connection, at the TLS handshake; each call then costs a map
// lookup.
type CertKey struct {
	SHA256 [32]byte
	Serial string
}

// IsZero reports whether k names no certificate.
func (k CertKey) IsZero() bool { return k.SHA256 == [32]byte{} && k.Serial == "" }

// KeyOf returns cert's CertKey.
func KeyOf(cert *x509.Certificate) CertKey {
	return CertKey{SHA256: sha256.Sum256(cert.Raw), Serial: SerialHex(cert.SerialNumber)}
}

// SerialHex is the canonical form of a serial number: lower-case hex, no leading zeros.
func SerialHex(n *big.Int) string {
	if n == nil {
		return ""
	}
	return n.Text(16)
}

// ErrBadCertName: a certificate named for revocation in a form that does not parse.
var ErrBadCertName = errors.New("auth: bad certificate name")

// ParseFingerprint reads a SHA-256 fingerprint: 64 hex digits, upper or lower case, with or
// without colons (openssl prints "AB:CD:…") and a "sha256:" or "SHA256 Fingerprint=" prefix.
func ParseFingerprint(s string) ([32]byte, error) {
	var out [32]byte
	t := strings.ToLower(strings.TrimSpace(s))
	for _, p := range []string{"sha256 fingerprint=", "sha256:", "sha256="} {
		t = strings.TrimPrefix(t, p)
	}
	t = strings.ReplaceAll(t, ":", "")
	b, err := hex.DecodeString(t)
	if err != nil || len(b) != len(out) {
		return out, fmt.Errorf("%w: fingerprint %.100q is not a SHA-256 (want 64 hex digits, colons allowed, as `openssl x509 -noout -fingerprint -sha256 -in CERT.pem` prints; or pass the certificate file with --cert)", ErrBadCertName, s)
	}
	copy(out[:], b)
	return out, nil
}

// ParseSerial reads a serial number in hex (as `openssl x509 -noout -serial` prints it), with
// or without colons, a "0x", "serial=" or "serial:" prefix and leading zeros, and returns its canonical
// form (SerialHex). Decimal is not accepted, and digits alone without a prefix or colons are
// refused as ambiguous: Go, cfssl and step print serials in decimal and openssl x509 -text
// prints short ones so, and read as hex they would name another certificate (the revoke would
// succeed and cut off nothing). A random serial is all decimal digits in hex with odds of
// about 1 in 3 million; "0x" or "serial=" says it is hex.
func ParseSerial(s string) (string, error) {
	t := strings.ToLower(strings.TrimSpace(s))
	hexSaid := false
	for _, p := range []string{"serial=", "serial:", "0x"} { // serial: as quotad tls cert revoked lists it
		if u, ok := strings.CutPrefix(t, p); ok {
			t, hexSaid = u, true
		}
	}
	hexSaid = hexSaid || strings.Contains(t, ":")
	t = strings.ReplaceAll(t, ":", "")
	n, ok := new(big.Int).SetString(t, 16)
	if t == "" || len(t) > 64 || !ok || n.Sign() <= 0 {
		return "", fmt.Errorf("%w: serial %.100q is not a positive hex number of at most 64 digits (as `openssl x509 -noout -serial -in CERT.pem` prints it; or pass the certificate file with --cert)", ErrBadCertName, s)
	}
	if !hexSaid && strings.Trim(t, "0123456789") == "" {
		return "", fmt.Errorf("%w: serial %.100q has only decimal digits: it may be decimal (as Go, cfssl, step and openssl x509 -text print serials), which read as hex names another certificate; pass it as `openssl x509 -noout -serial -in CERT.pem` prints it (serial=…), or in hex with 0x, or pass the certificate file with --cert", ErrBadCertName, s)
	}
	return SerialHex(n), nil
}

// ParseCertPEM reads the first certificate of a PEM file's bytes (a chain's leaf comes first).
func ParseCertPEM(b []byte) (*x509.Certificate, error) {
	for len(b) > 0 {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			break
		}
		if blk.Type != "CERTIFICATE" {
			continue // a key in the same file, say: skipped, never echoed
		}
		c, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			return nil, fmt.Errorf("%w: the PEM CERTIFICATE block does not parse: %v", ErrBadCertName, err)
		}
		return c, nil
	}
	return nil, fmt.Errorf("%w: the file holds no PEM CERTIFICATE block; pass the certificate file (e.g. worker.pem, not its key), or name it with --fingerprint or --serial", ErrBadCertName)
}
