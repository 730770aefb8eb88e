package main

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestLoadKey: the HMAC key comes from the environment or a file; none, a short one or an
// unreadable file is refused naming what to set (user trial: the key was a flag with the
// default "demo-secret", so a gateway started without one accepted tokens anyone could mint).
func TestLoadKey(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "key")
	if err := os.WriteFile(good, []byte("0123456789abcdef0123\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	short := filepath.Join(dir, "short")
	if err := os.WriteFile(short, []byte("demo-secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		file, env, want, err string
	}{
		{env: "fedcba9876543210fedcba", want: "fedcba9876543210fedcba"},
		{file: good, env: "ignored-when-a-file-is-given", want: "0123456789abcdef0123"},
		{err: "no HMAC key: set $GATEWAY_HMAC_KEY or -key-file"},
		{env: "demo-secret", err: "$GATEWAY_HMAC_KEY is 11 bytes"},
		{file: short, err: "is 11 bytes"},
		{file: filepath.Join(dir, "missing"), err: "-key-file"},
	} {
		key, err := loadKey(tc.file, tc.env)
		switch {
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("loadKey(%q, %q): %q, %v; want an error saying %q", tc.file, tc.env, key, err, tc.err)
		case tc.err == "" && (err != nil || string(key) != tc.want):
			t.Errorf("loadKey(%q, %q): %q, %v; want %q", tc.file, tc.env, key, err, tc.want)
		}
	}
}

// TestMintRoundTrip: a minted token identifies exactly the tenant and consumer it was minted
// for, or minting refuses (user trial: -mint acme.mobile:app gave a token the gateway took as
// tenant "acme", consumer "mobile.app": a tenant named with a '.' spent another tenant's quota).
func TestMintRoundTrip(t *testing.T) {
	v := verifier{key: []byte("0123456789abcdef0123")}
	for _, tc := range []struct{ tenant, consumer, err string }{
		{tenant: "acme", consumer: "mobile-app"},
		{tenant: "acme", consumer: "mobile.app"},
		{tenant: "acme", consumer: ""},
		{tenant: "acme.mobile", consumer: "app", err: "contains '.'"},
		{tenant: "", consumer: "app", err: "no tenant"},
	} {
		tok, err := v.mint(tc.tenant, tc.consumer)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				r, _ := http.NewRequest("GET", "/", nil)
				r.Header.Set("Authorization", "Bearer "+tok)
				id, _ := v.identify(r)
				t.Errorf("mint(%q, %q) = %q (identified as tenant %q, consumer %q), %v; want an error saying %q", tc.tenant, tc.consumer, tok, id.Tenant, id.Consumer, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("mint(%q, %q): %v", tc.tenant, tc.consumer, err)
		}
		r, _ := http.NewRequest("GET", "/", nil)
		r.Header.Set("Authorization", "Bearer "+tok)
		id, err := v.identify(r)
		if err != nil || id.Tenant != tc.tenant || id.Consumer != tc.consumer {
			t.Errorf("mint(%q, %q) identified as tenant %q, consumer %q, %v", tc.tenant, tc.consumer, id.Tenant, id.Consumer, err)
		}
	}
}
