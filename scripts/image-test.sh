#!/usr/bin/env bash
# make image-test: the image against the host's PostgreSQL, Redis and broker (podman,
# --network host). From the image alone: migrate, topics, an activity, then `api` and
# `consume` as two containers; a buyer's reservation through the containerised API must become
# an order the containerised consumer created, and both must run as the image's non-root user.
# Builds the image first when it is missing (scripts/image.sh). Isolated like a test (its own
# environment name, schema, key prefix and topics), cleaned up at the end.
# Last line: IMAGE_TEST OK|FAILED ...
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${SECKILL_IMAGE:-localhost/seckill:dev}"
. "$REPO_DIR/scripts/podman-lib.sh"

log() { echo "image-test: $*"; }
fail() { log "$*"; echo "IMAGE_TEST FAILED $*"; exit 1; }

"$REPO_DIR/scripts/services-up.sh" >/dev/null
podman_ image exists "$IMAGE" || "$REPO_DIR/scripts/image.sh"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
id="$(date +%s)$RANDOM"
env_name="IMG$id"
schema="img_$id"
prefix="img-$id"
api_port="$(free_port)" ops_port="$(free_port)" consume_port="$(free_port)"
vars=(
  -e SECKILL_ENV=test -e "SECKILL__ENV=$env_name" -e "SECKILL__PG__SCHEMA=$schema"
  -e "SECKILL__REDIS__KEY_PREFIX=$prefix"
  -e "SECKILL__API__LISTEN=127.0.0.1:$api_port" -e "SECKILL__API__METRICS_LISTEN=127.0.0.1:$ops_port"
  -e "SECKILL__CONSUMER__METRICS_LISTEN=127.0.0.1:$consume_port"
)
once() { podman_ run --rm --network host "${vars[@]}" "$IMAGE" "$@"; }

cleanup() {
  podman_ rm -f "seckill-api-$id" "seckill-consume-$id" >/dev/null 2>&1 || true
  once topics delete --confirm "$env_name" >/dev/null 2>&1 || true
  psql -h 127.0.0.1 -U postgres -qc "DROP SCHEMA IF EXISTS \"$schema\" CASCADE" >/dev/null 2>&1 || true
  redis-cli -h 127.0.0.1 --scan --pattern "$prefix:*" | xargs -r redis-cli -h 127.0.0.1 del >/dev/null || true
}
trap cleanup EXIT

log "$IMAGE: migrate, topics, an activity"
once migrate >/dev/null
once topics create >/dev/null
once activity create --activity-id 1 --name "image test" --sku 1:10:9900 --duration-secs 600 >/dev/null
for role in api consume; do
  podman_ run -d --name "seckill-$role-$id" --network host "${vars[@]}" "$IMAGE" "$role" >/dev/null
done
for port in "$api_port" "$consume_port"; do
  for _ in $(seq 1 150); do
    curl -fsS "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break
    sleep 0.2
  done
  curl -fsS "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 ||
    { podman_ logs --tail 20 "seckill-api-$id" || true; fail "a role of the image is not ready on :$port"; }
done
for role in api consume; do
  uid="$(podman_ exec "seckill-$role-$id" id -u)"
  [[ "$uid" == 10001 ]] || fail "$role runs as uid $uid, not the image's user 10001"
done

token="$(once token mint --user 7)"
answer="$(curl -fsS -X POST "http://127.0.0.1:$api_port/v1/activities/1/skus/1/reservations" \
  -H "authorization: Bearer $token" -H 'content-type: application/json' \
  -d '{"request_id": "image-test", "quantity": 1}')" || fail "the reservation was not accepted"
rid="$(python3 -c 'import json,sys; print(json.load(sys.stdin)["reservation_id"])' <<<"$answer")"
log "reserved $rid"
status=""
for _ in $(seq 1 150); do
  status="$(curl -fsS "http://127.0.0.1:$api_port/v1/reservations/$rid" -H "authorization: Bearer $token" |
    python3 -c 'import json,sys; print(json.load(sys.stdin).get("status", ""))' 2>/dev/null || true)"
  [[ "$status" == CREATED ]] && break
  sleep 0.2
done
orders="$(psql -h 127.0.0.1 -U postgres -Atc "SELECT count(*) FROM \"$schema\".orders WHERE reservation_id = '$rid'")"
[[ "$status" == CREATED && "$orders" == 1 ]] || fail "reservation $rid: status '$status', $orders order(s)"
echo "IMAGE_TEST OK image=$IMAGE reservation=$rid order_status=$status orders=$orders uid=10001"
