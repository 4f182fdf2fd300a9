"""vLLM 0.33's Prometheus metrics for one simulated worker, in a registry of its own.

Names, types, labels (`model_name`, `engine`) and default buckets follow `vllm/v1/metrics/loggers.py`;
counters get prometheus_client's `_total` suffix exactly as vLLM's do. Never the global registry: a
cluster process hosts several workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["FinishedRequest", "WorkerMetrics"]

_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_REQUEST_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_LABELS = ("model_name", "engine")


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """What a finished request contributes to the per-request histograms (seconds, tokens)."""

    finished_reason: str
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int
    queue_s: float
    ttft_s: float
    prefill_s: float
    decode_s: float
    e2e_s: float
    preemptions: int = 0


class WorkerMetrics:
    """All series of one worker; `render()` is the `/metrics` body."""

    def __init__(self, model_name: str, engine: str = "0", block_size: int = 16) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = {"model_name": model_name, "engine": engine}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, (*_LABELS, *extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=r)

        self._labels = labels
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.running.labels(**labels)
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.waiting.labels(**labels)
        self.waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting, by reason.",
            (*_LABELS, "reason"),
            registry=r,
        )
        for reason in ("capacity", "deferred"):
            self.waiting_by_reason.labels(**labels, reason=reason)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.kv_usage.labels(**labels)
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of tokens.")
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector."
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector."
        )
        self.prompt_cached = counter("vllm:prompt_tokens_cached", "Prompt tokens served from a cache.")
        self.prompt_by_source = counter(
            "vllm:prompt_tokens_by_source", "Prompt tokens by source.", extra=("source",)
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter(
            "vllm:request_success", "Count of successfully processed requests.", extra=("finished_reason",)
        )
        plain = [self.prefix_queries, self.prefix_hits, self.external_queries, self.external_hits]
        plain += [self.prompt_cached, self.preemptions, self.prompt_tokens, self.generation_tokens]
        for counter_ in plain:
            counter_.labels(**labels)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            self.prompt_by_source.labels(**labels, source=source)
        for finished in ("stop", "length", "abort", "error"):
            self.request_success.labels(**labels, finished_reason=finished)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS)
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds", "Time per output token per request.", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time spent in the WAITING phase.", _LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "Time spent in the PREFILL phase.", _LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "Time spent in the DECODE phase.", _LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds", "Time spent in the RUNNING phase.", _LATENCY_BUCKETS
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Number of tokens per engine step.", _TOKEN_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", _REQUEST_TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", _REQUEST_TOKEN_BUCKETS
        )
        self.request_max_tokens = histogram(
            "vllm:request_params_max_tokens", "The max_tokens request parameter.", _REQUEST_TOKEN_BUCKETS
        )
        self.request_preemptions = histogram(
            "vllm:request_num_preemptions", "Preemptions per request.", (0, 1, 2, 4, 8, 16)
        )
        self._add_nixl_and_info(engine, block_size)
        # Labelled children of the per-token series, resolved once (labels() costs a dict lookup and
        # a lock per call, and these run for every streamed token).
        self._itl_child = self.itl.labels(**labels)
        self._iteration_tokens_child = self.iteration_tokens.labels(**labels)
        self._generation_tokens_child = self.generation_tokens.labels(**labels)

    def _add_nixl_and_info(self, engine: str, block_size: int = 16) -> None:
        r = self.registry
        labels = self._labels
        self.nixl_xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds",
            "Transfer duration for NIXL KV cache transfers.",
            _LABELS,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.nixl_bytes = Histogram(
            "vllm:nixl_bytes_transferred",
            "Bytes transferred per NIXL KV cache transfer.",
            _LABELS,
            buckets=tuple(float(2**k) for k in range(20, 36)),
            registry=r,
        )
        self.nixl_failed = Counter(
            "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV transfers.", _LABELS, registry=r
        )
        self.nixl_expired = Counter(
            "vllm:nixl_num_kv_expired_reqs", "Requests whose KV blocks expired.", _LABELS, registry=r
        )
        self.nixl_failed.labels(**labels)
        self.nixl_expired.labels(**labels)
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig.",
            ("block_size", "cache_dtype", "enable_prefix_caching", "engine"),
            registry=r,
        )
        info.labels(
            block_size=str(block_size), cache_dtype="auto", enable_prefix_caching="True", engine=engine
        ).set(1)

    def set_load(self, *, running: int, waiting: int, deferred: int, kv_usage: float) -> None:
        labels = self._labels
        self.running.labels(**labels).set(running)
        self.waiting.labels(**labels).set(waiting + deferred)
        self.waiting_by_reason.labels(**labels, reason="capacity").set(waiting)
        self.waiting_by_reason.labels(**labels, reason="deferred").set(deferred)
        self.kv_usage.labels(**labels).set(kv_usage)

    def add_engine_counts(
        self,
        *,
        prefix_queries: int,
        prefix_hits: int,
        external_queries: int,
        external_hits: int,
        preemptions: int,
        expired: int,
        local_compute: int,
        local_cache_hit: int,
        external: int,
    ) -> None:
        """Add the growth of the engine's cumulative counters since the last call."""
        labels = self._labels
        self.prefix_queries.labels(**labels).inc(prefix_queries)
        self.prefix_hits.labels(**labels).inc(prefix_hits)
        self.external_queries.labels(**labels).inc(external_queries)
        self.external_hits.labels(**labels).inc(external_hits)
        self.prompt_cached.labels(**labels).inc(local_cache_hit + external)
        self.prompt_tokens.labels(**labels).inc(local_compute + local_cache_hit + external)
        self.preemptions.labels(**labels).inc(preemptions)
        self.nixl_expired.labels(**labels).inc(expired)
        self.prompt_by_source.labels(**labels, source="local_compute").inc(local_compute)
        self.prompt_by_source.labels(**labels, source="local_cache_hit").inc(local_cache_hit)
        self.prompt_by_source.labels(**labels, source="external_kv_transfer").inc(external)

    def on_step(self, *, tokens: int, generated: int) -> None:
        if tokens:
            self._iteration_tokens_child.observe(tokens)
        if generated:
            self._generation_tokens_child.inc(generated)

    def on_token_gap(self, seconds: float) -> None:
        self._itl_child.observe(seconds)

    def on_finished(self, done: FinishedRequest) -> None:
        labels = self._labels
        self.request_success.labels(**labels, finished_reason=done.finished_reason).inc()
        self.ttft.labels(**labels).observe(done.ttft_s)
        self.e2e.labels(**labels).observe(done.e2e_s)
        self.queue_time.labels(**labels).observe(done.queue_s)
        self.prefill_time.labels(**labels).observe(done.prefill_s)
        self.decode_time.labels(**labels).observe(done.decode_s)
        self.inference_time.labels(**labels).observe(done.prefill_s + done.decode_s)
        if done.generation_tokens > 1:
            self.tpot.labels(**labels).observe(done.decode_s / (done.generation_tokens - 1))
        self.request_prompt_tokens.labels(**labels).observe(done.prompt_tokens)
        self.request_generation_tokens.labels(**labels).observe(done.generation_tokens)
        self.request_max_tokens.labels(**labels).observe(done.max_tokens)
        self.request_preemptions.labels(**labels).observe(done.preemptions)

    def on_transfer(self, *, seconds: float, num_bytes: int) -> None:
        self.nixl_xfer_time.labels(**self._labels).observe(seconds)
        self.nixl_bytes.labels(**self._labels).observe(num_bytes)

    def on_transfer_failed(self) -> None:
        self.nixl_failed.labels(**self._labels).inc()

    def on_lease_expired(self) -> None:
        self.nixl_expired.labels(**self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
