"""The four targets of the benchmark and how each is started and known to be ready.

The workers are one prefill and one decode worker: a simulated 1P1D cluster (`python -m simulator
cluster --topology 1P1D`, one process), or a P/D pair given by URL (e.g. real vLLM).

- `direct`: the workers themselves, no router: Turn 1 is vLLM's P/D protocol done by the client
  (load.py rule 3), Turn 2 goes straight to D, which holds the conversation;
- `gateway`: our standalone gateway (`python -m gateway serve`), mode `local` (Turn 1 through P, Turn
  2+ on the session's D), the two workers and nothing else;
- `envoy`: Envoy (deploy/envoy/picker/envoy.yaml) with our endpoint picker (`python -m gateway picker`)
  on the very same config file, started and awaited by devstack/data_plane.py as `ppd-up
  --data-plane envoy` does: Envoy carries D's leg and streams the answer, the picker runs P's leg;
- `envoy-gie` (with `--envoy-gie` only): the same with deploy/envoy/picker/envoy-gie.yaml, GIE's
  processing mode (bodies FULL_DUPLEX_STREAMED both ways): every answer chunk crosses the picker;
- `sglang`: SGLang's model gateway (`python -m sglang_router.launch_router --policy round_robin`) with
  the decode worker as its one worker. Its PD mode (`--pd-disaggregation`) speaks SGLang's own
  handshake (the request sent to P and D at once with bootstrap_host/port/room), which vLLM workers
  ignore: each computes the whole request, so it cannot route vLLM P/D. It is measured on Turn 2
  only, where every router sends the request to D; its Turn 1 (D computes the prompt itself) is
  sent, unmeasured, so that D holds the conversation as it does for the others.

Rule 1: every process is started through the Supervisor (its own session, stopped in reverse order,
        SIGKILL to its group after the grace), on 127.0.0.1; ports come from the kernel (port 0, or a
        free port handed over where the program cannot report one it picked itself).
Rule 2: a target is ready when a streamed chat request through it completes (not merely when its port
        answers): that proves the router has registered the workers and can relay a stream.
Rule 3: a target names every process of its router (`pids`, by role), so that its CPU counts all of
        them (Envoy and the picker for `envoy`), and the one that carries the answers (`data_plane`)
        where that is not the whole router.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench_routers.load import Conversation, DirectPD, LoadSpec, Post, RequestError, Sender
from devstack.data_plane import (
    PICKER_ENVOY_TEMPLATE,
    PICKER_GIE_ENVOY_TEMPLATE,
    check_addressed_by_ip,
    start_picker_and_envoy,
)
from devstack.replicas import envoy_argv
from devstack.supervisor import Child, ChildError, ChildSpec, Supervisor

__all__ = [
    "DIRECT",
    "ENVOY",
    "ENVOY_GIE",
    "OURS",
    "PEER",
    "TARGETS",
    "Target",
    "Workers",
    "direct_target",
    "free_port",
    "gateway_argv",
    "gateway_config",
    "model_of",
    "picker_argv",
    "sglang_argv",
    "start_cluster",
    "start_envoy_picker",
    "start_gateway",
    "start_sglang",
    "wait_ready",
]

DIRECT = "direct"
OURS = "gateway"
ENVOY = "envoy"
ENVOY_GIE = "envoy-gie"
PEER = "sglang"
#: The targets in the order they are printed (`envoy-gie` runs only when asked for).
TARGETS = (DIRECT, OURS, ENVOY, ENVOY_GIE, PEER)

_HOST = "127.0.0.1"
_CHAT = "/v1/chat/completions"
# A start that lost its handed-over port to another process is retried this often.
_PORT_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Workers:
    prefill_url: str
    decode_url: str
    # The simulated cluster's process (both workers), for its CPU time; None for workers given by URL.
    pid: int | None = None


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    turn1: Sender
    turn2: Sender
    # Rule 3: every process of the router by role; empty for the direct path.
    pids: Mapping[str, int] = field(default_factory=dict)
    # The role in `pids` that carries the answers when it is not the whole router ("envoy").
    data_plane: str = ""
    # Whether its Turn 1 is vLLM's P/D (measured as Turn 1); SGLang's is not (module docstring).
    routes_pd: bool = True
    # The process watched while it starts (an exit fails the start at once).
    child: Child | None = None


def free_port(host: str = _HOST) -> int:
    """A port the kernel has just given out; the window in which another process could take it is the
    few milliseconds before the child binds it (a lost race is retried by the caller)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def direct_target(workers: Workers) -> Target:
    return Target(
        DIRECT,
        DirectPD(workers.prefill_url + _CHAT, workers.decode_url + _CHAT),
        Post(workers.decode_url + _CHAT),
    )


def gateway_config(workers: Workers) -> str:
    """The TOML (gateway/README.md) both our front doors read: mode `local` (Turn 1 through P, Turn 2+
    on the session's D), the two workers, nothing else changed."""
    check_addressed_by_ip(
        [{"id": "P0", "url": workers.prefill_url}, {"id": "D0", "url": workers.decode_url}]
    )  # the picker's Envoy resolves no names (devstack/data_plane.py rule 1)
    lines = ["# Generated by ppd-bench-routers; one run only.", 'mode = "local"']
    for worker_id, role, url in (
        ("P0", "prefill", workers.prefill_url),
        ("D0", "decode", workers.decode_url),
    ):
        # A JSON string of printable text is a valid TOML string.
        lines += ["", "[[workers]]", f'id = "{worker_id}"', f'role = "{role}"', f"url = {json.dumps(url)}"]
    return "\n".join(lines) + "\n"


def gateway_argv(config: Path) -> tuple[str, ...]:
    return (
        sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", "0",
        "--log-level", "WARNING",
    )  # fmt: skip


