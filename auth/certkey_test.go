package auth

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
)

func TestParseCertNames(t *testing.T) {
	want := sha256.Sum256([]byte("der"))
	var parts []string
	for _, x := range want {
		parts = append(parts, strings.ToUpper(hex.EncodeToString([]byte{x})))
	}
	hexs := strings.Join(parts, ":") // as openssl prints it
	for _, in := range []string{hexs, "SHA256 Fingerprint=" + hexs, "sha256:" + strings.ToLower(strings.ReplaceAll(hexs, ":", "")), "  " + hexs + "\n"} {
		if got, err := ParseFingerprint(in); err != nil || got != want {
			t.Errorf("ParseFingerprint(%q) = %x, %v", in, got, err)
		}
	}
	for _, in := range []string{"", "3f9a", hexs + ":00", "zz" + hexs[2:]} {
		if _, err := ParseFingerprint(in); !errors.Is(err, ErrBadCertName) || !strings.Contains(err.Error(), "64 hex digits") {
			t.Errorf("ParseFingerprint(%q): %v", in, err)
		}
	}
	for in, want := range map[string]string{"1F": "1f", "serial=00:1F": "1f", "0x01f": "1f", "serial=10": "10", "0x10": "10", "10:00": "1000", "serial:4096": "4096"} {
		if got, err := ParseSerial(in); err != nil || got != want {
			t.Errorf("ParseSerial(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", "0", "-1", "12-34", "g1", strings.Repeat("f", 65)} {
		if _, err := ParseSerial(in); !errors.Is(err, ErrBadCertName) {
			t.Errorf("ParseSerial(%q): %v", in, err)
		}
	}
	// Digits alone could be decimal (Go, cfssl, step print serials so): refused, not read as
	// hex, which would revoke another certificate and cut off nothing.
	for _, in := range []string{"10", "4096", " 340282366920938463463374607431768211455 "} {
		if _, err := ParseSerial(in); !errors.Is(err, ErrBadCertName) || !strings.Contains(err.Error(), "only decimal digits") {
			t.Errorf("ParseSerial(%q): %v, want refused as ambiguous", in, err)
		}
	}
	if _, err := ParseCertPEM([]byte("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")); err == nil || strings.Contains(err.Error(), "AAAA") {
		t.Errorf("a key file: %v", err)
	}
}

// A principal carries the certificate's key, so the node it is forwarded to checks the
// deny-list too; a bad one is refused.
func TestPrincipalCarriesCert(t *testing.T) {
	id := Identity{Name: "cert:w", Role: RoleWorker, Domains: []string{"d"}, Cert: CertKey{SHA256: sha256.Sum256([]byte("x")), Serial: "1f"}}
	got, err := DecodePrincipal(EncodePrincipal(id))
	if err != nil || got.Cert != id.Cert || got.Name != id.Name {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	if got, err := DecodePrincipal(EncodePrincipal(Identity{Name: "token:a", Role: RoleAdmin})); err != nil || !got.Cert.IsZero() {
		t.Fatalf("without a certificate: %+v %v", got, err)
	}
	if _, err := DecodePrincipal("name=cert%3Aw&role=worker&domain=d&cert=abcd"); err == nil {
		t.Fatal("a short cert fingerprint was accepted")
	}
}
