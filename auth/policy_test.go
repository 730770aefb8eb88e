package auth

import (
	"errors"
	"strings"
	"testing"
)

func TestAuthorize(t *testing.T) {
	admin := Identity{Name: "bootstrap", Role: RoleAdmin}
	worker := Identity{Name: "token:w", Role: RoleWorker, Domains: []string{"d"}}
	reader := Identity{Name: "cert:r", Role: RoleReader}
	server := Identity{Name: "server:n1", Role: RoleServer}
	for _, c := range []struct {
		id     Identity
		method string
		want   error
	}{
		{Identity{}, "/quotad.v1.Quota/Acquire", ErrUnauthenticated},
		{Identity{}, "/grpc.health.v1.Health/Check", nil},
		{worker, "/quotad.v1.Quota/Acquire", nil},
		{worker, "/quotad.v1.Quota/Feedback", nil},
		{worker, "/quotad.v1.Quota/Status", nil},
		{worker, RateLimitMethod, nil},
		{worker, "/quotad.v1.Admin/ApplyLimits", ErrPermissionDenied},
		{worker, "/quotad.v1.Admin/GetLimits", nil}, // its own domains only (rpc filters)
		{reader, "/quotad.v1.Quota/Acquire", ErrPermissionDenied},
		{reader, "/quotad.v1.Quota/Status", nil},
		{reader, "/quotad.v1.Admin/Members", nil},
		{reader, "/quotad.v1.Admin/ListTokens", ErrPermissionDenied},
		{server, "/quotad.v1.Quota/Acquire", ErrPermissionDenied},
		{admin, "/quotad.v1.Admin/CreateToken", nil},
		{admin, "/quotad.v1.Admin/SomethingNew", nil},
		{reader, "/quotad.v1.Admin/SomethingNew", ErrPermissionDenied}, // unlisted: admin only
	} {
		err := Authorize(c.id, c.method)
		if (c.want == nil) != (err == nil) || (c.want != nil && !errors.Is(err, c.want)) {
			t.Errorf("%v calling %s: %v, want %v", c.id, c.method, err, c.want)
		}
	}
	err := Authorize(reader, "/quotad.v1.Quota/Acquire")
	if msg := err.Error(); !strings.Contains(msg, "Acquire needs the worker or admin role") || !strings.Contains(msg, "cert:r (reader)") {
		t.Errorf("message %q", msg)
	}
}

func TestPrincipalRoundTrip(t *testing.T) {
	id := Identity{Name: "cert:gw&x=1", Role: RoleWorker, Domains: []string{"a", "b/c"}, Tenant: "acme"}
	got, err := DecodePrincipal(EncodePrincipal(id))
	if err != nil || got.Name != id.Name || got.Role != id.Role || strings.Join(got.Domains, ",") != "a,b/c" || got.Tenant != "acme" {
		t.Fatalf("%+v %v", got, err)
	}
	for _, bad := range []string{"", "name=x&role=server", "role=admin", "%zz"} {
		if _, err := DecodePrincipal(bad); err == nil {
			t.Errorf("DecodePrincipal(%q) accepted", bad)
		}
	}
}
