"""Server metrics through ``prometheus_client``: one registry per app, every series labelled
with ``model_name``, names a vLLM dashboard maps onto (``vllm:X`` is ``kern_X``; the table is
in docs/serve.md), plus kern's own cache counters and pool gauges.

Design notes
------------
* Counters and histograms are ``prometheus_client`` children bound to the model's label once,
  and written by the scheduler thread only (each keeps its own small lock, never contended
  but by a scrape). Per token the scheduler observes one inter-token gap or one TTFT; the
  generated-token counter moves once per step.
* Gauges are a snapshot: the scheduler replaces :attr:`Metrics.gauges` whole after every step
  (one attribute store, no lock) and a collector reads it at scrape time, so the pool gauges
  of one scrape come from one step. ``Cache`` itself is never read off the scheduler thread
  (PyO3 refuses a second borrow).
* Cache counters are counted from what ``make_room`` and ``wake`` return (``Evicted.Parked``
  and ``dropped``, ``Evicted.Dropped(parked)``, ``Woken.keys``), as the pool's contract asks.
* Pool gauges add up: once idle, ``kern_pool_pages_held`` is 0 and ``free + cached`` is the
  total (less the chunks state snapshots took, on a stateful model); slots likewise:
  ``free + held + cached == total``, where total is the slots the slot class has now (it grows
  from free chunks on demand).
* A request of ``n`` choices is ``n`` sequences: its prompt counts once
  (``Request.counts_prompt``: the prompt tokens, the prompt-length histogram and the prefix
  cache's queries and hits, all from its first sequence); every sequence counts in the
  request histograms and in ``request_success`` by its own finish reason. ``abort`` is a
  client that hung up, a shutdown, or a request the scheduler could not admit; a stop string
  is ``stop``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kern.pool import Stats

__all__ = ["FINISH_REASONS", "Metrics"]

FINISH_REASONS = ("stop", "length", "abort")

# Seconds. vLLM's buckets, with finer ones below 10 ms where a CPU model's steps land.
_TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# Gauge name -> help. The scheduler's snapshot holds exactly these keys.
GAUGES = {
    "kern_num_requests_running": "Requests running (in the batch): vllm:num_requests_running.",
    "kern_num_requests_waiting": "Requests queued for admission: vllm:num_requests_waiting.",
    "kern_kv_cache_usage_perc": "Fraction (0 to 1) of the device KV pages held by requests: "
    "vllm:kv_cache_usage_perc.",
    "kern_pool_pages_total": "Device KV pages the pool can give to requests.",
    "kern_pool_pages_free": "Device KV pages allocatable now without evicting.",
    "kern_pool_pages_cached": "Device KV pages the prefix cache holds.",
    "kern_pool_pages_held": "Device KV pages running requests hold (0 when idle).",
    "kern_pool_slots_total": "State slots (qwen3_5) the slot class has now.",
    "kern_pool_slots_free": "State slots of the slot class that nothing uses.",
    "kern_pool_slots_held": "State slots running requests hold (0 when idle).",
    "kern_pool_slots_cached": "State snapshots the prefix cache holds.",
    "kern_host_pages_free": "Host-tier pages free.",
    "kern_host_pages_parked": "Host-tier pages holding parked cache entries.",
    "kern_cache_nodes": "Nodes of the prefix tree.",
    "kern_device_arena_bytes": "Bytes of the device arena (KV pages and state slots).",
    "kern_host_arena_bytes": "Bytes of the host arena (0 without a host tier).",
}


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's length buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_model_len:
                return out
            out.append(value)
        exponent += 1


class Metrics:
    """The app's metrics and their registry (``registry``: what ``/metrics`` renders)."""

    def __init__(self, model_name: str = "kern", max_model_len: int = 32768) -> None:
        # The _created series double every counter's lines and no dashboard reads them.
        disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.gauges: dict[str, float] = dict.fromkeys(GAUGES, 0)
        # A scrape reads collectors in registration order, beside the scheduler thread. Gauges
        # first: a scrape whose gauges show a request finished also counts it (the scheduler
        # counts a finish before its step's snapshot), so "idle" never comes with stale counts.
        self.registry.register(_Snapshot(self))
        # Then the families, in this order (the order /metrics lists them in).
        family = _Families(self.registry, model_name)
        self._count_tokens(family)
        self._count_events(family)
        self._count_drafts(family)
        self._count_finishes(family)
        self._time_requests(family)
        self._measure_lengths(family, max_model_len)
        self.registry.register(_Labelled(ProcessCollector(registry=None), model_name))

    def _count_tokens(self, family: _Families) -> None:
        """Prompt and generated tokens, and the prefix cache's share of the prompts."""
        self.prompt_tokens = family.counter(
            "kern_prompt_tokens", "Prompt tokens admitted, once per request: vllm:prompt_tokens."
        )
        self.generation_tokens = family.counter(
            "kern_generation_tokens", "Tokens generated: vllm:generation_tokens."
        )
        self.prefix_queries = family.counter(
            "kern_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache, once per request: "
            "vllm:prefix_cache_queries.",
        )
        self.prefix_hits = family.counter(
            "kern_prefix_cache_hits",
            "Prompt tokens the prefix cache supplied, once per request: vllm:prefix_cache_hits.",
        )

    def _count_events(self, family: _Families) -> None:
        """What the scheduler did to requests, and the cache to its entries."""
        self.preemptions = family.counter(
            "kern_num_preemptions", "Running requests preempted: vllm:num_preemptions."
        )
        self.aborted = family.counter(
            "kern_aborted",
            "Requests ended by an abort (client hang-up, shutdown, not admissible).",
        )
        self.parked = family.counter("kern_parked", "Cache entries parked to host memory.")
        self.woken = family.counter("kern_woken", "Cache entries woken from host memory.")
        self.dropped_resident = family.counter(
            "kern_dropped_resident", "Cache entries dropped from the device."
        )
        self.dropped_parked = family.counter(
            "kern_dropped_parked", "Cache entries dropped from host memory."
        )

    def _count_drafts(self, family: _Families) -> None:
        """Speculative decoding: drafts verified and accepted."""
        self.spec_drafts = family.counter(
            "kern_spec_decode_num_drafts",
            "Verify steps of a sequence with at least one drafted token: "
            "vllm:spec_decode_num_drafts.",
        )
        self.spec_draft_tokens = family.counter(
            "kern_spec_decode_num_draft_tokens",
            "Drafted tokens verified: vllm:spec_decode_num_draft_tokens.",
        )
        self.spec_accepted_tokens = family.counter(
            "kern_spec_decode_num_accepted_tokens",
            "Drafted tokens accepted (equal to the target's own token): "
            "vllm:spec_decode_num_accepted_tokens.",
        )

    def _count_finishes(self, family: _Families) -> None:
        """Finished requests, by finish reason (a child per reason)."""
        success = Counter(
            "kern_request_success",
            "Requests finished, by finish reason: vllm:request_success.",
            ["model_name", "finished_reason"],
            registry=family.registry,
        )
        self.success = {r: success.labels(family.model_name, r) for r in FINISH_REASONS}

    def _time_requests(self, family: _Families) -> None:
        """Per-token and per-request latencies."""
        self.ttft = family.histogram(
            "kern_time_to_first_token_seconds",
            "Time to first token, from submit: vllm:time_to_first_token_seconds.",
            _TTFT_BUCKETS,
        )
        self.itl = family.histogram(
            "kern_inter_token_latency_seconds",
            "Time between two tokens of a request, per token: vllm:inter_token_latency_seconds.",
            _ITL_BUCKETS,
        )
        self.tpot = family.histogram(
            "kern_request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request: "
            "vllm:request_time_per_output_token_seconds.",
            _ITL_BUCKETS,
        )
        self.e2e = family.histogram(
            "kern_e2e_request_latency_seconds",
            "Submit to finish, per request: vllm:e2e_request_latency_seconds.",
            _REQUEST_BUCKETS,
        )
        self.queue_time = family.histogram(
            "kern_request_queue_time_seconds",
            "Submit to first admission: vllm:request_queue_time_seconds.",
            _REQUEST_BUCKETS,
        )
        self.prefill_time = family.histogram(
            "kern_request_prefill_time_seconds",
            "First admission to first token: vllm:request_prefill_time_seconds.",
            _REQUEST_BUCKETS,
        )
        self.decode_time = family.histogram(
            "kern_request_decode_time_seconds",
            "First token to finish: vllm:request_decode_time_seconds.",
            _REQUEST_BUCKETS,
        )
        self.inference_time = family.histogram(
            "kern_request_inference_time_seconds",
            "First admission to finish: vllm:request_inference_time_seconds.",
            _REQUEST_BUCKETS,
        )

    def _measure_lengths(self, family: _Families, max_model_len: int) -> None:
        """Prompt and answer lengths of finished requests, bucketed up to the context."""
        lengths = _token_buckets(max_model_len)
        self.prompt_len = family.histogram(
            "kern_request_prompt_tokens",
            "Prompt length of finished requests: vllm:request_prompt_tokens.",
            lengths,
        )
        self.generation_len = family.histogram(
            "kern_request_generation_tokens",
            "Tokens generated per finished request: vllm:request_generation_tokens.",
            lengths,
        )

    def snapshot(
        self,
        s: Stats,
        *,
        num_running: int,
        num_waiting: int,
        max_pages: int,
        arena_bytes: tuple[int, int],
    ) -> None:
        """Replace :attr:`gauges` with one step's values (scheduler thread): the pool's
        ``Stats``, the queue's lengths, the pages the pool can give requests and the arenas'
        sizes (device, host)."""
        # Pages requests hold: neither free nor the tree's. 0 when nothing runs.
        held = s.pages_used - s.resident_pages
        device_arena, host_arena = arena_bytes
        # One dict replaced whole: a scrape reads one step's values.
        self.gauges = {
            "kern_num_requests_running": num_running,
            "kern_num_requests_waiting": num_waiting,
            "kern_kv_cache_usage_perc": held / max_pages,
            "kern_pool_pages_total": max_pages,
            "kern_pool_pages_free": s.pages_free,
            "kern_pool_pages_cached": s.resident_pages,
            "kern_pool_pages_held": held,
            # The slot class's own slots (Stats.slots_free also counts free chunks it could
            # grow into, which pages may take as well): free + held + cached == total.
            "kern_pool_slots_total": s.slot_capacity,
            "kern_pool_slots_free": s.slot_capacity - s.slots_used,
            "kern_pool_slots_held": s.slots_used - s.resident_states,
            "kern_pool_slots_cached": s.resident_states,
            "kern_host_pages_free": s.host_pages_free,
            "kern_host_pages_parked": s.parked_pages,
            "kern_cache_nodes": s.num_nodes,
            "kern_device_arena_bytes": device_arena,
            "kern_host_arena_bytes": host_arena,
        }

    def finished(self, req: Any, reason: str, now: float) -> None:
        """Record a request's end (scheduler thread): ``req`` is a
        ``kern.engine.request.Request``."""
        self.success[reason].inc()
        if reason == "abort":
            self.aborted.inc()
        self.e2e.observe(now - req.t_submit)
        if req.t_admit:
            self.inference_time.observe(now - req.t_admit)
        if req.num_output:
            self.decode_time.observe(now - req.t_first)
        if req.num_output > 1:
            self.tpot.observe((now - req.t_first) / (req.num_output - 1))
        if req.counts_prompt:
            self.prompt_len.observe(len(req.prompt_ids))
        self.generation_len.observe(req.num_output)

    def value(self, name: str, **labels: str) -> float:
        """One sample's value (0 if absent), e.g. ``value("kern_aborted_total")``."""
        got = self.registry.get_sample_value(name, {"model_name": self.model_name, **labels})
        return 0.0 if got is None else got


class _Families:
    """Makes the app's counters and histograms in ``registry``, each a child bound to the
    model's ``model_name`` label."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name

    def counter(self, name: str, help_: str) -> Any:
        return Counter(name, help_, ["model_name"], registry=self.registry).labels(self.model_name)

    def histogram(self, name: str, help_: str, buckets: Sequence[float]) -> Any:
        return Histogram(
            name, help_, ["model_name"], buckets=buckets, registry=self.registry
        ).labels(self.model_name)


class _Snapshot(Collector):
    """The gauges, read from the scheduler's last snapshot at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snapshot = self.metrics.gauges  # replaced whole by the scheduler: one consistent step
        for name, help_ in GAUGES.items():
            family = GaugeMetricFamily(name, help_, labels=["model_name"])
            family.add_metric([self.metrics.model_name], snapshot[name])
            yield family


class _Labelled(Collector):
    """Another collector's metrics with a ``model_name`` label added to every sample."""

    def __init__(self, inner: Collector, model_name: str) -> None:
        self.inner = inner
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                labels = {**s.labels, "model_name": self.model_name}
                out.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
            yield out
