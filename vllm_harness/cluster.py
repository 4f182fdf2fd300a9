"""``ppd-vllm cluster``: real vLLM P/D workers on this machine, with the simulator cluster's ready line.

Rule 1: each worker is ``remote/serve_worker.py`` in the vLLM venv, in its own session, and prints
        its own ready line once ``/health`` answers; the cluster prints
        ``{"topology", "engine", "model", "workers": [{"id", "role", "url"}]}`` once all are ready,
        the same contract as ``ppd-sim cluster``, so whatever takes a simulated cluster takes this one.
Rule 2: P and D get NixlConnector over CPU memory (``kv_buffer_device: cpu``), each with its own
        side-channel port; the connector config is ``kv_transfer_config()``, shared with the GPU
        scripts' documentation in deploy/vllm.
Rule 3: ``pin`` puts prefill and decode workers on disjoint CPU cores (``taskset``), as they would be
        on separate GPUs; memory bandwidth, the gateway and the load generator stay shared.
Rule 4: a worker that dies is logged (with its last stderr lines) and the others keep serving, as
        the nodes of a real cluster would; the cluster ends when every worker is gone (exit 1) or on
        SIGTERM/SIGINT (exit 0). Stopping sends SIGTERM, then SIGKILL to each worker's process group
        after the grace period, so no engine process, port or shared-memory segment outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from devstack.supervisor import Child, ChildError, ChildSpec, Supervisor
from simulator.core.kv_load_policy import KvLoadFailurePolicy
from simulator.core.topology import Topology, WorkerSpec
from vllm_harness.prepare import Prepared, remote_script

__all__ = [
    "ClusterSettings",
    "core_plan",
    "held_shared_memory",
    "kv_events_config",
    "kv_transfer_config",
    "rss_of_group",
    "run_cluster",
    "shared_memory_of_group",
    "worker_command",
]

logger = logging.getLogger("ppd-vllm")

_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
_SHM = "/dev/shm/"  # noqa: S108 (only read: the files a worker's processes hold there)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSettings:
    topology: Topology
    host: str = "127.0.0.1"
    #: Prefill and decode workers on disjoint cores (needs at least two cores to have any effect).
    pin: bool = True
    #: The two NIXL changes of serve_worker.py (progress thread, KV-thread pinning); on for CPUs.
    cpu_nixl_fixes: bool = True
    max_model_len: int = 4096
    #: 128 MiB of KV cache per worker (131k tokens of the tiny model).
    kv_cache_bytes: int = 128 * 1024 * 1024
    #: vLLM's CPU default is 128; its CPU attention needs a multiple of 32. Prefix hits come in steps of it.
    block_size: int = 32
    #: ``kv_load_failure_policy`` per worker id; a worker not named gets vLLM's default, "fail".
    failure_policies: Mapping[str, KvLoadFailurePolicy] = field(default_factory=dict)
    #: Worker ids started with ``bidirectional_kv_xfer`` (vLLM's bidirectional mode); the others without.
    bidir_workers: frozenset[str] = frozenset()
    ready_timeout_s: float = 240.0
    grace_s: float = 15.0
    extra_args: tuple[str, ...] = ()
    #: vLLM's KV cache events on every worker (a PUB and a replay port each, in the ready line).
    kv_events: bool = False


def kv_events_config(pub_port: int, replay_port: int) -> str:
    """``--kv-events-config`` of one worker: bound on every interface (vLLM connects to, rather than
    binds, an endpoint without ``*``), subscribers use 127.0.0.1 (docs/vllm-protocol.md 10.1)."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pub_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
        }
    )


def kv_transfer_config(
    role: str, *, failure_policy: KvLoadFailurePolicy, cpu_buffer: bool, bidirectional: bool = False
) -> str | None:
    """The ``--kv-transfer-config`` JSON for a role (None for a replica: no P/D)."""
    kv_role = _KV_ROLE.get(role)
    if kv_role is None:
        return None
    config: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": kv_role,
        "kv_load_failure_policy": failure_policy,
    }
    if cpu_buffer:
        config["kv_buffer_device"] = "cpu"
    if bidirectional:
        config["kv_connector_extra_config"] = {"bidirectional_kv_xfer": True}
    return json.dumps(config, separators=(",", ":"))