def picker_argv(config: Path) -> tuple[str, ...]:
    return (
        sys.executable, "-m", "gateway", "picker", "--config", str(config), "--grpc-port", "0",
        "--metrics-port", "0", "--log-level", "WARNING",
    )  # fmt: skip


def sglang_argv(worker_url: str, port: int, metrics_port: int) -> tuple[str, ...]:
    """SGLang's model gateway as the issue measured it; logging at warnings (as our gateway's), its
    Prometheus listener on a free loopback port instead of the fixed 29000, everything else default."""
    return (
        sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", worker_url,
        "--policy", "round_robin", "--host", _HOST, "--port", str(port),
        "--prometheus-host", _HOST, "--prometheus-port", str(metrics_port), "--log-level", "warn",
    )  # fmt: skip


async def start_cluster(sup: Supervisor, ready_timeout_s: float) -> Workers:
    """A simulated 1P1D cluster in one process; its P and D."""
    argv = (sys.executable, "-m", "simulator", "cluster", "--topology", "1P1D", "--base-port", "0")
    child = await sup.start(ChildSpec("simulated cluster", argv, ready_timeout_s))
    urls = {w.get("role"): w.get("url") for w in child.ready.get("workers") or () if isinstance(w, dict)}
    prefill, decode = urls.get("prefill"), urls.get("decode")
    if not isinstance(prefill, str) or not isinstance(decode, str):
        raise ChildError("simulated cluster", f"ready line names no prefill and decode url: {child.ready}")
    return Workers(prefill, decode, child.proc.pid)


async def start_gateway(sup: Supervisor, config: Path, ready_timeout_s: float) -> Target:
    child = await sup.start(ChildSpec("gateway", gateway_argv(config), ready_timeout_s))
    port = child.ready.get("http")
    if type(port) is not int:
        raise ChildError("gateway", f"ready line has no integer 'http' port: {child.ready}")
    post = Post(f"http://{_HOST}:{port}{_CHAT}")
    return Target(OURS, post, post, {"gateway": child.proc.pid}, child=child)


async def start_envoy_picker(
    sup: Supervisor,
    config: Path,
    scratch: Path,
    ready_timeout_s: float,
    workers: Workers,
    *,
    gie: bool = False,
) -> Target:
    """The picker on `config` and Envoy in front of it, as `ppd-up --data-plane envoy` starts them
    (with `gie`, Envoy on envoy-gie.yaml); Envoy's workers cluster lists `workers`."""
    name = ENVOY_GIE if gie else ENVOY
    before = len(sup.children)
    listed = [{"role": "prefill", "url": workers.prefill_url}, {"role": "decode", "url": workers.decode_url}]
    url, _ = await start_picker_and_envoy(
        picker_argv(config), envoy_argv, sup, scratch / name, port=0, timeout_s=ready_timeout_s,
        workers=listed, template=PICKER_GIE_ENVOY_TEMPLATE if gie else PICKER_ENVOY_TEMPLATE,
    )  # fmt: skip
    children = {child.name: child for child in sup.children[before:]}  # this pair's, not another's
    pids = {"envoy": children["envoy"].proc.pid, "picker": children["picker"].proc.pid}
    post = Post(url + _CHAT)
    return Target(name, post, post, pids, data_plane="envoy", child=children["envoy"])


async def start_sglang(
    sup: Supervisor, http: aiohttp.ClientSession, decode_url: str, spec: LoadSpec, ready_timeout_s: float
) -> Target:
    """Start SGLang's router on D and wait until it relays a stream; a start that lost its port is
    retried."""
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        port = free_port()
        argv = sglang_argv(decode_url, port, free_port())
        child = await sup.start(ChildSpec("sglang router", argv, ready_timeout_s, ready_line=False))
        post = Post(f"http://{_HOST}:{port}{_CHAT}")
        target = Target(PEER, post, post, {"sglang": child.proc.pid}, routes_pd=False, child=child)
        try:
            await wait_ready(http, target, spec, ready_timeout_s)
        except ChildError:
            if attempt == _PORT_ATTEMPTS or child.proc.returncode is None:
                raise
            continue  # it exited: most likely its port was taken in the meantime
        return target
    raise AssertionError("unreachable")


async def wait_ready(http: aiohttp.ClientSession, target: Target, spec: LoadSpec, timeout_s: float) -> None:
    """Rule 2: poll with a streamed Turn 1 until one completes; ChildError if the process exits or
    time runs out."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        if target.child is not None and target.child.proc.returncode is not None:
            await asyncio.sleep(0.2)  # let its last output reach the tail
            code = target.child.proc.returncode
            raise ChildError(
                target.child.name, f"exited with code {code} before it was ready", tuple(target.child.tail)
            )
        body = spec.body(Conversation(-1), 1)
        try:
            await target.turn1.send(http, body, min(spec.timeout_s, 10.0), f"bench-ready-{target.name}")
        except RequestError as exc:
            last = str(exc)
        else:
            return
        if time.monotonic() > deadline:
            tail = tuple(target.child.tail) if target.child is not None else ()
            name = target.child.name if target.child is not None else target.name
            raise ChildError(name, f"relayed no stream within {timeout_s:g} s (last: {last})", tail)
        await asyncio.sleep(0.1)


async def model_of(http: aiohttp.ClientSession, worker_url: str, timeout_s: float) -> str:
    """The first model the worker serves (its /v1/models), polled until it answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with http.get(f"{worker_url}/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    data = (await resp.json()).get("data") or []
                    if data and isinstance(data[0].get("id"), str):
                        return str(data[0]["id"])
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise ChildError("worker", f"{worker_url}/v1/models named no model within {timeout_s:g} s")
        await asyncio.sleep(0.2)
