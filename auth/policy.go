package auth

import (
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
)

// Who may call which gRPC method. Every method a quotad server serves is listed here; a
// method that is not listed needs the admin role (a new RPC is closed until someone decides
// who may call it). Admins may call everything; workers' and readers' domain and tenant
// scopes are checked by the handlers (Identity.MayUseDomain, MayActForTenant), which see the
// request.
//
// Errors wrap ErrUnauthenticated (no identity) or ErrPermissionDenied (an identity without
// the role); rpc maps them to the gRPC codes of the same names.

var (
	// ErrUnauthenticated: the call carries no credential this cluster accepts.
	ErrUnauthenticated = errors.New("unauthenticated")
	// ErrPermissionDenied: the caller is known but its role does not allow the call.
	ErrPermissionDenied = errors.New("permission denied")
)

// Access is what a method needs.
type Access struct {
	// Open methods need no credential at all (health checks).
	Open bool
	// Roles that may call the method besides admin (admin may call every method).
	Roles []Role
}

var (
	open       = Access{Open: true}
	adminOnly  = Access{}
	workers    = Access{Roles: []Role{RoleWorker}}
	readers    = Access{Roles: []Role{RoleReader}}
	workOrRead = Access{Roles: []Role{RoleWorker, RoleReader}}
	servers    = Access{Roles: []Role{RoleServer}}
)

// Methods is the method → access table. Keys are gRPC full method names.
var Methods = map[string]Access{
	// quotad.v1.Quota: spending quota and reading buckets.
	"/quotad.v1.Quota/Acquire":       workers,
	"/quotad.v1.Quota/AcquireStream": workers, // each admission checked as Acquire's; the token re-checked per message
	"/quotad.v1.Quota/Release":       workers, // own leases only (the FSM checks the owner)
	"/quotad.v1.Quota/Renew":         workers, // own leases only
	"/quotad.v1.Quota/Refund":        workers, // own requests only (request IDs are namespaced by owner)
	"/quotad.v1.Quota/Feedback":      workers,
	"/quotad.v1.Quota/Share":         workers, // shares belong to the caller's identity
	"/quotad.v1.Quota/ReleaseShare":  workers, // own holders only (the holder key includes the identity)
	"/quotad.v1.Quota/Status":        workOrRead,
	"/quotad.v1.Quota/ShareStatus":   readers, // every holder of a path, whoever owns it

	// quotad.v1.Admin: reads for readers, every change for admins.
	"/quotad.v1.Admin/GetLimits":          workOrRead, // a worker sees only its domains (a regional leader follows them)
	"/quotad.v1.Admin/Members":            readers,
	"/quotad.v1.Admin/ApplyLimits":        adminOnly,
	"/quotad.v1.Admin/TransferLeadership": adminOnly,
	"/quotad.v1.Admin/RemoveServer":       adminOnly,
	"/quotad.v1.Admin/CreateToken":        adminOnly,
	"/quotad.v1.Admin/ListTokens":         adminOnly,
	"/quotad.v1.Admin/RevokeToken":        adminOnly,
	"/quotad.v1.Admin/RevokeCert":         adminOnly,
	"/quotad.v1.Admin/ListRevokedCerts":   adminOnly,
	"/quotad.v1.Admin/LiftPause":          adminOnly,

	// quotad.v1.Snapshot: the whole state, tokens' hashes included, out and in.
	"/quotad.v1.Snapshot/Save":        adminOnly,
	"/quotad.v1.Snapshot/Restore":     adminOnly,
	"/quotad.v1.Snapshot/PlanRestore": adminOnly, // Restore's dry run: the file and the state compared

	// Health checks are for load balancers and orchestrators, which hold no credential
	// (Kubernetes' gRPC probe and Envoy's health checker call Check). Watch is a stream that
	// lives as long as the caller likes: open, 20,000 of them on one connection took a node
	// from 37 to 292 MB, so it needs a credential of any role.
	"/grpc.health.v1.Health/Check": open,
	"/grpc.health.v1.Health/Watch": workOrRead,
	"/grpc.health.v1.Health/List":  open,

	// Envoy's rate limit service (envoy.service.ratelimit.v3), when it is served: a gateway
	// spends quota like a worker (usually with no tenant, so it may act for every tenant).
	RateLimitMethod: workers,

	// quotad.v1.Peer: node to node. A follower forwards a batch of Envoy calls, each with its
	// own caller, which the leader authenticates and authorizes as for RateLimitMethod.
	ForwardRateLimitMethod: servers,
}

