package auth

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base32"
	"encoding/base64"
	"fmt"
	"strings"
)

// Tokens are bearer credentials: "qd_<accessor>_<secret>". The accessor (16 base32
// characters, 80 random bits) is public: it names the token in lists, logs and revocations
// and in Identity.Name ("token:<accessor>"). The secret is 256 random bits. The cluster
// stores only HashToken(token): a token has full entropy, so one SHA-256 is as strong as a
// slow password hash and costs nothing per call.
const tokenPrefix = "qd_"

var accessorEncoding = base32.StdEncoding.WithPadding(base32.NoPadding)

// NewToken returns a fresh token and its accessor.
func NewToken() (token, accessor string, err error) {
	var a [10]byte
	var s [32]byte
	if _, err := rand.Read(a[:]); err != nil {
		return "", "", err
	}
	if _, err := rand.Read(s[:]); err != nil {
		return "", "", err
	}
	accessor = strings.ToLower(accessorEncoding.EncodeToString(a[:]))
	return tokenPrefix + accessor + "_" + base64.RawURLEncoding.EncodeToString(s[:]), accessor, nil
}

// TokenAccessor returns the accessor of a well-formed token, or an error saying what is wrong
// with it (never echoing the secret).
func TokenAccessor(token string) (string, error) {
	rest, ok := strings.CutPrefix(token, tokenPrefix)
	acc, secret, ok2 := strings.Cut(rest, "_")
	if !ok || !ok2 || len(acc) != 16 || len(secret) != 43 {
		return "", fmt.Errorf("auth: not a quotad token (want qd_<16 characters>_<43 characters>, got %d characters)", len(token))
	}
	return acc, nil
}

// HashToken is what the cluster stores and compares: SHA-256 of the whole token.
func HashToken(token string) [32]byte { return sha256.Sum256([]byte(token)) }
