"""Prometheus metrics, built with ``prometheus_client`` (one registry per app).

Two name families, both rendered on ``/metrics``:

- ``gemmaserve_*``: HTTP request counts by endpoint and status, TTFT / TPOT / end-to-end latency histograms, and
  the engine's own numbers (tokens, finish reasons, queue and KV gauges, the backend's ``kv_stats``);
- ``vllm:*`` with a ``model_name`` label: the series routers, gateways and autoscalers written for vLLM read
  (``vllm:num_requests_running`` / ``_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries_total``
  / ``_hits_total`` (tokens), ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
  ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``, ``vllm:e2e_request_latency_seconds``).

Latencies are observed in the server when a request ends (from its arrival, so queueing is included); the
engine's numbers are read from :meth:`Engine.stats` at scrape time (a collector), so they are the engine's own.
Thread-safe: observed on the event loop, rendered in a worker thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client import exposition
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gemmaserve.engine.engine import EngineStats

logger = logging.getLogger(__name__)

disable_created_metrics()  # no ``*_created`` series (process-wide): scrapers read the values, not creation times

__all__ = ["ServerMetrics", "TTFT_BUCKETS", "TPOT_BUCKETS", "ITL_BUCKETS", "E2E_BUCKETS", "PREFIX", "CONTENT_TYPE"]

PREFIX = "gemmaserve"
CONTENT_TYPE = getattr(exposition, "CONTENT_TYPE_PLAIN_0_0_4", CONTENT_TYPE_LATEST)
"""Text format 0.0.4: what every Prometheus version and vLLM-era scraper reads (the library's newest is 1.0.0)."""
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)
"""vLLM's time-to-first-token buckets (both names use them)."""
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
"""gemmaserve's own per-token histogram: finer than vLLM's below 10 ms, where one decode step lands."""
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
"""vLLM's inter-token latency buckets, exactly: a fleet of vLLM and gemmaserve servers sums its buckets."""
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
"""vLLM's end-to-end request latency buckets, exactly (both names use them)."""


VLLM_LABELS = ["model_name", "engine"]
"""vLLM's labels on its series: the served model and the engine index (this process's data-parallel rank)."""


class ServerMetrics:
    """The app's registry: HTTP counters and latency histograms observed here, the engine's numbers collected
    from ``stats()`` at each scrape (``bind_engine``)."""

    def __init__(self, model_name: str = "", engine_index: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.engine = str(engine_index)  # vLLM's ``engine`` label: the data-parallel rank
        self._requests = Counter(f"{PREFIX}_requests", "HTTP generation requests by endpoint and status code.",
                                 ["endpoint", "status"], registry=self.registry)
        self._ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Request arrival to first generated token.",
                               buckets=TTFT_BUCKETS, registry=self.registry)
        self._tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                               "Mean time per generated token after the first.", buckets=TPOT_BUCKETS,
                               registry=self.registry)
        self._e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Request arrival to last token.",
                              buckets=E2E_BUCKETS, registry=self.registry)
        label, values = VLLM_LABELS, (model_name, self.engine)
        self._vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", label,
                                    buckets=TTFT_BUCKETS, registry=self.registry).labels(*values)
        self._vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive token deliveries "
                                   "in seconds.", label, buckets=ITL_BUCKETS, registry=self.registry).labels(*values)
        self._vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                                   label, buckets=E2E_BUCKETS, registry=self.registry).labels(*values)

    def bind_engine(self, stats: Callable[[], EngineStats]) -> None:
        """Collect the engine's numbers from ``stats()`` at every scrape. ``stats`` may raise TimeoutError (a tick
        that does not end, ``Engine.stats(timeout=...)``): the scrape then shows the last snapshot taken, or no
        engine families before the first one, instead of waiting."""
        self.registry.register(_EngineCollector(stats, self.model_name, self.engine))

    def record_request(self, endpoint: str, status: int) -> None:
        self._requests.labels(endpoint, str(status)).inc()

    def observe(self, ttft: float | None, tpot: float | None, e2e: float | None,
                gaps: Sequence[float] = ()) -> None:
        """One finished request: its TTFT, mean TPOT, end-to-end latency (None: not reached) and the gaps
        between its successive token deliveries."""
        for histograms, value in (((self._ttft, self._vllm_ttft), ttft), ((self._tpot,), tpot),
                                  ((self._e2e, self._vllm_e2e), e2e)):
            if value is not None:
                for histogram in histograms:
                    histogram.observe(value)
        for gap in gaps:
            self._vllm_itl.observe(gap)

    def render(self) -> bytes:
        """The exposition text (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """The engine snapshot as metric families, under both names."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, engine: str) -> None:
        self._stats = stats
        self._model = model_name
        self._engine = engine
        self._last: EngineStats | None = None  # the latest snapshot taken (served while the engine is stuck)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families are only known at collection time

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._last = self._stats()
        except TimeoutError as exc:
            logger.warning("/metrics: %s; serving the last engine snapshot", exc)
            if self._last is None:
                return
            stats = self._last
        yield from _gemmaserve_families(stats)
        yield from _vllm_families(stats, self._model, self._engine)


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=value)


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)


