package auth

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
)

// Role is what an Identity may do. An Identity has exactly one.
type Role string

const (
	// RoleAdmin may do everything: limits, tokens, membership, lifting pauses, leadership.
	RoleAdmin Role = "admin"
	// RoleWorker spends quota in its Domains (and, if Tenant is set, only as that tenant):
	// acquire, renew/release/refund what it took itself, report provider feedback, read the
	// status of its domains.
	RoleWorker Role = "worker"
	// RoleReader reads: bucket status, limits, members.
	RoleReader Role = "reader"
	// RoleServer is a cluster node (a certificate with the server SAN). It speaks Raft and may
	// forward a caller's call to the leader on that caller's behalf. Tokens never carry it.
	RoleServer Role = "server"
)

// ParseRole reads a role name as given on a command line or in a token request.
func ParseRole(s string) (Role, error) {
	switch r := Role(strings.ToLower(strings.TrimSpace(s))); r {
	case RoleAdmin, RoleWorker, RoleReader:
		return r, nil
	}
	return "", fmt.Errorf("role %q: use admin, worker or reader", s)
}

// AnyDomain in Identity.Domains lets a worker spend in every domain (a gateway, a region).
const AnyDomain = "*"

// TenantKey is the descriptor key that names a tenant. A worker whose Identity has a Tenant
// may only send requests whose descriptors carry TenantKey=Tenant (seed 002: a caller cannot
// spend another tenant's quota).
const TenantKey = "tenant"

// Identity is an authenticated principal: who a call comes from. The zero value is no
// identity (unauthenticated) and may do nothing. Identities are values; compare by Name.
type Identity struct {
	// Name is stable and unique per principal: "token:<accessor>", "cert:<common name>",
	// "server:<common name>", "bootstrap", or "insecure" (--insecure without credentials).
	// Leases, refunds and request IDs belong to it.
	Name string
	// Role is what the identity may do.
	Role Role
	// Domains a worker may use (AnyDomain for all). Ignored for other roles.
	Domains []string
	// Tenant, if set, is the only value of descriptor key TenantKey a worker may use.
	Tenant string
	// Cert names the client (or server) certificate the identity came from, which the
	// cluster's deny-list is checked against (zero for other credentials). Not part of who
	// the identity is: a certificate reissued with the same common name is the same identity.
	Cert CertKey
}

// IsZero reports whether id is the zero Identity (no credential was presented).
func (id Identity) IsZero() bool { return id.Name == "" && id.Role == "" }

// String names the identity for logs and error messages (never a secret).
func (id Identity) String() string {
	if id.IsZero() {
		return "anonymous"
	}
	s := id.Name + " (" + string(id.Role)
	if id.Role == RoleWorker {
		s += " of " + strings.Join(id.Domains, ",")
		if id.Tenant != "" {
			s += ", tenant " + id.Tenant
		}
	}
	return s + ")"
}

// MayUseDomain reports whether id may spend (or, for readers and admins, read) in domain.
func (id Identity) MayUseDomain(domain string) bool {
	switch id.Role {
	case RoleAdmin, RoleReader:
		return true
	case RoleWorker:
		return slices.Contains(id.Domains, AnyDomain) || slices.Contains(id.Domains, domain)
	}
	return false
}

// MayActForTenant reports whether id may send descriptor TenantKey=tenant. An identity with
// no Tenant may act for any tenant (a gateway).
func (id Identity) MayActForTenant(tenant string) bool {
	return id.Tenant == "" || id.Tenant == tenant
}

// ServerName is the DNS SAN that marks a server (peer) certificate of cluster, and the name
// peers verify when they dial each other: "server.<cluster>.quotad".
func ServerName(cluster string) string { return "server." + cluster + ".quotad" }

// roleScheme is the URI SAN scheme of client certificates:
// quotad://<cluster>/<role>?domain=<d>&domain=<d2>&tenant=<t>.
const roleScheme = "quotad"

// ClientRoleURI is the URI SAN that gives a client certificate of cluster the identity id's
// role, domains and tenant (id.Name is the certificate's common name, not part of the URI).
func ClientRoleURI(cluster string, id Identity) *url.URL {
	q := url.Values{}
	for _, d := range id.Domains {
		q.Add("domain", d)
	}
	if id.Tenant != "" {
		q.Set("tenant", id.Tenant)
	}
	return &url.URL{Scheme: roleScheme, Host: cluster, Path: "/" + string(id.Role), RawQuery: q.Encode()}
}

// ErrNoRole: a verified certificate that carries no quotad role for this cluster.
var ErrNoRole = errors.New("auth: the certificate carries no quotad role for this cluster")

// IsServerCert reports whether cert carries the server role of cluster.
func IsServerCert(cert *x509.Certificate, cluster string) bool {
	return slices.Contains(cert.DNSNames, ServerName(cluster))
}

// IdentityFromCert maps a certificate that already passed chain verification against the
// cluster's CA to an Identity: the server SAN gives RoleServer; a quotad:// URI SAN naming
// cluster gives the role, domains and tenant it encodes; anything else is ErrNoRole.
func IdentityFromCert(cert *x509.Certificate, cluster string) (Identity, error) {
	cn := cert.Subject.CommonName
	if IsServerCert(cert, cluster) {
		return Identity{Name: "server:" + cn, Role: RoleServer}, nil
	}
	for _, u := range cert.URIs {
		if u.Scheme != roleScheme || u.Host != cluster {
			continue
		}
		role, err := ParseRole(strings.TrimPrefix(u.Path, "/"))
		if err != nil {
			return Identity{}, fmt.Errorf("%w: URI SAN %q: %v", ErrNoRole, u, err)
		}
		id := Identity{Name: "cert:" + cn, Role: role}
		if role == RoleWorker {
			q := u.Query()
			id.Domains = q["domain"]
			id.Tenant = q.Get("tenant")
			if len(id.Domains) == 0 {
				return Identity{}, fmt.Errorf("%w: worker URI SAN %q names no domain", ErrNoRole, u)
			}
		}
		return id, nil
	}
	return Identity{}, fmt.Errorf("%w %q (subject %q)", ErrNoRole, cluster, cn)
}
