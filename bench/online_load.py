"""The client of the online benchmark, after `vllm bench serve` (vllm/benchmarks/serve.py): requests
sent at Poisson arrivals (exponential gaps at `rate`, seeded; the first at 0), each a streamed
/v1/completions; per request TTFT = the first chunk carrying text, ITL = the gaps between the
following text chunks, TPOT = (latency - TTFT) / (output tokens - 1), E2E latency. Per run:
percentiles pooled over its requests (numpy's linear interpolation, as vLLM), request and output
token throughput over the run's duration (first send to last answer), and goodput: requests/s that
met the objective (TTFT <= ttft_s and TPOT <= tpot_s: vLLM's `--goodput ttft:MS tpot:MS`).

A request still running `limit_s` after the run started is cut (its connection closed): it counts
as failed, so not as good; its TTFT, if it had none yet, enters the percentiles as the time it waited
(a lower bound, counted in `ttft_censored`).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from harness import sse_events
from online_data import Item


@dataclass(frozen=True)
class Objective:
    """A request is good when its TTFT and TPOT are within these (seconds)."""

    ttft_s: float
    tpot_s: float


@dataclass
class Outcome:
    """One request as the client saw it; times in seconds from the run's start."""

    kind: str
    prompt_tokens: int
    wanted_tokens: int
    sent_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float | None = None
    output_tokens: int = 0
    error: str | None = None
    censored: bool = False  # cut before its first token: ttft_s is the time it waited
    # the server's own account, where it gives one (ours: usage.timings): where a TTFT went on its side
    server_ms: dict[str, float] | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.latency_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets: a Poisson process at `rate` requests/s (vLLM's burstiness 1)."""
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(at)
        at += rng.expovariate(rate)
    return out


SERVER_MARKS = ("prepare_ms", "queue_ms", "compress_ms", "prefill_ms", "ttft_ms")  # of ours' usage.timings
# what ours' arms add to a request for those marks: the usage chunk (the peers' requests stay as they were)
OURS_FIELDS = {"stream_options": {"include_usage": True}}


def fold_chunk(outcome: Outcome, payload: str, sent: float, last: list[float]) -> None:
    """One SSE payload: text marks the first token or an inter-token gap; usage counts tokens."""
    now = time.perf_counter()
    data = json.loads(payload, strict=False)  # a raw newline in a string: joined data lines
    if "error" in data:
        raise RuntimeError(f"error event: {payload[:300]}")
    usage = data.get("usage")
    if usage:
        outcome.output_tokens = int(usage.get("completion_tokens", outcome.output_tokens))
        timings = usage.get("timings") or {}
        kept = {key: timings[key] for key in SERVER_MARKS if isinstance(timings.get(key), (int, float))}
        outcome.server_ms = kept or outcome.server_ms
    choices = data.get("choices") or [{}]
    if not choices[0].get("text"):
        return
    if outcome.ttft_s is None:
        outcome.ttft_s = now - sent
    else:
        outcome.itl_s.append(now - last[0])
    last[0] = now
    if not usage:
        outcome.output_tokens += 1


async def one_request(client: httpx.AsyncClient, url: str, body: bytes, outcome: Outcome, start: float) -> None:
    """Send at its offset, stream to the end; errors land in `outcome.error`."""
    await asyncio.sleep(max(0.0, start + outcome.sent_s - time.perf_counter()))
    sent, last = time.perf_counter(), [0.0]
    try:
        async with client.stream("POST", url + "/v1/completions", content=body,
                                 headers={"Content-Type": "application/json"}) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return
            async for payload in sse_events(response):
                if payload.strip() == "[DONE]":
                    break
                fold_chunk(outcome, payload, sent, last)
        outcome.latency_s = time.perf_counter() - sent
        if outcome.ttft_s is None:
            outcome.error = "no text"
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as error:
        outcome.error = f"{type(error).__name__}: {error}"[:300]


async def run_point(url: str, items: list[Item], bodies: list[bytes], rate: float, seed: int,
                    limit_s: float) -> tuple[list[Outcome], float]:
    """Every item sent at its Poisson offset; returns the outcomes and the run's duration."""
    offsets = arrivals(len(items), rate, seed)
    outcomes = [Outcome(item.kind, item.prompt_tokens, item.output_tokens, at) for item, at in zip(items, offsets)]
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(limit_s), limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(one_request(client, url, body, o, start)) for body, o in zip(bodies, outcomes)]
        done, pending = await asyncio.wait(tasks, timeout=limit_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    for o in outcomes:
        if o.latency_s is None and o.error is None:
            o.error = "cut at the run's limit"
            if o.ttft_s is None and o.sent_s < duration:
                o.ttft_s, o.censored = duration - o.sent_s, True
    ends = [o.sent_s + o.latency_s for o in outcomes if o.latency_s is not None]
    return outcomes, (max(ends) if len(ends) == len(outcomes) else duration)


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def summarize(outcomes: list[Outcome], duration: float, objective: Objective) -> dict[str, Any]:
    """vLLM's report fields (seconds, not ms), and goodput under `objective`."""
    done = [o for o in outcomes if o.error is None]
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    itl = [gap for o in outcomes for gap in o.itl_s]
    tpot = [o.tpot_s for o in done if o.tpot_s is not None]
    good = [o for o in done if o.ttft_s is not None and o.ttft_s <= objective.ttft_s
            and (o.tpot_s is None or o.tpot_s <= objective.tpot_s)]
    by_kind = {kind: [o.ttft_s for o in outcomes if o.kind == kind and o.ttft_s is not None]
               for kind in ("sharegpt", "long")}
    return {
        "requests": len(outcomes), "completed": len(done), "failed": len(outcomes) - len(done),
        "ttft_censored": sum(o.censored for o in outcomes),
        "short_outputs": sum(o.output_tokens < o.wanted_tokens for o in done),
        "duration_s": round(duration, 3),
        "request_throughput": round(len(done) / duration, 4),
        "output_throughput": round(sum(o.output_tokens for o in done) / duration, 2),
        "goodput": round(len(good) / duration, 4),
        "mean_ttft_s": round(float(np.mean(ttft)), 4) if ttft else None,
        "median_ttft_s": pct(ttft, 50), "p99_ttft_s": pct(ttft, 99),
        "median_itl_s": pct(itl, 50), "p99_itl_s": pct(itl, 99),
        "median_tpot_s": pct(tpot, 50), "p99_tpot_s": pct(tpot, 99),
        "median_e2el_s": pct([o.latency_s for o in done if o.latency_s is not None], 50),
        "p99_ttft_sharegpt_s": pct(by_kind["sharegpt"], 99), "p99_ttft_long_s": pct(by_kind["long"], 99),
    }


def record(outcome: Outcome) -> dict[str, Any]:
    """The raw numbers of one request, for the results file."""
    return {"kind": outcome.kind, "prompt_tokens": outcome.prompt_tokens, "wanted": outcome.wanted_tokens,
            "sent_s": round(outcome.sent_s, 4), "ttft_s": None if outcome.ttft_s is None else round(outcome.ttft_s, 4),
            "latency_s": None if outcome.latency_s is None else round(outcome.latency_s, 4),
            "output_tokens": outcome.output_tokens, "max_itl_s": round(max(outcome.itl_s), 4) if outcome.itl_s else None,
            "error": outcome.error, "server_ms": outcome.server_ms}
