"""What OpenTelemetry tracing costs the gateway per request: prints figures, asserts nothing.

    python -m benchmarks.tracing [--rounds 5] [--streams 16] [--requests 1600] [--chunks 20]
                                 [--ratio 0.1 ...] [--mode local|pd] [--baseline-src DIR]

Gateways identical but for tracing run side by side in one run, alternating, each round a fresh
process per arm, in front of the fixed-pace stand-in worker (`python -m benchmarks.gateway upstream`),
with the same load (--streams users, each a named session's Turn 2+ streaming requests):
- `off`: this tree, no `[tracing]` (the default: no tracer, no span objects);
- `on@R` for each R of --ratio: this tree, `[tracing] enabled` at sampling ratio R, exporting over
  OTLP/gRPC to a receiver in this process (it decodes each export and counts the spans, so the sampled
  share is seen to be right); ratio 0 is what a tracer costs that keeps nothing;
- `today` (with --baseline-src): the gateway of another source tree, e.g. the commit before tracing
  (`git worktree add /tmp/before <commit>`), started with that tree as its working directory.

Figures, one JSON object per line:
1. `arm` per round and arm: the gateway's CPU per request from /proc (µs), its own time to the first
   token (`ppd_gateway_overhead_seconds`: the handler's time minus the worker's) p50/p99 in ms, the
   client's TTFT p50/p99, and for `on` the spans exported per request.
2. `summary`: each arm's medians over the rounds, and each arm's CPU per request against `off`.
3. `in_process`: the spans' own CPU per request at each --ratio, in this process (no server, no
   network): one request's trace as the standalone gateway makes it in local mode (its span, parse,
   session lookup, ψ, D's leg with its traceparent and first token, the attributes), with the batch
   processor encoding what is kept as the OTLP exporter does (protobuf), best of --in-process-repeats.
With `on` arms of the same tree, the CPU a sampled request adds is the difference of two `on` arms
divided by the difference of their ratios.
--mode pd adds a P leg per request (one more span; the stand-in answers P too). Nothing here is
imported by the gateway.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import uvloop
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from tqdm import tqdm

from benchmarks.gateway import _emit, _histogram, _load, _pct, _Proc, _quantile, _start
from devstack.ready import start_ready
from gateway.request_trace import RequestTrace

__all__ = ["main"]

_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class _Sink:
    """An OTLP/gRPC trace receiver that counts the spans it is sent (and keeps nothing else)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans = 0
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.unary_unary_rpc_method_handler(
            self._export,
            request_deserializer=trace_service_pb2.ExportTraceServiceRequest.FromString,
            response_serializer=trace_service_pb2.ExportTraceServiceResponse.SerializeToString,
        )
        service, method = _EXPORT.rsplit("/", 1)
        generic = grpc.method_handlers_generic_handler(service.lstrip("/"), {method: handler})
        self._server.add_generic_rpc_handlers((generic,))
        self.endpoint = f"http://127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def _export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, _: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        n = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        with self._lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()

    def count(self) -> int:
        with self._lock:
            return self.spans

    def stop(self) -> None:
        self._server.stop(grace=None)


class _Encoder(SpanExporter):
    """What the OTLP exporter does with a batch before it sends it: the protobuf bytes."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        encode_spans(spans).SerializeToString()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def _in_process(ratio: float, requests: int) -> float:
    """Figure 3: CPU seconds per request of one request's trace calls at `ratio`."""
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(BatchSpanProcessor(_Encoder()))
    tracer = provider.get_tracer("benchmark")
    start = time.process_time()
    for _ in range(requests):
        trace = RequestTrace(tracer, "ppd.gateway.request", {})
        for step in ("ppd.parse", "ppd.session_lookup", "ppd.psi"):
            with trace.step(step):
                pass
        leg = trace.leg("ppd.decode", "D0", "http://127.0.0.1:8200")
        leg.headers(())
        leg.first_token()
        leg.end()
        trace.root.set_attributes({"ppd.turn": 2, "ppd.path": "local", "ppd.reason": "table"})
        trace.end()
    provider.shutdown()  # the batches still queued are encoded too
    return (time.process_time() - start) / requests


def _config(path: Path, url: str, mode: str, tracing: str) -> Path:
    path.write_text(
        f'mode = "{mode}"\n'
        f'[[workers]]\nid = "P0"\nrole = "prefill"\nurl = "{url}"\n'
        f'[[workers]]\nid = "D0"\nrole = "decode"\nurl = "{url}"\n' + tracing
    )
    return path


def _gateway(config: Path, source: Path | None) -> _Proc:
    serve = ["gateway", "serve", "--config", str(config), "--port", "0", "--log-level", "WARNING"]
    if source is None:
        return _start(serve)
    proc, ready = start_ready(
        [sys.executable, "-m", *serve], timeout_s=60, stderr=subprocess.DEVNULL, name="gateway", cwd=source
    )
    return _Proc(proc, ready)