def _gemmaserve_families(stats: EngineStats) -> Iterator[Metric]:
    finished = CounterMetricFamily(f"{PREFIX}_request_finished", "Engine requests finished, by finish reason.",
                                   labels=["reason"])
    for reason, count in sorted(stats.finished.items()):
        finished.add_metric([reason], count)
    yield finished
    yield _counter("prompt_tokens", "Prompt tokens prefilled (including cached ones).", stats.prompt_tokens)
    yield _counter("generation_tokens", "Tokens generated.", stats.generated_tokens)
    yield _counter("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", stats.cached_tokens)
    yield _counter("engine_steps", "Scheduler ticks.", stats.num_steps)
    yield _counter("decode_failures", "Batched decode steps that failed.", stats.decode_failures)
    yield _counter("decode_rows_retried", "Rows retried alone after a failed decode step.", stats.decode_rows_retried)
    yield _counter("shared_prefix_waits", "Ticks a request waited for an earlier prompt's shared prefix blocks.",
                   stats.prefix_waits)
    hit_rate = stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
    yield _gauge("prefix_cache_hit_rate", "Cached / all prompt tokens since start.", hit_rate)
    yield _gauge("num_requests_running", "Requests prefilling or decoding.", stats.running)
    yield _gauge("num_requests_waiting", "Requests queued for admission.", stats.waiting)
    blocks = _kv_blocks(stats)
    for key in ("total", "used", "free"):
        if key in blocks:
            yield _gauge(f"kv_blocks_{key}", f"KV blocks ({key}).", blocks[key])
    if stats.cache is not None:
        cache = stats.cache
        pool = GaugeMetricFamily(f"{PREFIX}_prefix_cache_blocks", "Core prefix-cache pool blocks by state.",
                                 labels=["state"])
        for state, count in (("used", cache.used_blocks), ("free", cache.free_blocks),
                             ("evictable", cache.evictable_blocks), ("pinned", cache.pinned_blocks)):
            pool.add_metric([state], count)
        yield pool
    backend = GaugeMetricFamily(f"{PREFIX}_backend_kv", "The backend's own KV statistics (kv_stats), by name.",
                                labels=["stat"])
    for key, value in sorted(stats.kv.items()):
        backend.add_metric([key], value)
    yield backend


def _vllm_families(stats: EngineStats, model: str, engine: str) -> Iterator[Metric]:
    """vLLM's names and meanings, for routers and autoscalers built against vLLM."""
    def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"vllm:{name}", help_text, labels=VLLM_LABELS)
        family.add_metric([model, engine], value)
        return family

    def counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"vllm:{name}", help_text, labels=VLLM_LABELS)
        family.add_metric([model, engine], value)
        return family

    yield gauge("num_requests_running", "Number of requests in model execution batches.", stats.running)
    yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting)
    yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage(stats))
    yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                  stats.prompt_tokens)
    yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", stats.cached_tokens)
    yield counter("prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
    yield counter("generation_tokens", "Number of generation tokens processed.", stats.generated_tokens)


def kv_usage(stats: EngineStats) -> float:
    """``vllm:kv_cache_usage_perc``: the fuller of the KV block pool (blocks requests hold over all blocks; cached
    blocks no request holds count as free, as vLLM counts them) and the admission budget (KV tokens the admitted
    requests reserve over ``MAX_ACTIVE_KV_TOKENS``). Backends whose running rows keep their KV outside a block pool
    (hf, mlx: their pool is the prefix cache's) are measured by the budget alone; 1 means nothing more fits."""
    blocks = _kv_blocks(stats)
    busy = blocks.get("used", 0) - blocks.get("evictable", 0)
    pool = busy / blocks["total"] if blocks.get("total") else 0.0
    budget = stats.reserved_kv_tokens / stats.kv_token_budget if stats.kv_token_budget else 0.0
    return min(1.0, max(pool, budget))


def _kv_blocks(stats: EngineStats) -> dict[str, int]:
    """Block totals: the backend's ``blocks_*`` stats (``blocks_evictable``, cached blocks no request holds: 0 when
    not given), else the core prefix-cache pool's."""
    kv = stats.kv
    if all(f"blocks_{key}" in kv for key in ("total", "used", "free")):
        blocks = {key: int(kv[f"blocks_{key}"]) for key in ("total", "used", "free")}
        return {**blocks, "evictable": int(kv.get("blocks_evictable", 0))}
    if stats.cache is not None:
        cache = stats.cache
        return {"total": cache.num_blocks, "used": cache.used_blocks, "free": cache.free_blocks,
                "evictable": cache.evictable_blocks}
    return {}
