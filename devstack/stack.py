"""``ppd-up``: the whole system on this machine, as one supervised command.

Starts, in order, each through its command-line contract (one JSON ready line on stdout):
1. a cluster: simulated (``python -m simulator cluster --topology T --base-port 0``, the default), or
   real vLLM on this CPU with ``--engine vllm-cpu`` (``python -m vllm_harness cluster --topology T``);
2. the decision service with the shipped tables: ``python -m decision_service serve --tables DIR ...``;
3. the gateway on 127.0.0.1:8000 with a TOML config generated from the cluster's worker list;
   with ``--gateways N`` (N > 1): one ``redis-server`` on a unix socket, N gateway replicas sharing
   their sessions on it (``[sessions] redis_url``), and Envoy on 127.0.0.1:8000 in front of them,
   round robin (``deploy/envoy/gateway-shared``), once it sees every replica healthy;
   with ``--data-plane envoy``, not the gateway: ``ppd-gateway picker`` on the same config, as the
   ext_proc endpoint picker of Envoy on 127.0.0.1:8000, which carries the traffic and streams every
   answer (``deploy/envoy/picker``, data_plane.py), once it sees the picker healthy;
   ``--picker-failure-mode open`` lets Envoy send requests to a decode worker while the picker is down.

``--kv-events`` has every worker publish vLLM's KV cache events and the gateway follow them
(``[kv_events]``, endpoints from the cluster's ready line); ``--bidir`` runs every worker in vLLM's
bidirectional KV mode and lets the gateway serve the bidir path (``[routing] bidir``);
``--slo-ttft-p99-ms`` turns the gateway's SLO controller on (``[slo]``); ``--tracing-endpoint URL`` has
every child export OpenTelemetry traces to one OTLP/gRPC receiver (tracing.py).

Then prints one JSON line (the URLs, for scripts and tests) and a human banner (banner.py) with
copy-paste ``curl`` and ``openai`` examples, and runs until Ctrl-C/SIGTERM or until a child dies; either way
every child is stopped. A signal while children are still starting stops the ones started so far
at once (it does not wait for the next one to get ready). Exit code 0 after a signal, 1 when a child
failed (named, with its stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from devstack.banner import banner
from devstack.data_plane import add_data_plane_arguments, check_addressed_by_ip, start_picker_and_envoy
from devstack.gateway_config import add_slo_argument, gateway_config
from devstack.replicas import answers_ping, envoy_argv, poll, redis_argv, start_envoy
from devstack.settings import ENGINES, KV_BLOCK_TOKENS, StackSettings
from devstack.supervisor import Child, ChildError, ChildSpec, Supervisor
from devstack.tracing import (
    add_tracing_arguments,
    decision_tracing_argv,
    tracing_settings,
    worker_tracing_argv,
)

__all__ = ["StackCommands", "main", "parse_settings", "run_stack"]

logger = logging.getLogger("ppd-up")


_CLUSTER_NAMES = {"sim": "simulator cluster", "vllm-cpu": "vLLM (CPU) cluster"}
#: ``ppd-vllm cluster``'s own per-worker start-up limit (its --ready-timeout default).
_VLLM_WORKER_READY_S = 240.0
#: The simulator publishes its KV events on free ports (the ready line names them).
_SIM_KV_EVENTS = json.dumps(
    {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}
)


@dataclass(frozen=True, slots=True)
class StackCommands:
    """How each child is started; tests swap in tiny stand-ins with the same contracts."""

    cluster: Callable[[StackSettings], tuple[str, ...]]
    decision: Callable[[StackSettings], tuple[str, ...]]
    gateway: Callable[[StackSettings, Path], tuple[str, ...]]
    # With --gateways N > 1: redis-server on a unix socket path; Envoy on a rendered config and the
    # file it writes its admin address to.
    redis: Callable[[Path], tuple[str, ...]] = dataclasses.field(default=redis_argv)
    envoy: Callable[[Path, Path], tuple[str, ...]] = dataclasses.field(default=envoy_argv)
    # With --data-plane envoy: the endpoint picker on the generated gateway config.
    picker: Callable[[StackSettings, Path], tuple[str, ...]] = dataclasses.field(
        default=lambda s, config: _picker_argv(sys.executable, config)
    )

    @classmethod
    def real(cls, python: str = sys.executable) -> StackCommands:
        def cluster(s: StackSettings) -> tuple[str, ...]:
            # The same flags on both engines: every worker bidirectional, every block size explicit.
            options: tuple[str, ...] = ("--bidir-workers", "all") if s.bidir else ()
            if s.kv_events:
                options += ("--block-size", str(KV_BLOCK_TOKENS[s.engine]))
            if s.engine == "vllm-cpu":
                argv: tuple[str, ...] = (python, "-m", "vllm_harness", "cluster", "--topology", s.topology)
                # A --ready-timeout above the cluster's own per-worker default (240 s) reaches it too.
                if s.ready_timeout_s > _VLLM_WORKER_READY_S:
                    argv += ("--ready-timeout", f"{s.ready_timeout_s:g}")
                events: tuple[str, ...] = ("--kv-events",) if s.kv_events else ()
                return argv + options + events + worker_tracing_argv(s.tracing, s.engine)
            sim_events = ("--kv-events-config", _SIM_KV_EVENTS) if s.kv_events else ()
            return (
                python,
                "-m",
                "simulator",
                "cluster",
                "--topology",
                s.topology,
                "--base-port",
                "0",
                # The stack shares the machine with the gateway and the decision service: a 0.5 ms
                # spin before each step (not the benchmark's 1.5 ms) leaves them the CPU.
                "--spin-us",
                "500",
                *options,
                *sim_events,
                *worker_tracing_argv(s.tracing, s.engine),
            )

        return cls(
            cluster=cluster,
            decision=lambda s: (
                python, "-m", "decision_service", "serve", "--tables", str(s.tables), "--port", "0",
                "--metrics-port", "0", *decision_tracing_argv(s.tracing),
            ),
            gateway=lambda s, config: (
                python, "-m", "gateway", "serve", "--config", str(config), "--port", str(s.port),
            ),
            picker=lambda s, config: _picker_argv(python, config),
        )  # fmt: skip


def _picker_argv(python: str, config: Path) -> tuple[str, ...]:
    return (
        python, "-m", "gateway", "picker", "--config", str(config), "--grpc-port", "0", "--metrics-port", "0",
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Up:
    """What a started stack announces."""

    url: str
    cluster: dict[str, Any]
    decision: dict[str, Any]
    gateways: tuple[str, ...]
    redis: str = ""
    picker: dict[str, Any] | None = None


async def run_stack(
    settings: StackSettings,
    commands: StackCommands,
    out: TextIO,
    stop: asyncio.Event,
    *,
    relay: Callable[[str], None] | None = None,
    grace_s: float = 10.0,
) -> int:
    """Start the stack, serve until ``stop`` is set or a child dies, stop everything; the exit code.
    ``stop`` is heeded while children are still starting too: the ones started so far are stopped."""
    supervisor = Supervisor(relay=relay, grace_s=grace_s)
    code = 1
    with tempfile.TemporaryDirectory(prefix="ppd-up-") as scratch:
        stopper = asyncio.create_task(stop.wait())
        starting = asyncio.create_task(_start(settings, commands, supervisor, Path(scratch)))
        try:
            await asyncio.wait({stopper, starting}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                logger.info("stopping while the stack starts: stopping the children started so far")
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError, ChildError):
                    await starting
                code = 0
            else:
                up = starting.result()
                ready = {
                    "gateway": up.url,
                    "decision": up.decision,
                    "workers": up.cluster.get("workers", []),
                }
                if settings.gateways > 1:
                    ready |= {"gateways": list(up.gateways), "redis": up.redis}
                if up.picker is not None:
                    ready |= {"data_plane": settings.data_plane, "picker": up.picker}
                out.write(json.dumps(ready) + "\n")
                out.write(banner(up.url, settings, up.cluster, up.decision, up.gateways, picker=up.picker))
                out.flush()
                watcher = asyncio.create_task(supervisor.wait_any_exit())
                done, _ = await asyncio.wait({stopper, watcher}, return_when=asyncio.FIRST_COMPLETED)
                watcher.cancel()
                if watcher in done and not watcher.cancelled():
                    raise watcher.result()
                logger.info("stopping the stack")
                code = 0
        except ChildError as exc:
            logger.error("%s; stopping every process", exc)
        finally:
            stopper.cancel()
            if not starting.done():  # run_stack itself cancelled
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError, ChildError):
                    await starting
            codes = await supervisor.stop_all()
            if codes:
                logger.info("stopped: %s", ", ".join(f"{name} ({c})" for name, c in codes.items()))
    return code


async def _start(
    settings: StackSettings, commands: StackCommands, supervisor: Supervisor, scratch: Path
) -> _Up:
    """Every child in order, each once the one before is ready (raises ChildError)."""
    timeout = settings.ready_timeout_s
    # A real cluster may prepare its venv and model first (minutes, once) and load slowly.
    cluster_timeout = max(timeout, 900.0) if settings.engine == "vllm-cpu" else timeout
    cluster = await supervisor.start(
        ChildSpec(_CLUSTER_NAMES[settings.engine], commands.cluster(settings), cluster_timeout)
    )
    decision = await supervisor.start(ChildSpec("decision service", commands.decision(settings), timeout))
    redis_url = ""
    if settings.gateways > 1:
        sock = scratch / "redis.sock"  # the scratch folder: a short path (a socket's is limited)
        redis = await supervisor.start(ChildSpec("redis", commands.redis(sock), timeout, ready_line=False))
        await poll(lambda: answers_ping(sock), redis, timeout, "answer PING on its socket")
        redis_url = f"unix://{sock}"
    config = (settings.config_dir or scratch) / "gateway.toml"
    try:
        text = gateway_config(settings, cluster.ready, decision.ready, redis_url=redis_url)
        if settings.data_plane == "envoy":
            check_addressed_by_ip(cluster.ready["workers"])
        config.write_text(text, encoding="utf-8")
    except ValueError as exc:
        raise ChildError("ppd-up", f"cannot configure the gateway: {exc}") from None
    if settings.data_plane == "envoy":
        url, picker = await start_picker_and_envoy(
            commands.picker(settings, config),
            commands.envoy,
            supervisor,
            scratch / "envoy",
            port=settings.port,
            timeout_s=timeout,
            workers=cluster.ready["workers"],
            failure_mode=settings.picker_failure_mode,
        )
        return _Up(url, cluster.ready, decision.ready, (), picker=picker)
    if settings.gateways == 1:
        gateway = await supervisor.start(ChildSpec("gateway", commands.gateway(settings, config), timeout))
        url = f"http://127.0.0.1:{_http_port(gateway)}"
        return _Up(url, cluster.ready, decision.ready, (url,))
    replica = dataclasses.replace(settings, port=0)  # Envoy takes the stack's port
    ports = []
    for i in range(settings.gateways):
        child = await supervisor.start(
            ChildSpec(f"gateway {i + 1}", commands.gateway(replica, config), timeout)
        )
        ports.append(_http_port(child))
    url = await start_envoy(
        commands.envoy, supervisor, scratch / "envoy", port=settings.port, replicas=ports, timeout_s=timeout
    )
    gateways = tuple(f"http://127.0.0.1:{port}" for port in ports)
    return _Up(url, cluster.ready, decision.ready, gateways, redis_url)


def _http_port(gateway: Child) -> int:
    port = gateway.ready.get("http")
    if type(port) is not int:
        raise ChildError(gateway.name, f"ready line has no integer 'http' port: {gateway.ready}")
    return port


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppd-up",
        description="Start the whole PPD system locally: a simulated cluster (or real vLLM workers on this "
        "CPU with --engine vllm-cpu), the decision service with the shipped tables and the gateway on "
        "127.0.0.1:8000. Ctrl-C stops every process.",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="sim",
        help="workers: the simulator (default) or real vLLM on this CPU (tiny model; `ppd-vllm prepare` "
        "runs first if needed)",
    )
    parser.add_argument(
        "--topology",
        default=None,
        help="cluster shape, e.g. 1P3D, 2P2D, 3P1D (default 1P3D; 1P1D with --engine vllm-cpu)",
    )
    parser.add_argument(
        "--mode", default="ppd", help="gateway routing mode: pd|local|ppd|replica|fraction:<x>"
    )
    parser.add_argument(
        "--tables",
        type=Path,
        default=None,
        help="table folder (default tables/; tables/vllm-cpu/ with --engine vllm-cpu, the table measured on "
        "real vLLM on this CPU)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=8000,
        help="the stack's port (the gateway's; Envoy's with --gateways N > 1 or --data-plane envoy); 0 picks "
        "a free one (default 8000)",
    )
    parser.add_argument(
        "--model-label",
        default=None,
        help="model part of the table key (default llama-3.1-8b; tiny-llama-cpu with --engine vllm-cpu)",
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=60.0, help="seconds each child may take to start"
    )
    parser.add_argument(
        "--gateways",
        type=_replicas,
        default=1,
        help="gateway replicas (default 1); more than 1 adds one redis-server (the session store they "
        "share) and Envoy on --port in front of them, round robin",
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="every worker publishes vLLM's KV cache events and the gateway follows them ([kv_events]): a "
        "Turn 2+ whose prefix its decode worker evicted goes P/D (reason kv_evicted)",
    )
    parser.add_argument(
        "--bidir",
        action="store_true",
        help="every worker runs vLLM's bidirectional KV mode and the gateway may serve the bidir path "
        "([routing] bidir), where the table has bidir figures (the shipped H100 tables do)",
    )
    add_slo_argument(parser)
    add_data_plane_arguments(parser)
    add_tracing_arguments(parser)
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


def _replicas(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def parse_settings(
    argv: Sequence[str] | None, environ: Mapping[str, str] | None = None
) -> tuple[StackSettings, str]:
    """ppd-up's command line (and PYTHONHASHSEED from ``environ``, which the workers inherit) -> the
    stack and the log level. Real vLLM defaults to its own 1P1D shape, table folder and model label (the
    table measured on real vLLM here), the simulator to the shipped H100 tables."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.data_plane == "envoy" and args.gateways > 1:
        parser.error(
            "--data-plane envoy runs one picker behind one Envoy: it cannot be combined with "
            "--gateways N > 1 yet"
        )
    try:
        tracing = tracing_settings(args.tracing_endpoint, args.tracing_sampling_ratio)
    except ValueError as exc:
        parser.error(str(exc))
    real = args.engine == "vllm-cpu"
    tables: Path = args.tables or (Path("tables") / "vllm-cpu" if real else Path("tables"))
    return StackSettings(
        topology=args.topology or ("1P1D" if real else "1P3D"),
        engine=args.engine,
        mode=args.mode,
        tables=tables,
        port=args.port,
        model_label=args.model_label or ("tiny-llama-cpu" if real else "llama-3.1-8b"),
        ready_timeout_s=args.ready_timeout,
        gateways=args.gateways,
        kv_events=args.kv_events,
        kv_hash_seed=(environ or {}).get("PYTHONHASHSEED", ""),
        bidir=args.bidir,
        data_plane=args.data_plane,
        picker_failure_mode=args.picker_failure_mode,
        slo_ttft_p99_ms=args.slo_ttft_p99_ms,
        tracing=tracing,
    ), str(args.log_level)


def main(argv: Sequence[str] | None = None) -> int:
    settings, log_level = parse_settings(argv, os.environ)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not settings.tables.is_dir():
        logger.warning(
            "table folder %s does not exist; ppd mode will use the gateway's fallback", settings.tables
        )

    async def serve() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await run_stack(
            settings, StackCommands.real(), sys.stdout, stop, relay=lambda line: print(line, file=sys.stderr)
        )

    return asyncio.run(serve())


if __name__ == "__main__":
    sys.exit(main())
