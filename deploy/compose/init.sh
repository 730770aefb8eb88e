#!/usr/bin/env bash
# Makes the credentials of the 3-node cluster of deploy/compose.yaml (run once, before
# `docker-compose up`):
#
#   $SECRETS (default deploy/compose/secrets), mounted read-only into every node at /secrets:
#     quotad-ca.pem, n1.pem n1-key.pem, n2.pem ..., n3-key.pem, gossip.key, bootstrap.token
#   $SECRETS/../ca:      quotad-ca-key.pem, the CA key (never mounted; keep it offline)
#   $SECRETS/../client:  admin.pem, admin-key.pem, a copy of quotad-ca.pem — for the CLI
#   deploy/.env:         QUOTAD_UID/QUOTAD_GID, so the containers run as you and can read
#                        the secrets (mode 0600) without making them readable to anyone else
#
# Uses $QUOTAD (default bin/quotad; `make build`). Refuses to overwrite existing files.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
QUOTAD="${QUOTAD:-$root/bin/quotad}"
SECRETS="${SECRETS:-$here/secrets}"
CLUSTER="${CLUSTER:-quotad}"
base="$(dirname "$SECRETS")"
if [ -e "$SECRETS/quotad-ca.pem" ]; then
	echo "init.sh: $SECRETS already holds credentials; remove the directory to make new ones" >&2
	exit 1
fi
mkdir -p "$SECRETS" "$base/ca" "$base/client"
chmod 0700 "$SECRETS" "$base/ca" "$base/client"
"$QUOTAD" tls ca create --cluster "$CLUSTER" --dir "$base/ca"
for n in n1 n2 n3; do
	# Peers and followers reach a node by its service name; the host's CLI by 127.0.0.1.
	"$QUOTAD" tls cert create --server --cluster "$CLUSTER" --name "$n" --dns "$n" --dns localhost --ip 127.0.0.1 \
		--dir "$SECRETS" --ca "$base/ca/quotad-ca.pem" --ca-key "$base/ca/quotad-ca-key.pem"
done
"$QUOTAD" tls cert create --client --cluster "$CLUSTER" --name admin --role admin \
	--dir "$base/client" --ca "$base/ca/quotad-ca.pem" --ca-key "$base/ca/quotad-ca-key.pem"
cp "$base/ca/quotad-ca.pem" "$SECRETS/quotad-ca.pem"
cp "$base/ca/quotad-ca.pem" "$base/client/quotad-ca.pem"
"$QUOTAD" keygen --out "$SECRETS/gossip.key"
"$QUOTAD" keygen --token --out "$SECRETS/bootstrap.token"
if [ -z "${NO_ENV_FILE:-}" ]; then
	printf 'QUOTAD_UID=%s\nQUOTAD_GID=%s\nQUOTAD_SECRETS=%s\n' "$(id -u)" "$(id -g)" "$SECRETS" > "$root/deploy/.env"
	echo "wrote $root/deploy/.env"
fi
cat <<MSG
Credentials are in $base. Start the cluster and point the CLI at it:
  docker-compose -f deploy/compose.yaml up -d
  export QUOTAD_ADDR=127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103 \\
         QUOTAD_CACERT=$base/client/quotad-ca.pem \\
         QUOTAD_CLIENT_CERT=$base/client/admin.pem QUOTAD_CLIENT_KEY=$base/client/admin-key.pem
  quotad status
MSG
