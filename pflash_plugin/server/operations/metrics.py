"""Prometheus metrics for /metrics, on a registry of the app's own (several apps per process in tests)."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ...engine.request import Usage
from ...engine.stats import SchedulerStats
from .llama_metrics import LlamaServerSeries

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
_RATIO_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0)


class Metrics:
    def __init__(self, engine_stats: Callable[[], dict[str, SchedulerStats]]) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        registry = self.registry
        self.requests = Counter("pflash_requests", "Finished requests", labels + ["finish_reason"], registry=registry)
        self.errors = Counter("pflash_errors", "Requests answered with an error", labels + ["status"],
                              registry=registry)
        self.prompt_tokens = Counter("pflash_prompt_tokens", "Prompt tokens (as the client sent them)", labels,
                                     registry=registry)
        self.cached_tokens = Counter("pflash_cached_prompt_tokens", "Prompt tokens reused from the prefix cache",
                                     labels, registry=registry)
        self.media_tokens = Counter("pflash_media_prompt_tokens", "Prompt tokens that images and audio take (of "
                                    "pflash_prompt_tokens)", labels, registry=registry)
        self.generated_tokens = Counter("pflash_generation_tokens", "Generated tokens", labels, registry=registry)
        self.ttft = Histogram("pflash_time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("pflash_inter_token_latency_seconds", "Mean time between generated tokens, per request",
                             labels, buckets=_LATENCY_BUCKETS, registry=registry)
        self.cut_at_shutdown = Counter(
            "pflash_requests_cut_at_shutdown", "Requests cut at shutdown, answered with a 503 or a stream's error "
            "event: where=engine at --shutdown_grace_s, where=server at the HTTP server's graceful-shutdown timeout",
            ["where"], registry=registry)
        self.pflash = _PflashMetrics(registry)
        self.registry.register(_EngineCollector(engine_stats))
        self.engine_stats = engine_stats
        self.llama = LlamaServerSeries()  # llama-server's llamacpp:* lines
        self.started = int(time.time())  # llama-server's Process-Start-Time-Unix header

    def finished(self, model: str, reason: str, usage: Usage, pflash: Any = None) -> None:
        """One finished request; `pflash`: its compression report (pflash.report.PflashReport), if
        it is to be counted (once for the n choices that share it)."""
        self.requests.labels(model, reason).inc()
        self.prompt_tokens.labels(model).inc(usage.prompt_tokens)
        self.cached_tokens.labels(model).inc(usage.cached_tokens)
        self.media_tokens.labels(model).inc(usage.media_tokens)
        self.generated_tokens.labels(model).inc(usage.completion_tokens)
        self.llama.count(usage)
        if usage.completion_tokens:
            self.ttft.labels(model).observe(usage.latency.ttft_ms / 1000.0)
        if usage.completion_tokens > 1:
            self.itl.labels(model).observe(usage.latency.decode_ms / 1000.0 / (usage.completion_tokens - 1))
        if pflash is not None:
            self.pflash.count(model, pflash)

    def render(self) -> bytes:
        return generate_latest(self.registry) + self.llama.render(self.engine_stats()).encode()


class _PflashMetrics:
    """What PFlash did to each finished request's prompt, from its report."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name"]
        self.compressed = Counter("pflash_prompts_compressed", "Prompts PFlash compressed", labels, registry=registry)
        self.skipped = Counter("pflash_prompts_skipped", "Prompts PFlash did not compress, by reason",
                               labels + ["reason"], registry=registry)
        self.failed = Counter("pflash_prompts_failed", "Prompts whose compression failed: prefilled in full",
                              labels, registry=registry)
        self.saved = Counter("pflash_prompt_tokens_saved", "Prompt tokens compression left out of the prefill",
                             labels, registry=registry)
        self.draft = Histogram("pflash_draft_seconds", "Drafter time per drafted prompt (forward, capture, scoring)",
                               labels, buckets=_LATENCY_BUCKETS, registry=registry)
        self.kept = Histogram("pflash_kept_ratio", "Fraction of the prompt kept, per compressed prompt", labels,
                              buckets=_RATIO_BUCKETS, registry=registry)

    def count(self, model: str, report: Any) -> None:
        """`report`: a pflash.report.PflashReport."""
        if report.draft_ms is not None:
            self.draft.labels(model).observe(report.draft_ms / 1000.0)
        if report.status == "compressed":
            self.compressed.labels(model).inc()
            self.saved.labels(model).inc(report.original_tokens - report.kept_tokens)
            self.kept.labels(model).observe(report.keep_ratio)
        elif report.status == "skipped":
            self.skipped.labels(model, report.cause or "other").inc()
        else:
            self.failed.labels(model).inc()