def core_plan(workers: Sequence[WorkerSpec], cores: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Cores per worker id: prefill workers on the first share of the cores, the others on the rest.

    The split follows the worker counts (at least one core each side); with one core, or only one
    kind of worker, everyone shares every core.
    """
    ordered = tuple(sorted(cores))
    prefill = [w for w in workers if w.role == "prefill"]
    others = [w for w in workers if w.role != "prefill"]
    if len(ordered) < 2 or not prefill or not others:
        return {w.id: ordered for w in workers}
    share = round(len(ordered) * len(prefill) / len(workers))
    cut = min(max(share, 1), len(ordered) - 1)
    plan = {w.id: ordered[:cut] for w in prefill}
    plan.update({w.id: ordered[cut:] for w in others})
    return plan


def _free_port(host: str, *, rng: random.Random | None = None, taken: set[int] | None = None) -> int:
    """A port for a vLLM worker to bind later: vLLM cannot report a port it picked itself, so one is
    chosen here and handed over. Its KV-event sockets bind theirs tens of seconds later, once the
    engine has loaded, so the port must not be one the kernel hands out meanwhile: it is taken below
    the ephemeral range (`ip_local_port_range`), where no `bind(0)` and no outgoing connection of any
    process lands, at random, and checked free now. ``taken``: the ports chosen before for the same
    cluster, none of them bound yet, so the check cannot see them (two workers once drew the same
    port: "Address already in use" from a KV-event publisher); the chosen port is added to it."""
    rng = rng or random.Random()  # noqa: S311 (spreads ports, guards nothing)
    taken = taken if taken is not None else set()
    low, high = _explicit_ports()
    for _ in range(200):
        port = rng.randint(low, high)
        if port in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError(f"no free port between {low} and {high} on {host} after 200 tries")


def _explicit_ports(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """Ports below the kernel's ephemeral range (20000 up to it, or 20000-32767 where it is unknown)."""
    try:
        first = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    return 20000, max(first - 1, 20001)


def worker_command(
    prepared: Prepared,
    settings: ClusterSettings,
    worker: WorkerSpec,
    *,
    http_port: int,
    side_channel_port: int,
    cores: Sequence[int] = (),
    kv_event_ports: tuple[int, int] | None = None,
) -> tuple[tuple[str, ...], dict[str, str]]:
    """argv and environment of one worker."""
    serve = [
        str(prepared.model), "--served-model-name", prepared.served_model,
        "--max-model-len", str(settings.max_model_len), "--enforce-eager",
        "--kv-cache-memory-bytes", str(settings.kv_cache_bytes), "--block-size", str(settings.block_size),
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    policy = settings.failure_policies.get(worker.id, "fail")
    kv = kv_transfer_config(
        worker.role, failure_policy=policy, cpu_buffer=True, bidirectional=worker.id in settings.bidir_workers
    )
    if kv is not None:
        serve += ["--kv-transfer-config", kv]
    if kv_event_ports is not None:
        serve += ["--kv-events-config", kv_events_config(*kv_event_ports)]
    serve += list(settings.extra_args)
    argv: list[str] = []
    if cores:
        argv += ["taskset", "-c", ",".join(str(c) for c in cores)]
    argv += [
        str(prepared.python), str(remote_script("serve_worker.py")), "--id", worker.id, "--role", worker.role,
        "--host", settings.host, "--port", str(http_port), "--", *serve,
    ]  # fmt: skip
    env = dict(os.environ)
    env.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            # No OpenMP thread binding of vLLM's own: the launcher's taskset decides the cores.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": settings.host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        }
    )
    # When set, VLLM_CPU_KVCACHE_SPACE overrides --kv-cache-memory-bytes.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    # Its spans' service.name with --otlp-traces-endpoint (vLLM's default: unknown_service:python), so a
    # trace tells P from D; a name the caller's environment gives is kept.
    env.setdefault("OTEL_SERVICE_NAME", f"vllm-{worker.id}")
    if settings.cpu_nixl_fixes:
        env["PPD_VLLM_NIXL_NO_PROGRESS_THREAD"] = "1"
        env["PPD_VLLM_NIXL_NO_KV_PIN"] = "1"
    return tuple(argv), env


def _processes(proc: Path) -> Iterator[Path]:
    return (entry for entry in proc.iterdir() if entry.name.isdigit())


def _group_members(pgid: int, proc: Path) -> Iterator[Path]:
    """The /proc folders of the processes in group ``pgid``."""
    for entry in _processes(proc):
        try:
            # Field 5 of /proc/PID/stat is the process group; the name before it may hold spaces.
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                yield entry
        except (OSError, ValueError, IndexError):
            continue  # ended while we looked


def _shm_held(entries: Iterable[Path]) -> set[Path]:
    """The /dev/shm files these processes have mapped or open."""
    found: set[Path] = set()
    for entry in entries:
        try:
            for line in (entry / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(_SHM):
                    found.add(Path(fields[5].removesuffix(" (deleted)")))
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(_SHM):
                    found.add(Path(target.removesuffix(" (deleted)")))
        except OSError:
            continue  # the process ended while we looked, or is not ours to read
    return found


def shared_memory_of_group(pgid: int, proc: Path = Path("/proc")) -> set[Path]:
    """The /dev/shm files the processes of group ``pgid`` have mapped or open (vLLM's engine keeps its
    message queues and buffers there). A crashed worker's are unlinked by the launcher, since the
    process that would have cleaned them up died with it."""
    return _shm_held(_group_members(pgid, proc))


def held_shared_memory(proc: Path = Path("/proc")) -> set[Path]:
    """The /dev/shm files some live process has mapped or open."""
    return _shm_held(_processes(proc))


def _shm_files(shm: Path = Path(_SHM)) -> set[Path]:
    return set(shm.iterdir()) if shm.is_dir() else set()


def _unlink_unheld(paths: Iterable[Path], proc: Path = Path("/proc")) -> list[Path]:
    """Unlink those of ``paths`` that still exist and that no live process holds."""
    left = {p for p in paths if p.exists()}
    return _unlink(left - held_shared_memory(proc)) if left else []


def rss_of_group(pgid: int, proc: Path = Path("/proc")) -> int:
    """Resident memory of every process in group ``pgid``, in bytes (VmRSS summed)."""
    total = 0
    for entry in _group_members(pgid, proc):
        try:
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


def _unlink(paths: Iterable[Path]) -> list[Path]:
    removed = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


async def _kill_groups(pids: Sequence[int], *, settle_s: float = 10.0) -> None:
    """SIGKILL each group, then wait (up to ``settle_s``) until none of its processes maps anything in
    /dev/shm any more: a killed process lets go of its mappings only as it finishes exiting."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    for _ in range(round(settle_s / 0.1)):
        if not any(shared_memory_of_group(pid) for pid in pids):
            return
        await asyncio.sleep(0.1)


async def _start_all(supervisor: Supervisor, specs: Sequence[ChildSpec]) -> list[Child]:
    """Start every worker at once (they load in parallel); the first failure is raised after all end."""
    results = await asyncio.gather(*(supervisor.start(spec) for spec in specs), return_exceptions=True)
    started: list[Child] = []
    for result in results:
        if isinstance(result, BaseException):
            raise result
        started.append(result)
    return started


async def _serve(supervisor: Supervisor, stop: asyncio.Event, shm: Mapping[int, set[Path]]) -> int:
    """Until ``stop`` (0) or until no worker is left (1); a death is logged and the rest keep serving."""
    live = {asyncio.ensure_future(c.proc.wait()): c for c in supervisor.children}
    stopper = asyncio.ensure_future(stop.wait())
    try:
        while live:
            done, _ = await asyncio.wait({stopper, *live}, return_when=asyncio.FIRST_COMPLETED)
            if stopper in done:
                return 0
            for task in done:
                child = live.pop(task)
                await _kill_groups([child.proc.pid])  # an engine process left behind goes too
                removed = _unlink_unheld(shm.get(child.proc.pid, ()))
                tail = "\n".join(f"    {line}" for line in child.tail)
                logger.error(
                    "%s exited with code %s (%d shared-memory files removed); the other workers keep "
                    "serving\n%s",
                    child.name, child.proc.returncode, len(removed), tail,
                )  # fmt: skip
        logger.error("every worker has exited")
        return 1
    finally:
        stopper.cancel()
        for task in live:
            task.cancel()


def _event_endpoints(ports: tuple[int, int] | None) -> dict[str, str]:
    if ports is None:
        return {}
    return {"kv_events": f"tcp://127.0.0.1:{ports[0]}", "kv_events_replay": f"tcp://127.0.0.1:{ports[1]}"}


async def run_cluster(
    prepared: Prepared,
    settings: ClusterSettings,
    out: TextIO,
    stop: asyncio.Event,
    *,
    relay: Any = None,
) -> int:
    """Start every worker, print the ready line, run until ``stop`` or a death; 0 after a signal."""
    workers = settings.topology.workers
    cores = core_plan(workers, sorted(os.sched_getaffinity(0))) if settings.pin else {}
    supervisor = Supervisor(relay=relay, grace_s=settings.grace_s)
    specs = []
    event_ports: dict[str, tuple[int, int]] = {}
    chosen: set[int] = set()  # every port handed to a worker of this cluster: never two the same
    for worker in workers:
        if settings.kv_events:
            event_ports[worker.id] = (
                _free_port(settings.host, taken=chosen),
                _free_port(settings.host, taken=chosen),
            )
        argv, env = worker_command(
            prepared,
            settings,
            worker,
            http_port=_free_port(settings.host, taken=chosen),
            side_channel_port=_free_port(settings.host, taken=chosen),
            cores=cores.get(worker.id, ()),
            kv_event_ports=event_ports.get(worker.id),
        )
        specs.append(ChildSpec(f"vllm {worker.id}", argv, settings.ready_timeout_s, env))
    began = time.monotonic()
    # Files the workers create in /dev/shm while starting; a process that made one may be gone by
    # the time they are ready (so no scan of the workers finds it), yet it must not outlive them.
    shm_before = _shm_files()
    starting = asyncio.ensure_future(_start_all(supervisor, specs))
    stopper = asyncio.ensure_future(stop.wait())
    shm: dict[int, set[Path]] = {}  # by worker pid; 0: created while starting, by any of them
    code = 1
    try:
        await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            return 0  # a signal while starting: the finally clause ends the starts and the workers
        started = starting.result()
        ready = {
            "topology": settings.topology.name,
            "engine": "vllm-cpu",
            "model": prepared.served_model,
            "workers": [
                {
                    "id": w.id,
                    "role": w.role,
                    "url": child.ready["url"],
                    "pid": child.proc.pid,
                    # The cores the worker is pinned to, "all" when unpinned (rule 3).
                    "cores": ",".join(str(c) for c in cores[w.id]) if cores.get(w.id) else "all",
                }
                | _event_endpoints(event_ports.get(w.id))
                for w, child in zip(workers, started, strict=True)
            ],
        }
        shm.update({child.proc.pid: shared_memory_of_group(child.proc.pid) for child in started})
        shm[0] = _shm_files() - shm_before
        rss = {w.id: rss_of_group(child.proc.pid) for w, child in zip(workers, started, strict=True)}
        logger.info(
            "%d workers ready in %.0f s; RSS %s (total %.1f GB)",
            len(started), time.monotonic() - began,
            ", ".join(f"{wid} {b / 1e9:.1f} GB" for wid, b in rss.items()), sum(rss.values()) / 1e9,
        )  # fmt: skip
        out.write(json.dumps(ready) + "\n")
        out.flush()
        code = await _serve(supervisor, stop, shm)
    except ChildError as exc:
        logger.error("%s; stopping every worker", exc)
    finally:
        stopper.cancel()
        # A stop while starting: end the starts first, so every worker already spawned is registered
        # (asyncio kills one whose spawn was cut short) and none is left waiting for its ready line.
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        pids = [child.proc.pid for child in supervisor.children]
        await supervisor.stop_all()
        await _kill_groups(pids)  # engine processes a worker left behind go with its group
        # What a clean stop's resource trackers did not unlink (after a SIGKILL, say).
        leftover = _unlink_unheld(path for paths in shm.values() for path in paths)
        if leftover:
            logger.warning("removed %d shared-memory files the workers left", len(leftover))
    return code
