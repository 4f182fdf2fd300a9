"""The `worker` and `cluster` sub-commands of `ppd-sim` (registered in :mod:`simulator.tools.cli`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping

import uvloop

from ppd.kv_events import parse_kv_events_config
from simulator.core.api_error import ApiError
from simulator.core.faults import Faults
from simulator.core.kv_load_policy import KV_LOAD_FAILURE_POLICIES, parse_policy_spec, parse_worker_ids
from simulator.core.link import TransferMode
from simulator.core.profile import ProfileError, load_profile
from simulator.core.sampler import SamplerSettings
from simulator.core.topology import Role, Topology, TopologyError, WorkerSpec
from simulator.core.worker_settings import DEFAULT_MODEL, WorkerSettings
from simulator.server.fabric import FabricSettings
from simulator.server.realtime import DEFAULT_SPIN_S
from simulator.server.worker_group import GroupSettings, WorkerGroup, serve_group

__all__ = ["add_cluster", "add_worker", "server_dev_mode"]


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--served-model-name", default=DEFAULT_MODEL, help=f"model id (default {DEFAULT_MODEL})")
    g.add_argument("--max-model-len", type=int, default=131072, help="context window in tokens")
    g.add_argument("--profile", default="llama-3.1-8b-h100", help="cost-model profile name or JSON path")
    g.add_argument(
        "--kv-lease-duration",
        type=float,
        default=30.0,
        help="seconds a prefill worker pins blocks for the decode worker (vLLM kv_lease_duration)",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens, as the vLLM flag does",
    )
    g.add_argument(
        "--mean-natural-tokens",
        type=int,
        default=0,
        help="mean answer length before the model emits EOS (geometric); 0 = runs to max_tokens",
    )
    g.add_argument(
        "--max-body-bytes", type=int, default=32 * 1024 * 1024, help="largest accepted request body"
    )
    g.add_argument(
        "--otlp-traces-endpoint",
        default="",
        metavar="URL",
        help="as vLLM's flag: export an llm_request span per request over OTLP/gRPC (http://host:4317), "
        "the child of the request's traceparent header; default off",
    )
    g.add_argument(
        "--spin-us",
        type=float,
        default=DEFAULT_SPIN_S * 1e6,
        help="busy-wait this long before each step deadline for sub-millisecond timing; it must cover the "
        "event loop's ~1.5 ms timer error (0 = sleep only: least CPU, ms timing)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV block size in tokens (default: the profile's, 16; real vLLM on CPU uses 32)",
    )
    g.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=None,
        help="KV cache size in tokens (default: the profile's); a small one makes the prefix cache evict "
        "(like vLLM's --num-gpu-blocks-override)",
    )
    g.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish KV cache events as vLLM does (its KVEventsConfig JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:0"}\'); in a cluster, worker i binds '
        "the endpoint's port + i (0 = a free port each); the ready line shows each worker's endpoint",
    )
    k = p.add_argument_group("KV transfer")
    k.add_argument(
        "--link", default="nvlink", help="link preset of the profile: nvlink, ib_ndr, ib_hdr, 100gbe"
    )
    k.add_argument(
        "--transfer-mode",
        choices=[m.value for m in TransferMode],
        default=TransferMode.SHARED_LINK.value,
        help="shared_link (processor sharing per node pair), async, or blocking_on_decode (the paper's)",
    )
    k.add_argument(
        "--bidirectional-kv-xfer",
        action="store_true",
        help="vLLM's bidirectional_kv_xfer (set it on P and D): a decode leg returns its blocks' "
        "kv_transfer_params and keeps them; the next turn's prefill leg pulls them",
    )
    k.add_argument(
        "--decoder-kv-blocks-ttl",
        type=float,
        default=480.0,
        help="seconds a decode worker keeps a finished request's blocks in bidirectional mode "
        "(vLLM decoder_kv_blocks_ttl, default 480)",
    )
    k.add_argument(
        "--kv-recompute-threshold",
        type=int,
        default=64,
        help="a bidirectional pull of fewer tokens is recomputed instead (vLLM kv_recompute_threshold, "
        "default 64; 0 = always pull)",
    )
    f = p.add_argument_group("fault injection (also at run time: POST <url>/admin/faults)")
    f.add_argument("--error-rate", type=float, default=0.0, help="share of generation requests answered 500")
    f.add_argument("--added-latency-ms", type=float, default=0.0, help="delay before model routes answer")
    f.add_argument("--down-after-requests", type=int, default=None, help="close the port after N requests")
    f.add_argument("--refuse-connections", action="store_true", help="reset every connection")
    f.add_argument("--lease-expiry-s", type=float, default=None, help="pinned KV blocks expire this early")
    f.add_argument("--fault-seed", type=int, default=0, help="seed of the error-rate dice")


def _worker_settings(args: argparse.Namespace, worker_id: str, role: Role) -> WorkerSettings:
    faults = Faults(
        error_rate=args.error_rate,
        added_latency_ms=args.added_latency_ms,
        down_after_requests=args.down_after_requests,
        refuse_connections=args.refuse_connections,
        lease_expiry_s=args.lease_expiry_s,
    )
    return WorkerSettings(
        worker_id=worker_id,
        role=role,
        model=args.served_model_name,
        max_model_len=args.max_model_len,
        host=args.host,
        kv_lease_duration_s=args.kv_lease_duration,
        bidirectional_kv_xfer=args.bidirectional_kv_xfer,
        decoder_kv_blocks_ttl_s=args.decoder_kv_blocks_ttl,
        kv_recompute_threshold=args.kv_recompute_threshold,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        max_body_bytes=args.max_body_bytes,
        sampler=SamplerSettings(mean_natural_tokens=args.mean_natural_tokens),
        faults=faults,
        fault_seed=args.fault_seed,
        block_size=args.block_size,
        kv_capacity_tokens=args.kv_capacity_tokens,
        kv_events=parse_kv_events_config(args.kv_events_config) if args.kv_events_config else None,
        server_dev_mode=server_dev_mode(os.environ),
    )


def server_dev_mode(environ: Mapping[str, str]) -> bool:
    """vLLM's reading of ``VLLM_SERVER_DEV_MODE`` (``bool(int(value))``, unset = off); a value that is
    not an integer is refused (vLLM fails to start on it too)."""
    raw = environ.get("VLLM_SERVER_DEV_MODE", "0").strip() or "0"
    try:
        return bool(int(raw))
    except ValueError:
        raise ValueError(f"VLLM_SERVER_DEV_MODE must be an integer (0 or 1), got {raw!r}") from None


def _run(args: argparse.Namespace, topology: Topology, base_port: int, *, single: bool) -> int:
    try:
        profile = load_profile(args.profile)
        fabric = FabricSettings(link=args.link, mode=TransferMode(args.transfer_mode))
        profile.link(args.link)
        worker = _worker_settings(args, topology.workers[0].id, topology.workers[0].role)
        worker_faults: dict[str, Faults] = {}
        for item in getattr(args, "worker_faults", None) or []:
            worker_id, _, raw = item.partition("=")
            worker_faults[worker_id] = worker.faults.updated(json.loads(raw))
        policies = parse_policy_spec(args.kv_load_failure_policy, [w.id for w in topology.workers])
        bidir = parse_worker_ids(getattr(args, "bidir_workers", ""), [w.id for w in topology.workers])
        nodes: dict[str, str] = {}
        for item in getattr(args, "node", None) or []:
            worker_id, _, node = item.partition("=")
            if not node:
                raise ValueError(f"--node {item!r}: expected ID=NODE")
            nodes[worker_id] = node
    except (ProfileError, ValueError, ApiError) as exc:
        print(f"ppd-sim: {exc}", file=sys.stderr)
        return 2
    settings = GroupSettings(
        topology=topology,
        base_port=base_port,
        worker=worker,
        fabric=fabric,
        worker_faults=worker_faults,
        nodes=nodes,
        kv_load_failure_policies=policies,
        bidir_workers=bidir,
        spin_s=args.spin_us / 1e6,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )

    async def main() -> int:
        return await serve_group(WorkerGroup(settings, profile), sys.stdout, single=single)

    try:
        return uvloop.run(main())
    except OSError as exc:  # the port is taken, the address is not ours, ...
        print(f"ppd-sim: cannot serve: {exc}", file=sys.stderr)
        return 1


def add_worker(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "worker",
        help="one simulated vLLM worker (prefill, decode or replica) on one port",
        description="Serve vLLM 0.33's HTTP API and the NixlConnector P/D protocol in real time. Prints "
        '{"id", "role", "url"} as one JSON line once healthy; stops on SIGINT/SIGTERM.',
    )
    p.add_argument("--role", choices=["prefill", "decode", "replica"], default="replica", help="P/D role")
    p.add_argument("--port", type=int, default=8000, help="port (0 = a free one, printed)")
    p.add_argument("--id", default=None, help="worker id (default P0, D0 or R0 by role)")
    p.add_argument(
        "--kv-load-failure-policy",
        choices=KV_LOAD_FAILURE_POLICIES,
        default="fail",
        help="what a failed KV load does (vLLM kv_load_failure_policy): fail = HTTP 500 (default), "
        "recompute = compute the prompt locally",
    )
    _common(p)

    def run(args: argparse.Namespace) -> int:
        letter = {"prefill": "P", "decode": "D", "replica": "R"}[args.role]
        worker_id = args.id or f"{letter}0"
        topology = Topology(name=f"1{letter}", workers=(WorkerSpec(id=worker_id, role=args.role),))
        return _run(args, topology, args.port, single=True)

    p.set_defaults(func=run)


def add_cluster(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "cluster",
        help="a whole simulated P/D cluster in one process (workers share the KV links)",
        description="Start every worker of a topology (1P3D, 2P2D, 3P1D, 4R, ...) on its own port and print "
        '{"topology", "workers": [{"id", "role", "url"}]} as one JSON line once all answer /health.',
    )
    p.add_argument("--topology", default="1P3D", help="groups of <count><P|D|R>, e.g. 1P3D or 4R")
    p.add_argument(
        "--base-port", type=int, default=8100, help="first port; workers take consecutive ones (0 = free)"
    )
    p.add_argument(
        "--node",
        action="append",
        metavar="ID=NODE",
        help="place a worker on a named node (repeatable); workers on one node pair share one KV link. "
        "Default: every worker is its own node",
    )
    p.add_argument(
        "--worker-faults",
        action="append",
        metavar="ID=JSON",
        help="faults of one worker at start, e.g. D1='{\"error_rate\": 0.5}' (repeatable)",
    )
    p.add_argument(
        "--kv-load-failure-policy",
        default="fail",
        metavar="SPEC",
        help="what a failed KV load does (vLLM kv_load_failure_policy): fail (default) or recompute for "
        "every worker, or ID=POLICY[,ID=POLICY...] for chosen ones (the others fail), e.g. D1=recompute",
    )
    p.add_argument(
        "--bidir-workers",
        default="",
        metavar="IDS",
        help="comma list of workers that run vLLM's bidirectional_kv_xfer, e.g. P0,D1, or all (default none; "
        "--bidirectional-kv-xfer turns it on for all)",
    )
    _common(p)

    def run(args: argparse.Namespace) -> int:
        try:
            topology = Topology.parse(args.topology)
        except TopologyError as exc:
            print(f"ppd-sim: {exc}", file=sys.stderr)
            return 2
        return _run(args, topology, args.base_port, single=False)

    p.set_defaults(func=run)
