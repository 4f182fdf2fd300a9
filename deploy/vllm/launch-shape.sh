#!/usr/bin/env bash
# Launch every vLLM worker of a deployment shape (1P3D, 2P2D or 3P1D), one GPU per worker,
# and print the gateway's worker list for it.
#
#   deploy/vllm/launch-shape.sh 1P3D                       # all 4 workers on this node (GPUs 0-3)
#   deploy/vllm/launch-shape.sh 2P2D --only prefill        # node A: P0, P1 on GPUs 0-1
#   deploy/vllm/launch-shape.sh 2P2D --only decode --host 10.0.0.7   # node B: D0, D1 on GPUs 0-1
#   deploy/vllm/launch-shape.sh 3P1D --print-workers       # only print the gateway TOML
#
# Options:
#   --only prefill|decode  start only that role here (several nodes: one role per node)
#   --host H               this node's address, advertised for NIXL and used in the worker list
#                          (default: this host's first address)
#   --prefill-host H       where the prefill workers run, for --print-workers (default --host)
#   --decode-host H        where the decode workers run, for --print-workers (default --host)
#   --print-workers        print the [[workers]] TOML for the gateway config and exit
#   --dry-run              print each worker's command instead of starting it
#   --logs DIR             worker logs (default ./vllm-logs)
# Everything after -- goes to every vllm serve.
# Workers run in the background; the script waits for all of them and stops them all on Ctrl-C.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; }

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
SHAPE="$1"
shift
[[ "${SHAPE}" =~ ^([0-9]+)P([0-9]+)D$ ]] || { echo "shape must look like 1P3D, got '${SHAPE}'" >&2; exit 2; }
N_PREFILL="${BASH_REMATCH[1]}"
N_DECODE="${BASH_REMATCH[2]}"

ONLY=""
HOST=""
PREFILL_HOST=""
DECODE_HOST=""
PRINT_WORKERS=0
DRY_RUN=()
LOGS=./vllm-logs
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only) ONLY="$2"; shift 2 ;;
    --host) HOST="$2"; shift 2 ;;
    --prefill-host) PREFILL_HOST="$2"; shift 2 ;;
    --decode-host) DECODE_HOST="$2"; shift 2 ;;
    --print-workers) PRINT_WORKERS=1; shift ;;
    --dry-run) DRY_RUN=(--dry-run); shift ;;
    --logs) LOGS="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[[ -z "${ONLY}" || "${ONLY}" == prefill || "${ONLY}" == decode ]] \
  || { echo "--only takes prefill or decode, got '${ONLY}'" >&2; exit 2; }

if [[ -z "${HOST}" ]]; then
  HOST="$(hostname -I 2>/dev/null | awk '{print $1}')"
  HOST="${HOST:-127.0.0.1}"
fi
PREFILL_HOST="${PREFILL_HOST:-${HOST}}"
DECODE_HOST="${DECODE_HOST:-${HOST}}"

if [[ "${PRINT_WORKERS}" == 1 ]]; then
  for ((i = 0; i < N_PREFILL; i++)); do
    printf '[[workers]]\nrole = "prefill"\nurl = "http://%s:%d"\n\n' "${PREFILL_HOST}" $((8100 + i))
  done
  for ((i = 0; i < N_DECODE; i++)); do
    printf '[[workers]]\nrole = "decode"\nurl = "http://%s:%d"\n\n' "${DECODE_HOST}" $((8200 + i))
  done
  exit 0
fi

# GPUs are numbered per node: on one node prefill takes the first ones, decode the next.
workers=()
gpu=0
if [[ -z "${ONLY}" || "${ONLY}" == prefill ]]; then
  for ((i = 0; i < N_PREFILL; i++)); do workers+=("prefill ${i} ${gpu}"); gpu=$((gpu + 1)); done
fi
if [[ -z "${ONLY}" || "${ONLY}" == decode ]]; then
  for ((i = 0; i < N_DECODE; i++)); do workers+=("decode ${i} ${gpu}"); gpu=$((gpu + 1)); done
fi

pids=()
stop_all() { [[ ${#pids[@]} -gt 0 ]] && kill "${pids[@]}" 2>/dev/null; wait; }
trap stop_all INT TERM

[[ ${#DRY_RUN[@]} -gt 0 ]] || mkdir -p "${LOGS}"
for worker in "${workers[@]}"; do
  read -r role index gpu <<<"${worker}"
  args=("${role}" "${index}" --gpu "${gpu}" --advertise-host "${HOST}" "${DRY_RUN[@]}" -- "${EXTRA[@]}")
  if [[ ${#DRY_RUN[@]} -gt 0 ]]; then
    echo "# ${role} ${index} on GPU ${gpu}"
    "${HERE}/serve-worker.sh" "${args[@]}"
  else
    "${HERE}/serve-worker.sh" "${args[@]}" >"${LOGS}/${role}-${index}.log" 2>&1 &
    pids+=($!)
    echo "started ${role} ${index} on GPU ${gpu} (pid $!, log ${LOGS}/${role}-${index}.log)"
  fi
done
[[ ${#DRY_RUN[@]} -gt 0 ]] || wait
