#!/usr/bin/env bash
# Launch ONE real vLLM worker for P/D disaggregation with the NixlConnector (pull mode), as
# docs/vllm-protocol.md section 1.1 describes: prefill workers are kv_producer, decode workers
# kv_consumer, each with its own HTTP port and NIXL side-channel port.
#
#   deploy/vllm/serve-worker.sh prefill 0        # P0: GPU 0, http 8100, side channel 5600
#   deploy/vllm/serve-worker.sh decode 2 --gpu 3 # D2: GPU 3, http 8202, side channel 5605
#
# Port plan (index i on one node): prefill http 8100+i, side channel 5600+2i;
#                                   decode  http 8200+i, side channel 5601+2i.
# Options:
#   --gpu N             CUDA device (default: the index)
#   --model ID          model to serve (default $MODEL, else meta-llama/Llama-3.1-8B-Instruct)
#   --advertise-host H  address decode workers use to reach this worker's side channel
#                       (VLLM_NIXL_SIDE_CHANNEL_HOST; default $ADVERTISE_HOST, else this host's
#                       first address; must be reachable from the other nodes)
#   --dry-run           print the environment and command instead of running it
#   -- ARGS             extra arguments for vllm serve (e.g. --max-model-len 16384)
set -euo pipefail

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; }

[[ $# -ge 2 ]] || { usage >&2; exit 2; }
ROLE="$1"
INDEX="$2"
shift 2
[[ "${INDEX}" =~ ^[0-9]+$ ]] || { echo "index must be a number, got '${INDEX}'" >&2; exit 2; }

GPU="${INDEX}"
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
ADVERTISE_HOST="${ADVERTISE_HOST:-}"
DRY_RUN=0
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --gpu) GPU="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    --advertise-host) ADVERTISE_HOST="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

case "${ROLE}" in
  prefill) KV_ROLE=kv_producer; HTTP_PORT=$((8100 + INDEX)); SIDE_PORT=$((5600 + 2 * INDEX)) ;;
  decode)  KV_ROLE=kv_consumer; HTTP_PORT=$((8200 + INDEX)); SIDE_PORT=$((5601 + 2 * INDEX)) ;;
  *) echo "role must be prefill or decode, got '${ROLE}'" >&2; exit 2 ;;
esac

if [[ -z "${ADVERTISE_HOST}" ]]; then
  ADVERTISE_HOST="$(hostname -I 2>/dev/null | awk '{print $1}')"
  ADVERTISE_HOST="${ADVERTISE_HOST:-127.0.0.1}"
fi

KV_CONFIG="{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"${KV_ROLE}\",\"kv_load_failure_policy\":\"fail\"}"
ENV=(
  "CUDA_VISIBLE_DEVICES=${GPU}"
  "VLLM_NIXL_SIDE_CHANNEL_HOST=${ADVERTISE_HOST}"
  "VLLM_NIXL_SIDE_CHANNEL_PORT=${SIDE_PORT}"
)
CMD=(vllm serve "${MODEL}" --port "${HTTP_PORT}" --kv-transfer-config "${KV_CONFIG}" "${EXTRA[@]}")

if [[ "${DRY_RUN}" == 1 ]]; then
  printf '%s\n' "${ENV[@]}"
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi
exec env "${ENV[@]}" "${CMD[@]}"
