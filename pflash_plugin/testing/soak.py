"""A mixed soak against a live server: every kind of request a client sends, good and bad, each
judged by what came back. Shared by bench/soak.py (the long run on the demo model) and
tests/test_soak.py (a bounded run on tiny models), so the suite runs the benchmark's workload.

Results per request: ok (a whole answer), rejected (the expected 4xx), abandoned (the client left
on purpose), and the failures: lost (no answer and no error: a dropped connection, a truncated
stream), hung (nothing by the deadline), 5xx, stream_error (an error event inside a 200 stream),
unexpected (another status than the kind expects).
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx

from .haystack import needle_prompt, prose
from .native_fuzz import alternation, nested_optionals

FAILURES = ("lost", "hung", "5xx", "stream_error", "unexpected")


@dataclass(frozen=True)
class Workload:
    url: str
    model: str  # served with PFlash auto and a threshold under `long_words`
    other_model: str  # a second model: routing, and a real 404 for an unknown name
    long_words: int  # a prompt over the PFlash threshold and under max_ctx
    over_long_words: int  # a prompt over max_ctx: 400
    api_key: str | None = None
    max_body_bytes: int = 8 * 2**20  # the server's limit: one byte more gets 413
    max_tokens: int = 8  # of the ordinary requests
    abandoned_max_tokens: int = 128  # of the requests whose client leaves: the decoding a cancel saves
    concurrency: int = 8
    deadline_s: float = 120.0  # a request not answered by then is hung

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class Reply:
    status: int | None  # None: no HTTP response
    complete: bool = False  # JSON with choices, or a stream up to [DONE]
    abandoned: bool = False  # the client left on purpose
    stream_error: str | None = None
    pflash: str | None = None  # usage.timings.pflash.status, when reported
    detail: str = ""


@dataclass
class Outcome:
    index: int
    kind: str
    result: str
    status: int | None
    seconds: float
    pflash: str | None = None
    detail: str = ""


# ---- transports ------------------------------------------------------------------------------
async def post(client: httpx.AsyncClient, path: str, body: dict | None = None,
               content: bytes | AsyncIterator[bytes] | None = None, headers: dict | None = None,
               give_up_after: float | None = None) -> Reply:
    """A non-streamed request; with `give_up_after` the client leaves after that many seconds."""
    extra: dict[str, Any] = {"timeout": give_up_after} if give_up_after is not None else {}
    try:
        if body is not None:
            r = await client.post(path, json=body, headers=headers, **extra)
        else:
            json_headers = {"Content-Type": "application/json", **(headers or {})}
            r = await client.post(path, content=content, headers=json_headers, **extra)
    except httpx.TimeoutException as error:
        return Reply(None, abandoned=give_up_after is not None, detail=repr(error))
    except httpx.TransportError as error:
        return Reply(None, detail=repr(error))
    if r.status_code != 200:
        return Reply(r.status_code, detail=r.text[:300])
    try:
        data = r.json()
    except ValueError:
        return Reply(200, detail=f"not JSON: {r.text[:300]}")
    return Reply(200, complete=bool(data.get("choices")), pflash=_pflash_status(data.get("usage")),
                 detail="" if data.get("choices") else r.text[:300])


async def stream(client: httpx.AsyncClient, path: str, body: dict, headers: dict,
                 leave_after: int | None = None) -> Reply:
    """Read an SSE answer to [DONE], or close the connection after `leave_after` data events."""
    try:
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", path, json=streamed, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return Reply(r.status_code, detail=r.text[:300])
            events, pflash = 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return Reply(200, complete=True, pflash=pflash)
                try:
                    chunk = json.loads(line[6:])
                except ValueError:
                    return Reply(200, detail=f"not JSON: {line[:300]}")
                if "error" in chunk:
                    return Reply(200, stream_error=chunk["error"].get("type") or "error", detail=line[:300])
                pflash = _pflash_status(chunk.get("usage")) or pflash
                events += 1
                if leave_after is not None and events >= leave_after:
                    return Reply(200, abandoned=True)
            return Reply(200, detail="stream ended without [DONE]")
    except httpx.TransportError as error:
        return Reply(None, detail=repr(error))


def _pflash_status(usage: dict | None) -> str | None:
    return ((usage or {}).get("timings") or {}).get("pflash", {}).get("status")


# ---- request kinds ---------------------------------------------------------------------------
Kind = Callable[[Workload, httpx.AsyncClient, random.Random], Awaitable[Reply]]
OK, ABANDON, ANY_4XX = "ok", "abandon", frozenset(range(400, 500))


def short_prompt(rng: random.Random) -> str:
    return " ".join(prose(rng, rng.randint(1, 3)))


def sampling(w: Workload, rng: random.Random) -> dict:
    return {"max_tokens": rng.randint(1, w.max_tokens), "temperature": rng.choice([0, 0.7, 1.0]),
            "seed": rng.randint(0, 999)}


def chat_body(w: Workload, rng: random.Random) -> dict:
    return {"model": w.model, "messages": [{"role": "user", "content": short_prompt(rng)}], **sampling(w, rng)}


def completion_body(w: Workload, rng: random.Random, model: str | None = None) -> dict:
    return {"model": model or w.model, "prompt": short_prompt(rng), **sampling(w, rng)}


def abandoned_body(w: Workload, rng: random.Random) -> dict:
    """A completion its client leaves early: long enough to be still running then."""
    return completion_body(w, rng) | {"max_tokens": w.abandoned_max_tokens}


def long_body(w: Workload, rng: random.Random, pflash: dict | None) -> dict:
    prompt, _ = needle_prompt(w.long_words, rng.random(), rng.randint(0, 10**6))
    body = {"model": w.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return body | ({"pflash": pflash} if pflash else {})


async def cancel_early(w: Workload, client: httpx.AsyncClient, rng: random.Random) -> Reply:
    """The client leaves before any response byte (or as the first arrive)."""
    task = asyncio.ensure_future(stream(client, "/v1/completions", abandoned_body(w, rng), w.headers))
    await asyncio.sleep(rng.uniform(0.0, 0.05))
    if task.done():
        return task.result()
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return Reply(None, abandoned=True)


def give_up(w: Workload, client: httpx.AsyncClient, rng: random.Random) -> Awaitable[Reply]:
    """A non-streamed request whose client times out while the server decodes."""
    body = abandoned_body(w, rng)
    return post(client, "/v1/completions", body, headers=w.headers, give_up_after=rng.uniform(0.05, 0.5))


def wrong_type(w: Workload, client: httpx.AsyncClient, rng: random.Random) -> Awaitable[Reply]:
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": 5}),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}),
        ("/v1/completions", {"prompt": "x", "temperature": [1]}),
        ("/v1/completions", {"prompt": "x", "stop": 3}),
        ("/v1/completions", {"prompt": "x", "pflash": {"mode": "sometimes"}}),
        ("/v1/completions", {"prompt": "x", "pflash": {"keep_ratio": 2}}),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"not-a-token": "high"}}),
        ("/v1/chat/completions", {"messages": "hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "nobody", "content": "x"}]}),
        ("/extras/detokenize", {"tokens": ["a"]}),
    ]
    path, body = rng.choice(cases)
    return post(client, path, {"model": w.model, **body}, headers=w.headers)


def oversized(w: Workload, client: httpx.AsyncClient, rng: random.Random) -> Awaitable[Reply]:
    """One KiB over the limit, with a Content-Length or chunked (then the server must count)."""
    body = b'{"prompt": "' + b"a" * (w.max_body_bytes + 1024) + b'"}'

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 2**16):
            yield body[i:i + 2**16]

    return post(client, "/v1/completions", content=body if rng.random() < 0.5 else chunks(), headers=w.headers)


def over_long(w: Workload, client: httpx.AsyncClient, rng: random.Random) -> Awaitable[Reply]:
    prompt, _ = needle_prompt(w.over_long_words, 0.5, rng.randint(0, 10**6))
    return post(client, "/v1/completions", {"model": w.model, "prompt": prompt, "max_tokens": 4}, headers=w.headers)


# name: (weight, expected, request). Mostly short requests; long ones are few and costly.
KINDS: dict[str, tuple[int, str | frozenset[int], Kind]] = {
    "completion": (16, OK, lambda w, c, r: post(c, "/v1/completions", completion_body(w, r), headers=w.headers)),
    "chat": (8, OK, lambda w, c, r: post(c, "/v1/chat/completions", chat_body(w, r), headers=w.headers)),
    "stream": (14, OK, lambda w, c, r: stream(c, "/v1/completions", completion_body(w, r), w.headers)),
    "stream_chat": (6, OK, lambda w, c, r: stream(c, "/v1/chat/completions", chat_body(w, r), w.headers)),
    "long_pflash_off": (2, OK, lambda w, c, r: post(c, "/v1/completions", long_body(w, r, {"mode": "off"}),
                                                    headers=w.headers)),
    "long_pflash_auto": (2, OK, lambda w, c, r: post(c, "/v1/completions", long_body(w, r, None), headers=w.headers)),
    "long_pflash_always": (2, OK, lambda w, c, r: stream(
        c, "/v1/completions", long_body(w, r, {"mode": "always", "keep_ratio": 0.3}), w.headers)),
    "other_model": (5, OK, lambda w, c, r: post(c, "/v1/completions", completion_body(w, r, w.other_model),
                                                headers=w.headers)),
    "cancel_mid_stream": (6, ABANDON, lambda w, c, r: stream(c, "/v1/completions", abandoned_body(w, r), w.headers,
                                                             leave_after=2)),
    "cancel_before_first_byte": (6, ABANDON, cancel_early),
    "client_gives_up": (5, ABANDON, give_up),
    "malformed_json": (4, ANY_4XX, lambda w, c, r: post(c, "/v1/completions", content=b'{"prompt": "x", "max_tokens": ',
                                                        headers=w.headers)),
    "wrong_type": (6, ANY_4XX, wrong_type),
    "over_long": (2, frozenset({400}), over_long),
    "unknown_model": (3, frozenset({404}), lambda w, c, r: post(
        c, "/v1/completions", completion_body(w, r, "no-such-model"), headers=w.headers)),
    "no_key": (3, frozenset({401}), lambda w, c, r: post(c, "/v1/completions", completion_body(w, r))),
    "oversized_body": (2, frozenset({413}), oversized),
}


# ---- hostile kinds (issues 22 and 49): each must get its 400 fast and leave the others' latency alone ----
def grammar_body(w: Workload, rng: random.Random, grammar: str) -> dict:
    return {"model": w.model, "prompt": short_prompt(rng), "max_tokens": 3, "grammar": grammar}


async def ambiguous_grammar(w: Workload, client: httpx.AsyncClient, rng: random.Random) -> Reply:
    """A grammar whose parse states multiply with every token in llama.cpp's grammar sampler, forced
    down that path by a bias: llguidance's parse does not grow, so it runs to its max_tokens (under
    `--constraint_engine llama` the token step over the engine's limit ends it with a 400)."""
    tokens = await client.post("/extras/tokenize", json={"model": w.model, "input": "a"}, headers=w.headers)
    bias = {str(tokens.json()["tokens"][-1]): 100}
    body = grammar_body(w, rng, 'root ::= r "x"\nr ::= "a" r "b" | "a" r "c" | "a"')
    return await post(client, "/v1/completions", body | {"max_tokens": 40, "temperature": 0, "logit_bias": bias},
                      headers=w.headers)