class _EngineCollector:
    """Gauges read at scrape time from the stats each engine publishes after every step (never from
    HTTP-side counters). The first three are the model server protocol's of the Gateway API Inference
    Extension (TotalQueuedRequests, TotalRunningRequests, KVCacheUtilization) that its endpoint
    picker reads: names and meanings in docs/metrics.md."""

    def __init__(self, engine_stats: Callable[[], dict[str, SchedulerStats]]) -> None:
        self.engine_stats = engine_stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        label = ["model_name"]
        waiting = GaugeMetricFamily(
            "pflash_num_requests_waiting",
            "Requests accepted and not in a slot: queued for one, or for or in PFlash compression", labels=label)
        running = GaugeMetricFamily(
            "pflash_num_requests_running", "Requests in a slot (prefilling or decoding)", labels=label)
        kv = GaugeMetricFamily(
            "pflash_kv_cache_usage_perc",
            "Fraction of KV pool pages held by requests in slots (0-1); idle prefix caches count as free",
            labels=label)
        compressing = GaugeMetricFamily(
            "pflash_num_requests_compressing", "Requests queued for or in PFlash compression (part of waiting)",
            labels=label)
        prefix = GaugeMetricFamily(
            "pflash_prefix_cache_usage_perc",
            "Fraction of KV pool pages held only by idle slots' prefix caches (0-1), evicted when needed",
            labels=label)
        info = GaugeMetricFamily(
            "pflash_cache_config_info", "KV pool geometry: block_size (tokens per page), num_gpu_blocks (pages)",
            labels=[*label, "block_size", "num_gpu_blocks"])
        reused = CounterMetricFamily(
            "pflash_prefix_reused_tokens", "Prompt tokens whose KV was reused instead of prefilled, by where it came "
            "from: in_place (the slot's own cells), copied (another slot's), restored (the host-RAM tier, --cache)",
            labels=[*label, "source"])
        host = GaugeMetricFamily("pflash_host_cache_bytes", "Bytes of saved sequence states in the host-RAM tier",
                                 labels=label)
        for name, stats in self.engine_stats().items():
            total, compressing_now = stats.cache.kv_pages_total, len(stats.compressing)
            waiting.add_metric([name], stats.waiting + compressing_now)
            running.add_metric([name], stats.running)
            kv.add_metric([name], stats.cache.kv_pages_active / total)
            compressing.add_metric([name], compressing_now)
            prefix.add_metric([name], stats.kv_pages_held_by_caches / total)
            info.add_metric([name, str(stats.cache.kv_page_size), str(total)], 1)
            for source, tokens in stats.cache.prefix_reused_tokens.items():
                reused.add_metric([name, source], tokens)
            host.add_metric([name], stats.cache.host.bytes if stats.cache.host else 0)
        yield from (waiting, running, kv, compressing, prefix, info, reused, host)
        yield from _speculation(self.engine_stats())


def _speculation(engines: dict[str, SchedulerStats]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Speculative decoding's counters (vLLM's spec_decode names), for the engines that speculate."""
    label = ["model_name"]
    drafts = CounterMetricFamily("pflash_spec_decode_num_drafts", "Decode rows that carried draft tokens", labels=label)
    drafted = CounterMetricFamily("pflash_spec_decode_num_draft_tokens", "Draft tokens verified", labels=label)
    accepted = CounterMetricFamily("pflash_spec_decode_num_accepted_tokens", "Draft tokens the model accepted",
                                   labels=label)
    per_step = GaugeMetricFamily("pflash_spec_decode_tokens_per_step", "Tokens a decoding request took per step, "
                                 "since start (1 without speculation)", labels=label)
    probes = CounterMetricFamily("pflash_spec_decode_probes", "Episodes of drafting begun (speculation/budget.py)",
                                 labels=label)
    seconds = CounterMetricFamily("pflash_spec_decode_step_seconds", "Decode steps' wall time: with drafts "
                                  "(draft), the plain steps right after them (settle), the others (plain)",
                                  labels=[*label, "kind"])
    unpaid = CounterMetricFamily("pflash_spec_decode_unpaid_seconds", "Drafted steps' measured excess over plain "
                                 "steps that accepted tokens did not pay back", labels=label)
    speculating = {name: stats.speculation for name, stats in engines.items() if stats.speculation is not None}
    if not speculating:  # no family without samples: a scraper reading each family's first sample finds one
        return
    for name, spec in speculating.items():
        drafts.add_metric([name], spec.speculating_rows)
        drafted.add_metric([name], spec.drafted)
        accepted.add_metric([name], spec.accepted)
        per_step.add_metric([name], spec.tokens / spec.rows if spec.rows else 1.0)
        probes.add_metric([name], spec.probes)
        for kind, value in (("draft", spec.draft_step_seconds), ("settle", spec.settle_step_seconds),
                            ("plain", spec.plain_step_seconds)):
            seconds.add_metric([name, kind], value)
        unpaid.add_metric([name], spec.unpaid_seconds)
    yield from (drafts, drafted, accepted, per_step, probes, seconds, unpaid)
