#!/usr/bin/env bash
# Check a running "picker" scenario: Envoy is live, the picker passes Envoy's gRPC health check, a
# chat turn is routed by the picker (provenance headers on the answer), a client's own destination
# header is ignored, and a malformed body gets the gateway's OpenAI-style 400.
#
#   ENVOY=127.0.0.1:10000 ADMIN=127.0.0.1:9901 deploy/envoy/picker/verify.sh
#
# ENVOY        the listener, host:port             (default 127.0.0.1:10000)
# ADMIN        Envoy's admin interface, host:port  (default 127.0.0.1:9901)
# MIN_HEALTHY  pickers that must be healthy        (default 1)
# MODEL        model for the chat turn             (default: the first one /v1/models lists)
set -euo pipefail
MIN_HEALTHY="${MIN_HEALTHY:-1}"
# shellcheck source=../verify-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../verify-lib.sh"

check_live
check_healthy picker "gRPC health checks (envoy.service.ext_proc.v3.ExternalProcessor)"

pick_model
body="{\"model\":\"${MODEL}\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":\"Say hello.\"}]}"
headers="$(mktemp)"
trap 'rm -f "${headers}"' EXIT
answer="$(curl -sf -D "${headers}" -H 'content-type: application/json' \
  -H 'x-gateway-destination-endpoint: 127.0.0.1:1' -d "${body}" \
  "http://${ENVOY}/v1/chat/completions")" || fail "chat turn through Envoy failed"
grep -q '"choices"' <<<"${answer}" || fail "chat turn answered without choices: ${answer}"
grep -qi '^x-ppd-path: ' "${headers}" || fail "the answer has no X-PPD-Path header (not routed by the picker?)"
ok "chat turn routed by the picker ($(grep -i '^x-ppd-path: ' "${headers}" | tr -d '\r')), client's destination header ignored"

status="$(curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' -d '{"model":' \
  "http://${ENVOY}/v1/chat/completions")"
[[ "${status}" == 400 ]] || fail "a malformed body got ${status}, want 400"
ok "a malformed body gets 400 from the picker"

echo "picker scenario verified"
