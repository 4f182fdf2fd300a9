"""The ``vllm-cpu`` sweep engine: grid points measured on real vLLM workers on this CPU.

``ppd-table sweep --engine vllm-cpu`` finds it in the entry-point group ``ppd_table.engines``
(pyproject.toml), beside the simulator's ``sim``. One point = the load generator's synthetic two-turn
workload at the point's QPS for ``duration_s`` seconds, sent through the whole local stack
(``ppd-up --engine vllm-cpu``: real vLLM prefill and decode workers with NixlConnector, the decision
service, our gateway) with the point's static mode asked for per request (``X-PPD-Mode``), so the
records say what the client saw, exactly as ``ppd-bench run`` records them.

Rule 1: one stack per shape, started at the shape's first point and kept for the next ones (a real
        cluster takes a minute or more to start); ``close()`` stops it. Points run one at a time
        (``max_jobs``): two clusters on one CPU would measure each other.
Rule 2: the arrivals and the conversations' text of a point depend on (seed, workload, QPS) only, so the
        pd and local runs of a cell see the very same traffic (as the ``sim`` engine does); different
        cells get different text, and each run marks its own (``loadgen.load`` rule 6), so no run is
        served from the prefix cache another run filled (before that mark, the local run of a cell found
        the Turn 2 prompts its pd run had just pulled onto D).
Rule 3: the settings name vLLM's and NIXL's versions, the tiny model and the harness's build revision, so
        a sweep folder is never resumed by another engine build, and the table's provenance says it was
        measured on real vLLM on a CPU.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from devstack.ready import start_ready
from loadgen.load import LoadSettings, run_load
from loadgen.tokens import llama3_counter
from loadgen.workloads import SyntheticWorkload, single_token_words
from table_builder.engines import EngineOptions
from table_builder.records import Record
from table_builder.sweep import GridPoint
from vllm_harness.spec import BUILD_REVISION, NIXL_VERSION, SERVED_MODEL, VLLM_CPU_VERSION

__all__ = ["VllmCpuEngine", "make"]

logger = logging.getLogger(__name__)

#: A real cluster prepares its venv and model the first time (minutes), then loads in a minute or more.
_READY_TIMEOUT_S: Final = 900.0
_STOP_GRACE_S: Final = 60.0


@dataclass(slots=True)
class _Stack:
    shape: str
    process: subprocess.Popen[str]
    url: str


@dataclass(slots=True)
class VllmCpuEngine:
    duration_s: float = 20.0
    seed: int = 0
    timeout_s: float = 30.0
    ready_timeout_s: float = _READY_TIMEOUT_S
    _stack: _Stack | None = field(default=None, repr=False, compare=False)

    #: Points run one at a time on one cluster (``ppd-table sweep --jobs`` above this is refused).
    max_jobs: ClassVar[int] = 1

    @property
    def name(self) -> str:
        return "vllm-cpu"

    def settings(self) -> Mapping[str, Any]:
        return {
            "duration_s": self.duration_s,
            "harness_revision": BUILD_REVISION,
            "model": SERVED_MODEL,
            "nixl": NIXL_VERSION,
            "seed": self.seed,
            "timeout_s": self.timeout_s,
            "vllm": f"vllm-cpu {VLLM_CPU_VERSION}",
        }

    def arrivals_seed(self, point: GridPoint) -> int:
        return zlib.crc32(f"{self.seed}/{point.workload.name}/{point.qps:g}".encode())

    def run(self, point: GridPoint) -> list[Record]:
        url = self._stack_for(point.shape)
        seed = self.arrivals_seed(point)
        workload = SyntheticWorkload(
            name=point.workload.name, words=single_token_words(llama3_counter()), seed=seed
        )
        settings = LoadSettings(
            url=url,
            qps=point.qps,
            duration_s=self.duration_s,
            run_id=point.run_id,
            workload=point.workload.name,
            seed=seed,
            timeout_s=self.timeout_s,
            served_model=SERVED_MODEL,
            shape=point.shape,
            model_label=point.model,
            mode=point.mode,
            send_mode_header=True,
        )
        records = asyncio.run(run_load(settings, workload)).records
        stack = self._stack
        if stack is None or stack.process.poll() is not None:
            # Its requests failed because the stack went away, not because of the mode: never keep them.
            raise RuntimeError(f"the {point.shape} stack exited during {point.run_id}; run the sweep again")
        return records

    def close(self) -> None:
        """Stop the stack, if one runs (SIGTERM: ppd-up stops every worker, then exits)."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        logger.info("stopping the %s stack", stack.shape)
        stack.process.send_signal(signal.SIGTERM)
        try:
            stack.process.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            stack.process.kill()
            stack.process.wait()
        if stack.process.stdout is not None:
            stack.process.stdout.close()

    def _stack_for(self, shape: str) -> str:
        if self._stack is not None and self._stack.shape == shape:
            if self._stack.process.poll() is None:
                return self._stack.url
            logger.warning(
                "the %s stack exited (code %s); starting it again", shape, self._stack.process.returncode
            )
        self.close()
        argv = [
            sys.executable, "-m", "devstack.stack", "--engine", "vllm-cpu", "--topology", shape,
            "--port", "0", "--mode", "pd", "--log-level", "WARNING",
            "--ready-timeout", f"{self.ready_timeout_s:g}",
        ]  # fmt: skip
        logger.info("starting real vLLM workers for %s (a minute or more)", shape)
        # ppd-up's own worst case (cluster, decision service, gateway in turn) ends first, so on a hang
        # it is ppd-up that gives up and stops what it started.
        wait_s = max(self.ready_timeout_s, 900.0) + 2 * self.ready_timeout_s + 120.0
        process, ready = start_ready(argv, timeout_s=wait_s, name=f"ppd-up --topology {shape}")
        url = ready.get("gateway")
        if not isinstance(url, str):
            process.kill()
            process.wait()
            raise RuntimeError(f"ppd-up's ready line has no gateway URL: {ready}")
        self._stack = _Stack(shape, process, url)
        return url


def make(options: EngineOptions) -> VllmCpuEngine:
    """The entry point of ``vllm-cpu`` in the group ``ppd_table.engines``."""
    return VllmCpuEngine(duration_s=options.duration_s, seed=options.seed)