// ForwardRateLimitMethod is a follower's batch of forwarded RateLimitMethod calls.
const ForwardRateLimitMethod = "/quotad.v1.Peer/ForwardRateLimit"

// RateLimitMethod is Envoy's global rate limit call (served by an RLS adapter).
const RateLimitMethod = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"

// AccessOf returns what fullMethod needs (admin for a method that is not listed).
func AccessOf(fullMethod string) Access {
	if a, ok := Methods[fullMethod]; ok {
		return a
	}
	return adminOnly
}

// MethodName is the last part of a full method name ("/quotad.v1.Quota/Acquire" → "Acquire").
func MethodName(fullMethod string) string {
	return fullMethod[strings.LastIndex(fullMethod, "/")+1:]
}

// Authorize decides whether id may call fullMethod. The error says which role the method
// needs and who the caller is; it wraps ErrUnauthenticated for the zero Identity and
// ErrPermissionDenied for a known identity without the role.
func Authorize(id Identity, fullMethod string) error {
	a := AccessOf(fullMethod)
	if a.Open {
		return nil
	}
	if id.IsZero() {
		return &denial{ErrUnauthenticated, fmt.Sprintf("%s needs a credential: send metadata \"authorization: Bearer <token>\" (quotad --token-file or $QUOTAD_TOKEN) or a client certificate signed by the cluster's CA",
			MethodName(fullMethod))}
	}
	if id.Role == RoleAdmin || slices.Contains(a.Roles, id.Role) {
		return nil
	}
	return &denial{ErrPermissionDenied, fmt.Sprintf("%s needs the %s role; the caller is %s", MethodName(fullMethod), a.need(), id)}
}

// denial is an Authorize error: its message says what is missing, without the kind's name
// (rpc turns the kind into a gRPC code, which already says it).
type denial struct {
	kind error
	msg  string
}

func (d *denial) Error() string { return d.msg }
func (d *denial) Unwrap() error { return d.kind }

// need names the roles that may call a method, for error messages.
func (a Access) need() string {
	names := make([]string, 0, len(a.Roles)+1)
	for _, r := range a.Roles {
		names = append(names, string(r))
	}
	names = append(names, string(RoleAdmin))
	if len(names) == 1 {
		return names[0]
	}
	return strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

// A principal is an Identity as a server passes it on when it forwards a caller's call to
// the leader (metadata PrincipalHeader). The leader believes it only from a peer whose
// certificate carries the server role: anyone else could claim any identity.
const PrincipalHeader = "x-quotad-principal"

// EncodePrincipal encodes id for PrincipalHeader.
func EncodePrincipal(id Identity) string {
	q := url.Values{}
	q.Set("name", id.Name)
	q.Set("role", string(id.Role))
	for _, d := range id.Domains {
		q.Add("domain", d)
	}
	if id.Tenant != "" {
		q.Set("tenant", id.Tenant)
	}
	if !id.Cert.IsZero() {
		q.Set("cert", hex.EncodeToString(id.Cert.SHA256[:]))
		q.Set("serial", id.Cert.Serial)
	}
	return q.Encode()
}

// DecodePrincipal reads what EncodePrincipal wrote. A principal never carries the server
// role (a server forwards on behalf of callers, not of itself).
func DecodePrincipal(s string) (Identity, error) {
	q, err := url.ParseQuery(s)
	if err != nil {
		return Identity{}, fmt.Errorf("auth: principal %.60q: %v", s, err)
	}
	role, err := ParseRole(q.Get("role"))
	if err != nil {
		return Identity{}, fmt.Errorf("auth: principal %.60q: %v", s, err)
	}
	id := Identity{Name: q.Get("name"), Role: role, Domains: q["domain"], Tenant: q.Get("tenant")}
	if id.Name == "" {
		return Identity{}, fmt.Errorf("auth: principal %.60q has no name", s)
	}
	if c := q.Get("cert"); c != "" {
		b, err := hex.DecodeString(c)
		if err != nil || len(b) != len(id.Cert.SHA256) {
			return Identity{}, fmt.Errorf("auth: principal %.60q: cert is not a hex SHA-256", s)
		}
		copy(id.Cert.SHA256[:], b)
		id.Cert.Serial = q.Get("serial")
	}
	return id, nil
}
