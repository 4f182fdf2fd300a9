#!/usr/bin/env bash
# Check a running "decision" scenario: Envoy is live, enough replicas pass their gRPC health
# checks, and Route answers both over gRPC (grpcurl) and as JSON over plain HTTP (curl).
#
#   ENVOY=127.0.0.1:10000 ADMIN=127.0.0.1:9901 deploy/envoy/decision/verify.sh
#
# ENVOY        the listener, host:port             (default 127.0.0.1:10000)
# ADMIN        Envoy's admin interface, host:port  (default 127.0.0.1:9901)
# MIN_HEALTHY  replicas that must be healthy       (default 2)
# GRPCURL      the grpcurl binary                  (default: grpcurl on PATH)
set -euo pipefail

ENVOY="${ENVOY:-127.0.0.1:10000}"
ADMIN="${ADMIN:-127.0.0.1:9901}"
MIN_HEALTHY="${MIN_HEALTHY:-2}"
GRPCURL="${GRPCURL:-grpcurl}"
SERVICE=ppd.decision.v1.DecisionService
QUERY='{"request_id":"verify","turn":2,"new_input_tokens":256,"expected_output_tokens":64,"context_tokens":1024,"qps":2}'

fail() { echo "FAIL: $*" >&2; exit 1; }
ok() { echo "ok: $*"; }

ready="$(curl -sf "http://${ADMIN}/ready")" || fail "Envoy admin at ${ADMIN} does not answer"
[[ "${ready}" == "LIVE" ]] || fail "Envoy is not live: ${ready}"
ok "Envoy is live"

# Hosts whose health_flags line is exactly 'healthy' (no failed_active_hc, no outlier ejection).
healthy="$(curl -sf "http://${ADMIN}/clusters" | grep -c '^decision::.*::health_flags::healthy$' || true)"
(( healthy >= MIN_HEALTHY )) || fail "${healthy} healthy decision replicas, want at least ${MIN_HEALTHY}"
ok "${healthy} decision replicas pass grpc.health.v1 checks"

grpc="$("${GRPCURL}" -plaintext -d "${QUERY}" "${ENVOY}" "${SERVICE}/Route")" \
  || fail "gRPC Route through Envoy failed"
grep -q '"decision": "DECISION_' <<<"${grpc}" || fail "gRPC Route answered without a decision: ${grpc}"
ok "gRPC Route: $(tr -d '\n ' <<<"${grpc}" | cut -c1-120)"

json="$(curl -sf -X POST -H 'content-type: application/json' -d "${QUERY}" \
  "http://${ENVOY}/${SERVICE}/Route")" || fail "JSON Route through Envoy failed"
grep -q '"decision":"DECISION_' <<<"${json}" || fail "JSON Route answered without a decision: ${json}"
ok "JSON Route: $(cut -c1-120 <<<"${json}")"

echo "decision scenario verified"
