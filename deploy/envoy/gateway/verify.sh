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
# shellcheck source=../verify-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../verify-lib.sh"

SESSION="verify-$$-${RANDOM}"
TURNS=4

check_live
check_healthy gateway "/health checks"

before="$(requests_per_replica gateway)"
for _ in $(seq "${TURNS}"); do
  curl -sf -H "X-Session-ID: ${SESSION}" "http://${ENVOY}/v1/models" >/dev/null \
    || fail "GET /v1/models through Envoy failed"
done
moved="$(replicas_moved "${before}" "$(requests_per_replica gateway)")"
[[ "$(wc -l <<<"${moved}")" == 1 && "${moved}" == *" ${TURNS}" ]] \
  || fail "session ${SESSION} was spread over replicas: ${moved:-none}"
ok "all ${TURNS} requests of session ${SESSION} went to ${moved% *}"

pick_model
body="{\"model\":\"${MODEL}\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":\"Say hello.\"}]}"
answer="$(curl -sf -H 'content-type: application/json' -H "X-Session-ID: ${SESSION}" -d "${body}" \
  "http://${ENVOY}/v1/chat/completions")" || fail "chat turn through Envoy failed"
grep -q '"choices"' <<<"${answer}" || fail "chat turn answered without choices: ${answer}"
ok "chat turn answered by ${MODEL}"

echo "gateway scenario verified"
