package main

import (
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestErrorMessage: a failed command prints gRPC's code and message once, with one "quotad: "
// prefix, whether the status error is bare or wrapped (user trial: "quotad: PermissionDenied:
// quotad: Acquire: rpc error: code = PermissionDenied desc = …").
func TestErrorMessage(t *testing.T) {
	denied := status.Error(codes.PermissionDenied, "token:abc (reader) may not acquire")
	for _, tc := range []struct {
		err  error
		want string
	}{
		{denied, "quotad: PermissionDenied: token:abc (reader) may not acquire"},
		{fmt.Errorf("quotad: Acquire: %w", denied), "quotad: Acquire: PermissionDenied: token:abc (reader) may not acquire"},
		{fmt.Errorf("limits apply: %w", denied), "quotad: limits apply: PermissionDenied: token:abc (reader) may not acquire"},
		{fmt.Errorf("--lease-ttl: bad"), "quotad: --lease-ttl: bad"},
	} {
		if got := errorMessage(tc.err); got != tc.want {
			t.Errorf("errorMessage(%q) = %q, want %q", tc.err, got, tc.want)
		}
	}
}
