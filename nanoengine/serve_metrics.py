"""Prometheus metrics for the server's ``GET /metrics``: what an operator graphs and alerts on.

They come from two places. The engine already counts what it does (``LLMEngine.stats()``:
queue lengths, KV blocks in use, preemptions, prefix-cache hits, tokens); a scrape reads those
counters on the engine thread, between steps, and exposes them as they are, so nothing is
counted twice and a step pays nothing for metrics. The latencies a client sees, the time to the
first token and the gap between tokens, exist only on the serving side: each request's
``RequestClock`` observes them into histograms as its outputs arrive on the event loop, and
counts the request once it ends, by how it ended (vLLM's ``request_success_total``, whose
``finished_reason`` is also "abort" for a client gone and "error" for a failed step here). A
request refused by ``--max-queued-requests`` never reaches a handler: the bound counts it
(``num_requests_rejected_total``, serve_security.py).

The names are vLLM's with the prefix ``nanoengine:`` instead of ``vllm:`` (e.g.
``nanoengine:num_requests_running``), and every series carries vLLM's ``model_name`` label, so a
dashboard built for vLLM needs only the prefix changed.
"""

import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "nanoengine:"
# Seconds. A CPU serves a first token in tens of milliseconds when idle, in tens of seconds
# behind a burst of long prompts; a token gap is one step, milliseconds (a GPU) to a second.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    """One registry per server: the engine's counters at scrape time, and the latency histograms."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from a request's arrival to its first token.",
            ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between two consecutive tokens of one request.",
            ["model_name"], buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.request_success = Counter(
            PREFIX + "request_success", "Requests ended, by how: stop, length, abort (client gone) or error.",
            ["model_name", "finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort", "error"):  # each series exists, at 0, from the start
            self.request_success.labels(model_name, reason)
        self.requests_rejected = Counter(  # serve_security.py's bound; at 0 without one
            PREFIX + "num_requests_rejected", "Requests refused (503) because --max-queued-requests were in flight.",
            ["model_name"], registry=self.registry).labels(model_name)
        self.stats: dict = {}
        self.registry.register(self)  # as a collector: ``collect`` below, called by ``render``

    def render(self, stats: dict) -> bytes:
        """Prometheus's text format, with the engine's counters taken from ``stats``."""
        self.stats = stats
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        s = self.stats

        def metric(family, name: str, documentation: str, value: float) -> Metric:
            m = family(PREFIX + name, documentation, labels=["model_name"])
            m.add_metric([self.model_name], value)
            return m

        yield metric(GaugeMetricFamily, "num_requests_running", "Requests in the running batch.",
                     s["num_requests_running"])
        yield metric(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be admitted.",
                     s["num_requests_waiting"])
        yield metric(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                     s["kvcache_blocks_in_use"] / s["num_kvcache_blocks"])
        yield metric(CounterMetricFamily, "num_preemptions", "Sequences preempted for lack of KV blocks.",
                     s["num_preemptions"])
        yield metric(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens whose K/V came from the prefix cache.",
                     s["prefix_cache_hit_tokens"])
        yield metric(CounterMetricFamily, "prompt_tokens", "Prompt tokens of the requests added.",
                     s["prompt_tokens"])
        yield metric(CounterMetricFamily, "generation_tokens", "Tokens generated.", s["generated_tokens"])
        # Speculative decoding (0 without it): the stats' own names.
        for name, documentation in (("spec_decode_num_drafts", "Sequences that brought drafts to a step."),
                                    ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
                                    ("spec_decode_num_accepted_tokens", "Draft tokens the target accepted.")):
            yield metric(CounterMetricFamily, name, documentation, s[name])

    def clock(self) -> "RequestClock":
        """Start timing a request that has just arrived."""
        return RequestClock(self)


class RequestClock:
    """One request's latencies: its first output is its TTFT, each later engine step that gives it
    tokens an inter-token gap (its ``n`` samples' tokens of one step are one gap, not ``n``)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.last = time.perf_counter()
        self.last_step: int | None = None
        self.finished = False

    def output(self, step: int) -> None:
        """Called as each engine output reaches the request's handler; ``step``: the step that made it."""
        if step == self.last_step:
            return
        now = time.perf_counter()
        first = self.last_step is None
        (self.metrics.time_to_first_token if first else self.metrics.inter_token_latency).observe(now - self.last)
        self.last, self.last_step = now, step

    def finish(self, reason: str) -> None:
        """Count the request as ended for ``reason``; only its first ending counts."""
        if not self.finished:
            self.finished = True
            self.metrics.request_success.labels(self.metrics.model_name, reason).inc()
