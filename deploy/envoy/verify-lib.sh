# What every scenario's verify.sh checks the same way; each sources this file first:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/../verify-lib.sh"
#
# ENVOY        the listener, host:port             (default 127.0.0.1:10000)
# ADMIN        Envoy's admin interface, host:port  (default 127.0.0.1:9901)
# MIN_HEALTHY  replicas that must be healthy       (default 2)
set -euo pipefail

ENVOY="${ENVOY:-127.0.0.1:10000}"
ADMIN="${ADMIN:-127.0.0.1:9901}"
MIN_HEALTHY="${MIN_HEALTHY:-2}"

fail() { echo "FAIL: $*" >&2; exit 1; }
ok() { echo "ok: $*"; }

# Envoy's admin answers /ready with LIVE.
check_live() {
  local ready
  ready="$(curl -sf "http://${ADMIN}/ready")" || fail "Envoy admin at ${ADMIN} does not answer"
  [[ "${ready}" == "LIVE" ]] || fail "Envoy is not live: ${ready}"
  ok "Envoy is live"
}

# check_healthy CLUSTER CHECKS: at least MIN_HEALTHY hosts of CLUSTER whose health_flags line is exactly
# 'healthy' (no failed_active_hc, no outlier ejection); CHECKS names the health check in the message.
check_healthy() {
  local healthy
  healthy="$(curl -sf "http://${ADMIN}/clusters" | grep -c "^$1::.*::health_flags::healthy\$" || true)"
  (( healthy >= MIN_HEALTHY )) || fail "${healthy} healthy $1 replicas, want at least ${MIN_HEALTHY}"
  ok "${healthy} $1 replicas pass $2"
}

# requests_per_replica CLUSTER: "host:port count" for each host, the requests Envoy has sent it so far.
requests_per_replica() {
  curl -sf "http://${ADMIN}/clusters" | awk -F'::' -v cluster="$1" '$1 == cluster && $3 == "rq_total" { print $2, $4 }' | sort
}

# replicas_moved BEFORE AFTER: "host:port delta" for each host whose count moved between two snapshots.
replicas_moved() {
  join <(echo "$1") <(echo "$2") | awk '$3 != $2 { print $1, $3 - $2 }'
}

# MODEL, unless set: the first model /v1/models lists through Envoy.
pick_model() {
  MODEL="${MODEL:-$(curl -sf "http://${ENVOY}/v1/models" | grep -o '"id": *"[^"]*"' | head -1 | sed 's/.*"\([^"]*\)"$/\1/')}"
  [[ -n "${MODEL}" ]] || fail "no model listed by /v1/models"
}
