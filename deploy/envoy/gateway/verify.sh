#!/usr/bin/env bash
# Check a running "gateway" scenario: Envoy is live, enough gateway replicas pass their /health
# checks, every request of one session lands on the same replica, and a chat turn succeeds.
#
#   ENVOY=127.0.0.1:10000 ADMIN=127.0.0.1:9901 deploy/envoy/gateway/verify.sh
#
# ENVOY        the listener, host:port             (default 127.0.0.1:10000)
# ADMIN        Envoy's admin interface, host:port  (default 127.0.0.1:9901)
# MIN_HEALTHY  replicas that must be healthy       (default 2)
# MODEL        model for the chat turn             (default: the first one /v1/models lists)
set -euo pipefail

ENVOY="${ENVOY:-127.0.0.1:10000}"
ADMIN="${ADMIN:-127.0.0.1:9901}"
MIN_HEALTHY="${MIN_HEALTHY:-2}"
SESSION="verify-$$-${RANDOM}"
TURNS=4

fail() { echo "FAIL: $*" >&2; exit 1; }
ok() { echo "ok: $*"; }

# "host:port count" for every gateway replica: requests Envoy has sent it so far.
requests_per_replica() {
  curl -sf "http://${ADMIN}/clusters" | awk -F'::' '$1 == "gateway" && $3 == "rq_total" { print $2, $4 }' | sort
}

ready="$(curl -sf "http://${ADMIN}/ready")" || fail "Envoy admin at ${ADMIN} does not answer"
[[ "${ready}" == "LIVE" ]] || fail "Envoy is not live: ${ready}"
ok "Envoy is live"

healthy="$(curl -sf "http://${ADMIN}/clusters" | grep -c '^gateway::.*::health_flags::healthy$' || true)"
(( healthy >= MIN_HEALTHY )) || fail "${healthy} healthy gateway replicas, want at least ${MIN_HEALTHY}"
ok "${healthy} gateway replicas pass /health checks"

before="$(requests_per_replica)"
for _ in $(seq "${TURNS}"); do
  curl -sf -H "X-Session-ID: ${SESSION}" "http://${ENVOY}/v1/models" >/dev/null \
    || fail "GET /v1/models through Envoy failed"
done
after="$(requests_per_replica)"
moved="$(join <(echo "${before}") <(echo "${after}") | awk '$3 != $2 { print $1, $3 - $2 }')"
[[ "$(wc -l <<<"${moved}")" == 1 && "${moved}" == *" ${TURNS}" ]] \
  || fail "session ${SESSION} was spread over replicas: ${moved:-none}"
ok "all ${TURNS} requests of session ${SESSION} went to ${moved% *}"

MODEL="${MODEL:-$(curl -sf "http://${ENVOY}/v1/models" | grep -o '"id": *"[^"]*"' | head -1 | sed 's/.*"\([^"]*\)"$/\1/')}"
[[ -n "${MODEL}" ]] || fail "no model listed by /v1/models"
body="{\"model\":\"${MODEL}\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":\"Say hello.\"}]}"
answer="$(curl -sf -H 'content-type: application/json' -H "X-Session-ID: ${SESSION}" -d "${body}" \
  "http://${ENVOY}/v1/chat/completions")" || fail "chat turn through Envoy failed"
grep -q '"choices"' <<<"${answer}" || fail "chat turn answered without choices: ${answer}"
ok "chat turn answered by ${MODEL}"

echo "gateway scenario verified"
