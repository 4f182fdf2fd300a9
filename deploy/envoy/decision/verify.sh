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
# shellcheck source=../verify-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../verify-lib.sh"

GRPCURL="${GRPCURL:-grpcurl}"
SERVICE=ppd.decision.v1.DecisionService
QUERY='{"request_id":"verify","turn":2,"new_input_tokens":256,"expected_output_tokens":64,"context_tokens":1024,"qps":2}'

check_live
check_healthy decision "grpc.health.v1 checks"

grpc="$("${GRPCURL}" -plaintext -d "${QUERY}" "${ENVOY}" "${SERVICE}/Route")" \
  || fail "gRPC Route through Envoy failed"
grep -q '"decision": "DECISION_' <<<"${grpc}" || fail "gRPC Route answered without a decision: ${grpc}"
ok "gRPC Route: $(tr -d '\n ' <<<"${grpc}" | cut -c1-120)"

json="$(curl -sf -X POST -H 'content-type: application/json' -d "${QUERY}" \
  "http://${ENVOY}/${SERVICE}/Route")" || fail "JSON Route through Envoy failed"
grep -q '"decision":"DECISION_' <<<"${json}" || fail "JSON Route answered without a decision: ${json}"
ok "JSON Route: $(cut -c1-120 <<<"${json}")"

echo "decision scenario verified"
