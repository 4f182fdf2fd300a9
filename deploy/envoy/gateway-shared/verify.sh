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
# shellcheck source=../verify-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../verify-lib.sh"

TURNS=3

check_live
check_healthy gateway "/health checks"

pick_model

before="$(requests_per_replica gateway)"
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
spread="$(replicas_moved "${before}" "$(requests_per_replica gateway)" | wc -l)"
(( spread >= 2 )) || fail "the ${TURNS} turns all went to one replica: Envoy is not spreading requests"
ok "${TURNS} turns of conversation ${session} over ${spread} replicas, each one knew the session"

echo "gateway-shared scenario verified"
