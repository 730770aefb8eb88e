// Package auth decides who may do what in a quotad cluster: the identities behind peers and
// callers, the roles they hold, tokens, and the TLS rules that tell a server credential from a
// client one. It holds policy only — no listeners, no RPC, no replicated state — so that rpc/
// and cluster/ ask the same questions and get the same answers.
//
// The three trust boundaries (docs/security.md):
//   - Peers: only a certificate carrying the server role (DNS SAN ServerName(cluster)) may speak
//     Raft or forward calls on behalf of another identity.
//   - Callers: every gRPC call carries a bearer token and/or a client certificate, mapped to an
//     Identity with one Role; handlers check what that Identity may do.
//   - Operators: debug endpoints need the admin role.
//
// It must never read a clock for a decision that is replicated, and never log a secret.
package auth
