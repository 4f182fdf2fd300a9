#!/usr/bin/env bash
# Check a running "gateway-shared" scenario: Envoy is live, enough gateway replicas pass their /health
# checks, requests are spread over the replicas, and the turns of one conversation (no session
# header) keep counting up whichever replica answers them: the replicas share its session.
#
#   ENVOY=127.0.0.1:10000 ADMIN=127.0.0.1:9901 deploy/envoy/gateway-shared/verify.sh
#
# ENVOY        the listener, host:port             (default 127.0.0.1:10000)
# ADMIN        Envoy's admin interface, host:port  (default 127.0.0.1:9901)
# MIN_HEALTHY  replicas that must be healthy       (default 2)
# MODEL        model for the chat turns            (default: the first one /v1/models lists)
set -euo pipefail

ENVOY="${ENVOY:-127.0.0.1:10000}"
ADMIN="${ADMIN:-127.0.0.1:9901}"
MIN_HEALTHY="${MIN_HEALTHY:-2}"
TURNS=3

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

MODEL="${MODEL:-$(curl -sf "http://${ENVOY}/v1/models" | grep -o '"id": *"[^"]*"' | head -1 | sed 's/.*"\([^"]*\)"$/\1/')}"
[[ -n "${MODEL}" ]] || fail "no model listed by /v1/models"

before="$(requests_per_replica)"
# The conversation so far as a JSON array (python3 keeps the answers' text exact: the session key is
# the hash of the messages).
messages="[{\"role\": \"user\", \"content\": \"verify $$ ${RANDOM}: say hello.\"}]"
session=""
for turn in $(seq "${TURNS}"); do
  body="{\"model\": \"${MODEL}\", \"max_tokens\": 8, \"messages\": ${messages}}"
  response="$(curl -sf -D "${TMPDIR:-/tmp}/verify-headers.$$" -H 'content-type: application/json' -d "${body}" \
    "http://${ENVOY}/v1/chat/completions")" || fail "turn ${turn} through Envoy failed"
  headers="$(tr -d '\r' < "${TMPDIR:-/tmp}/verify-headers.$$")"
  rm -f "${TMPDIR:-/tmp}/verify-headers.$$"
  got_turn="$(grep -i '^x-ppd-turn:' <<<"${headers}" | awk '{ print $2 }')"
  got_session="$(grep -i '^x-ppd-session-id:' <<<"${headers}" | awk '{ print $2 }')"
  [[ "${got_turn}" == "${turn}" ]] \
    || fail "turn ${turn} was answered as turn ${got_turn:-?}: the replicas do not share the session"
  [[ -z "${session}" || "${got_session}" == "${session}" ]] \
    || fail "turn ${turn} got session ${got_session}, not ${session}"
  session="${got_session}"
  messages="$(python3 -c 'import json, sys
history, answer = json.loads(sys.argv[1]), json.loads(sys.argv[2])
history += [answer["choices"][0]["message"], {"role": "user", "content": "and then?"}]
print(json.dumps([{"role": m["role"], "content": m["content"]} for m in history]))' "${messages}" "${response}")"
done
after="$(requests_per_replica)"
spread="$(join <(echo "${before}") <(echo "${after}") | awk '$3 != $2' | wc -l)"
(( spread >= 2 )) || fail "the ${TURNS} turns all went to one replica: Envoy is not spreading requests"
ok "${TURNS} turns of conversation ${session} over ${spread} replicas, each one knew the session"

echo "gateway-shared scenario verified"