def huge_enum(w: Workload, client: httpx.AsyncClient, rng: random.Random) -> Awaitable[Reply]:
    schema = {"name": "e", "schema": {"enum": [f"value{i}" for i in range(2_000)]}}
    body = chat_body(w, rng) | {"response_format": {"type": "json_schema", "json_schema": schema}}
    return post(client, "/v1/chat/completions", body, headers=w.headers)


def deep_json(w: Workload, client: httpx.AsyncClient, rng: random.Random) -> Awaitable[Reply]:
    depth = rng.choice([200, 5_000])
    return post(client, "/v1/completions", content=b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}",
                headers=w.headers)


def heavy_stops(w: Workload, client: httpx.AsyncClient, rng: random.Random) -> Awaitable[Reply]:
    """As many stop strings as allowed, as long as allowed: answered, at no cost to the others."""
    stops = [f"{i:02d}" + "z" * 1022 for i in range(32)]
    return post(client, "/v1/completions", completion_body(w, rng) | {"stop": stops}, headers=w.headers)


# ---- issue 49's: requests that once cost a hundred normal ones, each now refused or bounded ----
def tool_history(w: Workload, client: httpx.AsyncClient, rng: random.Random) -> Awaitable[Reply]:
    """20,000 tool results (fewer under a small body limit), more than max_ctx holds: a 400, in linear time."""
    n = min(20_000, (w.max_body_bytes - 4_096) // 64)
    results = [{"role": "tool", "tool_call_id": "c", "content": "ok"} for _ in range(n)]
    body = chat_body(w, rng)
    return post(client, "/v1/chat/completions", body | {"messages": [*body["messages"], *results]}, headers=w.headers)


def huge_query(w: Workload, client: httpx.AsyncClient, rng: random.Random) -> Awaitable[Reply]:
    """A 2 MB PFlash query (less under a small body limit): refused by its length, before it is tokenized."""
    query = "q" * min(2_000_000, w.max_body_bytes - 4_096)
    body = chat_body(w, rng) | {"pflash": {"mode": "always", "query": query}}
    return post(client, "/v1/chat/completions", body, headers=w.headers)


def token_count(w: Workload, client: httpx.AsyncClient, rng: random.Random) -> Awaitable[Reply]:
    """A long prompt's text counted (the workload's long prompt, under max_ctx): on the tokenizer's own
    threads, a 429 when they and their queue are busy."""
    text = " ".join(prose(rng, max(w.long_words // 12, 1)))
    body = {"model": w.model, "messages": [{"role": "user", "content": text}]}
    return post(client, "/v1/messages/count_tokens", body, headers=w.headers)


HOSTILE: dict[str, tuple[int, str | frozenset[int], Kind]] = {
    "tool_history": (2, frozenset({400}), tool_history),
    "huge_query": (2, frozenset({400}), huge_query),
    "token_count": (3, frozenset({200, 429}), token_count),
    "negative_max_tokens": (1, frozenset({400}), lambda w, c, r: post(
        c, "/v1/chat/completions", chat_body(w, r) | {"max_tokens": -1}, headers=w.headers)),
    "nested_optionals": (2, frozenset({400}), lambda w, c, r: post(
        c, "/v1/completions", grammar_body(w, r, nested_optionals(17)), headers=w.headers)),
    "huge_alternation": (2, frozenset({400}), lambda w, c, r: post(
        c, "/v1/completions", grammar_body(w, r, alternation(5_000)),
        headers=w.headers)),
    "ambiguous_grammar": (1, OK, ambiguous_grammar),  # llguidance's answer (llama.cpp's sampler: a 400)
    "huge_enum": (2, frozenset({400}), huge_enum),
    "deep_json": (2, frozenset({400}), deep_json),
    "too_many_stops": (2, frozenset({400}), lambda w, c, r: post(
        c, "/v1/completions", completion_body(w, r) | {"stop": [f"s{i}" for i in range(33)]}, headers=w.headers)),
    "heavy_stops": (2, OK, heavy_stops),
}
ALL_KINDS = KINDS | HOSTILE


def plan(n: int, seed: int, api_key: bool = True, hostile: bool = False) -> list[str]:
    """n request kinds in proportion to their weights: shuffled blocks holding each kind `weight` times
    (the hostile kinds too, with `hostile`)."""
    kinds = ALL_KINDS if hostile else KINDS
    block = [k for k, (weight, _, _) in kinds.items() if api_key or k != "no_key" for _ in range(weight)]
    rng, order = random.Random(seed), list[str]()
    while len(order) < n:
        rng.shuffle(block)
        order += block
    return order[:n]


def judge(kind: str, reply: Reply) -> str:
    expected = ALL_KINDS[kind][1]
    if reply.status is not None and reply.status >= 500:
        return "5xx"
    if reply.stream_error:
        return "stream_error"
    if reply.abandoned:
        return "abandoned" if expected == ABANDON else "lost"
    if reply.status is None:
        return "lost"
    if expected in (OK, ABANDON):
        if reply.status == 200:
            return "ok" if reply.complete else "lost"
        return "unexpected"
    return "rejected" if reply.status in expected else "unexpected"


# ---- running ---------------------------------------------------------------------------------
async def run(w: Workload, kinds: list[str], seed: int, first_index: int = 0) -> list[Outcome]:
    """Send `kinds` with `w.concurrency` clients at a time; each request on its own connection."""
    gate = asyncio.Semaphore(w.concurrency)

    async def one(index: int, kind: str) -> Outcome:
        rng = random.Random(seed * 100_003 + index)
        async with gate, httpx.AsyncClient(base_url=w.url, timeout=w.deadline_s + 5) as client:
            t0 = time.perf_counter()
            try:
                reply = await asyncio.wait_for(ALL_KINDS[kind][2](w, client, rng), w.deadline_s)
            except asyncio.TimeoutError:
                reply = None
            seconds = time.perf_counter() - t0
        if reply is None:
            return Outcome(index, kind, "hung", None, seconds)
        return Outcome(index, kind, judge(kind, reply), reply.status, seconds, reply.pflash, reply.detail)

    return list(await asyncio.gather(*(one(first_index + i, k) for i, k in enumerate(kinds))))


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def summarize(outcomes: list[Outcome]) -> dict:
    results = Counter(o.result for o in outcomes)
    ok = sorted(o.seconds for o in outcomes if o.result == "ok")
    normal = sorted(o.seconds for o in outcomes if o.result == "ok" and o.kind in KINDS)
    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[o.result] += 1
    return {
        "requests": len(outcomes),
        "results": dict(results),
        "failures": {name: results.get(name, 0) for name in FAILURES},
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "pflash_compressed": sum(1 for o in outcomes if o.pflash == "compressed"),
        "ok_seconds": {"median": statistics.median(ok), "max": ok[-1]} if ok else None,
        # the ordinary kinds' answers alone: what a hostile mix may cost everyone else
        "normal_ok_seconds": {"median": statistics.median(normal), "p99": percentile(normal, 0.99)} if normal else None,
        "failed_examples": [o.__dict__ for o in outcomes if o.result in FAILURES][:10],
    }


# ---- the server after the soak ---------------------------------------------------------------
def idle_problems(status: dict) -> list[str]:
    """Why one model's /status is not idle: requests left, busy slots, KV pages not held by a cached prefix."""
    problems = [f"{key}={status[key]}" for key in ("running", "waiting") if status[key]]
    if status.get("compressing"):
        problems.append(f"compressing={len(status['compressing'])}")
    problems += [f"slot {s['id']} {s['state']}" for s in status["slots"] if s["state"] != "idle"]
    cached_pages = sum(s["kv_pages"] for s in status["slots"])
    if status["kv_pages_used"] > cached_pages:
        problems.append(f"kv_pages_used={status['kv_pages_used']} > {cached_pages} held by cached prefixes")
    return problems


async def wait_idle(w: Workload, timeout_s: float = 60.0) -> tuple[float, dict[str, list[str]], dict]:
    """Seconds until every model is idle (or the timeout), what is still not idle, and the last /status."""
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=w.url, timeout=10) as client:
        while True:
            models = (await client.get("/status", headers=w.headers)).json()["models"]
            problems = {name: p for name, s in models.items() if (p := idle_problems(s))}
            if not problems or time.perf_counter() - t0 > timeout_s:
                return time.perf_counter() - t0, problems, models
            await asyncio.sleep(0.1)


async def abandoned_tail(w: Workload, n: int, seed: int, max_tokens: int) -> dict:
    """`n` clients that leave early (time out, cancel before the first byte or mid-stream) from
    requests of `max_tokens`, and nothing else: the time until the pool is idle after they left
    says whether the server cancelled them (each would otherwise decode `max_tokens`)."""
    kinds = [kind for kind, (_, expected, _) in KINDS.items() if expected == ABANDON]
    plan = [kinds[i % len(kinds)] for i in range(n)]
    outcomes = await run(replace(w, abandoned_max_tokens=max_tokens), plan, seed, 10**6)
    idle_s, problems, _ = await wait_idle(w, timeout_s=300.0)
    return {"requests": n, "max_tokens": max_tokens, "results": dict(Counter(o.result for o in outcomes)),
            "idle_after_s": round(idle_s, 2), "not_idle": problems}


@dataclass
class SoakReport:
    summary: dict
    idle_after_s: float
    not_idle: dict[str, list[str]]
    status: dict = field(repr=False)


async def soak(w: Workload, n: int, seed: int = 0, hostile: bool = False) -> SoakReport:
    """The whole soak: `n` planned requests, then the pool must come back to idle."""
    outcomes = await run(w, plan(n, seed, api_key=w.api_key is not None, hostile=hostile), seed)
    idle_s, problems, status = await wait_idle(w)
    return SoakReport(summarize(outcomes), idle_s, problems, status)