def _measure(
    args: argparse.Namespace, config: Path, source: Path | None, sink: _Sink | None
) -> dict[str, Any]:
    per_stream = max(1, args.requests // args.streams)
    gw = _gateway(config, source)
    try:
        base = f"http://127.0.0.1:{gw.ready['http']}"
        url = base + "/v1/chat/completions"
        load = {"streams": args.streams, "chunks": args.chunks, "warm_turn": True}
        uvloop.run(_load(url, per_stream=2, **load))  # warm-up: connections, caches
        hist0 = _histogram(base + "/metrics", "ppd_gateway_overhead_seconds")
        spans0 = sink.count() if sink is not None else 0
        cpu0 = gw.cpu_seconds()
        ttfts, _ = uvloop.run(_load(url, per_stream=per_stream, **load))
        cpu = gw.cpu_seconds() - cpu0
        hist1 = _histogram(base + "/metrics", "ppd_gateway_overhead_seconds")
    finally:
        gw.stop()  # a traced gateway exports what it still holds as it stops
    requests = len(ttfts)
    own = {q: _quantile(hist0, hist1, q) for q in (0.5, 0.99)}
    ms = [t * 1000 for t in ttfts]
    out: dict[str, Any] = {
        "requests": requests,
        "cpu_us_per_request": round(cpu / requests * 1e6, 1),
        "own_p50_ms": round(own[0.5] * 1000, 4) if own[0.5] is not None else None,
        "own_p99_ms": round(own[0.99] * 1000, 4) if own[0.99] is not None else None,
        "ttft_p50_ms": round(_pct(ms, 0.5), 3),
        "ttft_p99_ms": round(_pct(ms, 0.99), 3),
    }
    if sink is not None:
        # Every request this gateway served (warm-up included) against the spans it exported, all of
        # them once it stopped: the sampled share times the spans of one traced request.
        served = args.streams * (1 + 2) + args.streams * (1 + per_stream)
        out["spans_per_request"] = round((sink.count() - spans0) / served, 3)
    return out


def _run(args: argparse.Namespace) -> int:
    interval = str(args.chunk_interval_ms / 1000.0)
    up = _start(["benchmarks.gateway", "upstream", "--port", "0", "--chunks", "1", "--interval", interval])
    sink = _Sink()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            url = up.ready["url"]
            arms: list[tuple[str, Path, Path | None, _Sink | None]] = [
                ("off", _config(Path(tmp) / "off.toml", url, args.mode, ""), None, None)
            ]
            for ratio in args.ratio:
                traced = (
                    f'[tracing]\nenabled = true\nsampling_ratio = {ratio}\nendpoint = "{sink.endpoint}"\n'
                )
                arms.append(
                    (
                        f"on@{ratio:g}",
                        _config(Path(tmp) / f"on-{ratio:g}.toml", url, args.mode, traced),
                        None,
                        sink,
                    )
                )
            if args.baseline_src is not None:
                today = _config(Path(tmp) / "today.toml", url, args.mode, "")
                arms.insert(0, ("today", today, args.baseline_src.resolve(), None))
            results: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in arms}
            with tqdm(total=args.rounds * len(arms), desc="tracing cost", file=sys.stderr) as bar:
                for r in range(args.rounds):
                    for name, config, source, arm_sink in arms:
                        figures = _measure(args, config, source, arm_sink)
                        results[name].append(figures)
                        _emit({"figure": "arm", "round": r, "arm": name, "mode": args.mode, **figures})
                        bar.update()
            _emit(_summary(args, results))
        for ratio in sorted({0.0, *args.ratio}):
            best = min(_in_process(ratio, args.in_process_requests) for _ in range(args.in_process_repeats))
            _emit({"figure": "in_process", "ratio": ratio, "cpu_us_per_request": round(best * 1e6, 2)})
    finally:
        sink.stop()
        up.stop()
    return 0


def _summary(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def median(arm: str, key: str) -> float | None:
        values = [f[key] for f in results[arm] if f.get(key) is not None]
        return round(statistics.median(values), 4) if values else None

    keys = (
        "cpu_us_per_request",
        "own_p50_ms",
        "own_p99_ms",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "spans_per_request",
    )
    medians: dict[str, dict[str, float]] = {}
    for arm in results:
        medians[arm] = {k: v for k in keys if (v := median(arm, k)) is not None}
    off = medians["off"]["cpu_us_per_request"]
    return {
        "figure": "summary",
        "mode": args.mode,
        "ratios": args.ratio,
        "rounds": args.rounds,
        "streams": args.streams,
        "chunks": args.chunks,
        "medians": medians,
        # None when `off` read no CPU at all (a tiny run: /proc counts 10 ms ticks).
        "cpu_vs_off": {
            arm: round(m["cpu_us_per_request"] / off, 3) if off else None for arm, m in medians.items()
        },
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tracing", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--rounds", type=int, default=5, help="rounds, each arm once per round (default 5)")
    add("--streams", type=int, default=16, help="concurrent users (default 16)")
    add("--requests", type=int, default=1600, help="measured requests per arm and round (default 1600)")
    add("--chunks", type=int, default=20, help="chunks per answer (default 20)")
    add("--chunk-interval-ms", type=float, default=1.0, help="the stand-in's pace between chunks")
    add(
        "--ratio",
        type=float,
        nargs="+",
        default=[0.1],
        help="[tracing] sampling_ratio of the `on` arms, one arm each (default 0.1)",
    )
    add("--mode", choices=("local", "pd"), default="local", help="the gateways' routing mode (default local)")
    add("--in-process-requests", type=int, default=20000, help="requests of the in-process figure")
    add("--in-process-repeats", type=int, default=5, help="repeats of the in-process figure (best kept)")
    add(
        "--baseline-src",
        type=Path,
        default=None,
        help="a source tree whose gateway is the `today` arm (e.g. a worktree of the commit before tracing)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return _run(_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
