"""Serving benchmark: `pflash_plugin.server` (ours) against stock `llama_cpp.server`, and against
llama-cpp-python's own batched example server where its script is found (bench/upstream.py:
`PFLASH_UPSTREAM_SERVER`, and `PFLASH_UPSTREAM_SITE` for a llama-cpp-python built with libmtmd).

Both servers serve the demo model (gemma-3-270m Q4_K_M) and are driven by async httpx clients,
one server at a time, with the trials interleaved (ours, stock, ours, stock, ...) so that noise
on a shared machine hits both alike. Two measurements, medians over `--reps`:

(a) aggregate generation throughput: 4 concurrent /v1/completions (max_tokens=64, temperature=0),
    completion tokens counted from `usage`, over the wall time of the whole batch;
(b) time to first token (first SSE chunk with text) of 3 short streamed completions sent together,
    on an idle server and ~1 s after a long (>= 4K tokens, different each rep) prompt was sent,
    i.e. while that prompt is being prefilled.

Usage: python bench/serving.py [--reps 3] [--out bench/results/serving.json] [--quick]
Writes the JSON results, prints a markdown table, and (unless --quick) writes docs/serving.md
and docs/serving.png. Both servers are killed at exit, also on errors and signals.
"""
from __future__ import annotations

import os
import sys

# `python bench/serving.py` puts bench/ first on sys.path, where scripts such as bench/concurrent.py
# would shadow the standard library (asyncio imports concurrent.futures): move it last, behind the
# standard library, where `harness` is still found.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.append(sys.path.pop(0))

import argparse
import asyncio
import hashlib
import json
import random
import shlex
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, TypeVar

import httpx
from harness import REPO, ServerProcess, demo_model_path, machine, sse_events
from upstream import UpstreamServer, available, model_options

T = TypeVar("T")

# Deterministic pseudo-English for the long prompts: a fixed vocabulary and a seeded RNG.
WORDS = (
    "the a an of to in on at by for with from over under after before during between river mountain "
    "city village market garden library window harbor bridge forest engine letter story morning evening "
    "winter summer teacher farmer sailor doctor merchant painter soldier child family friend neighbor "
    "stranger walked carried opened closed remembered forgot discovered built painted wrote read sold "
    "bought crossed watched followed answered asked believed noticed quiet bright ancient narrow heavy "
    "gentle sudden distant familiar careful strange golden silver broken hidden crowded empty warm cold "
    "slowly quickly carefully often never always almost perhaps again together alone because although "
    "while until since and but or yet so then when where which who that this these those every each "
    "some many few several old new long short small large young tired happy curious patient stone "
    "paper glass wooden copper salt bread lamp road wall roof door field hill valley coast island "
    "storm rain wind snow light shadow silence voice song question answer promise secret journey"
).split()
NAMES = (
    "Amara Bruno Chiara Dmitri Elena Farid Greta Hiro Ines Jonas Kira Luca Mina Nikolai Oona Pavel "
    "Quinn Rosa Sven Tamar Umar Vera Wren Xavier Yara Zoltan"
).split()
# Prompts that keep generating for 64 tokens at temperature 0 (there is no `ignore_eos`).
THROUGHPUT_PROMPTS = (
    "{name} counted slowly from one to two hundred: 1, 2, 3, 4, 5,",
    "{name} wrote a long and detailed story about a lighthouse keeper who lived alone on a rocky island. Chapter 1.",
    "{name} wrote this list of one hundred fruits and vegetables, one per line:\n1. Apple\n2.",
    "{name} explained, step by step and in great detail, how a steam engine works. First,",
)
# ~20-token prompts for the TTFT probes.
SHORT_PROMPTS = (
    "{name} asked the old librarian a simple question about the history of the harbor town, and she said",
    "{name} opened the wooden door of the bakery in the quiet village by the river and saw",
    "{name} read the weather report this morning, which said that the storm over the northern coast would",
)


@dataclass
class Settings:
    """What one run measures; --quick shrinks it to a smoke test."""

    reps: int
    clients: int = 4
    max_tokens: int = 64
    short_max_tokens: int = 8
    long_min_tokens: int = 4096
    long_max_tokens: int = 8
    settle_s: float = 1.0
    trial_timeout_s: float = 300.0
    ready_timeout_s: float = 300.0


class BenchError(RuntimeError):
    """A server misbehaved: the message carries the request, the response and the log tail."""


# ---- processes (started, waited for and stopped by harness.ServerProcess) ----------------------
REFERENCE = "stock"  # the server whose tokenizer sizes the long prompts
SHOWN = {"ours": "pflash_plugin", "stock": "llama_cpp.server", "upstream": "example server"}  # names in reports


def make_servers(model_path: str, log_dir: Path, ours_args: list[str]) -> list[ServerProcess]:
    """Ours first, then stock, then the upstream example server where found: the interleaving order
    A, B, C, A, B, C. Labels are the result keys."""
    servers = [
        ServerProcess("ours", ["--n_ctx", "8192", "--max_concurrency", "4", *ours_args], log_dir=log_dir,
                      ready_paths=("/health", "/v1/models")),
        ServerProcess("stock", ["--model", model_path, "--n_ctx", "8192", "--interrupt_requests", "false"],
                      module="llama_cpp.server", log_dir=log_dir),
    ]
    if available():  # as ours: 4 sequences, 8,192 cells each (its n_ctx is the pool), n_batch 512
        options = model_options(model_path, slots=4, n_ctx=4 * 8192, gpu=False, n_batch=512, n_ubatch=512)
        servers.append(UpstreamServer("upstream", [], log_dir=log_dir, options={**options, "kv_unified": False}))
    return servers


def on_signal(signum: int, _frame: Any) -> None:
    """Turn SIGTERM/SIGHUP into SystemExit so the `finally` that stops the servers runs."""
    raise SystemExit(128 + signum)


# llama.cpp's model-loading chatter, hundreds of lines that would bury what a server said last
_LOAD_NOISE = ("llama_graph_n_input_tensors", "create_tensor", "llama_model_loader", "print_info", "load_tensors")


def log_tail(server: ServerProcess, n_lines: int = 40) -> str:
    try:
        lines = server.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join([line for line in lines if not line.startswith(_LOAD_NOISE)][-n_lines:])


def failure(server: ServerProcess, what: str, request: Any = None, response: Any = None) -> BenchError:
    """A BenchError with everything needed to report the misbehaviour precisely."""
    parts = [f"{SHOWN.get(server.label, server.label)}: {what}"]
    if request is not None:
        shown = dict(request)
        if isinstance(shown.get("prompt"), str) and len(shown["prompt"]) > 300:
            shown["prompt"] = shown["prompt"][:300] + f"... ({len(request['prompt'])} chars)"
        parts.append(f"request: POST /v1/completions {json.dumps(shown)}")
    if response is not None:
        parts.append(f"response: {response}")
    parts.append(f"server log ({server.log_path}), last lines:\n{log_tail(server)}")
    return BenchError("\n".join(parts))


def check_alive(server: ServerProcess) -> None:
    if server.proc is None or server.proc.poll() is not None:
        code = None if server.proc is None else server.proc.returncode
        raise failure(server, f"the server process exited (code {code})")


def wait_ready(server: ServerProcess, timeout_s: float) -> float:
    """harness's readiness poll (blocking: nothing else runs yet); its errors come with the log tail."""
    try:
        return server.wait_ready(timeout_s)
    except RuntimeError as error:
        raise failure(server, str(error)) from None


async def with_timeout(server: ServerProcess, what: str, awaitable: Awaitable[T], timeout_s: float) -> T:
    """A hung server becomes a BenchError with its status and log, not a stuck benchmark."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        raise failure(server, f"{what}: no answer within {timeout_s:.0f} s") from None


# ---- prompts ------------------------------------------------------------------------------------
def pseudo_english(seed: int, n_words: int) -> str:
    """Varied prose; a different seed gives a different text from its first word (no prefix reuse)."""
    rng = random.Random(seed)
    sentences: list[str] = []
    words = 0
    while words < n_words:
        length = rng.randint(6, 18)
        sentence = [rng.choice(WORDS) for _ in range(length)]
        sentences.append(" ".join(sentence).capitalize() + rng.choice(".....?!;"))
        words += length
    paragraphs = [" ".join(sentences[i : i + 6]) for i in range(0, len(sentences), 6)]
    return "\n\n".join(paragraphs)


def name_for(rep: int, slot: int) -> str:
    """A distinct name to begin each prompt of a rep (slots 0-9), so no prompt is served twice."""
    k = rep * 10 + slot
    return f"{NAMES[k % len(NAMES)]} {NAMES[(k // len(NAMES)) % len(NAMES)][0]}."


async def count_tokens(client: httpx.AsyncClient, server: ServerProcess, text: str) -> int:
    response = await client.post(server.url + "/extras/tokenize/count", json={"input": text})
    if response.status_code != 200:
        raise failure(server, "tokenize/count failed", None, f"{response.status_code} {response.text[:500]}")
    return int(response.json()["count"])


async def long_prompt(client: httpx.AsyncClient, server: ServerProcess, seed: int, min_tokens: int) -> tuple[str, int]:
    """Grow the prose until it has at least `min_tokens` tokens (about 1.2 tokens a word)."""
    n_words = int(min_tokens / 1.1)
    while True:
        text = pseudo_english(seed, n_words)
        n = await count_tokens(client, server, text)
        if n >= min_tokens:
            return text, n
        n_words = int(n_words * 1.1) + 1


# ---- requests -----------------------------------------------------------------------------------
@dataclass
class Completion:
    """One non-streamed completion, as the client saw it."""

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    text: str
    latency_s: float


@dataclass
class Streamed:
    """One streamed completion: when it was sent and when its first text arrived."""

    sent_at: float
    first_text_at: float | None = None
    done_at: float | None = None
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None

    @property
    def ttft_s(self) -> float:
        assert self.first_text_at is not None
        return self.first_text_at - self.sent_at


async def complete(client: httpx.AsyncClient, server: ServerProcess, prompt: str, max_tokens: int) -> Completion:
    """A non-streamed completion, checked: 200, sane usage, length finish means max_tokens tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    try:
        response = await client.post(server.url + "/v1/completions", json=body)
    except httpx.HTTPError as error:
        raise failure(server, f"transport error {error!r}", body) from None
    latency = time.perf_counter() - t0
    if response.status_code != 200:
        raise failure(server, "HTTP error", body, f"{response.status_code} {response.text[:1000]}")
    data = response.json()
    try:
        choice, usage = data["choices"][0], data["usage"]
        result = Completion(
            usage["prompt_tokens"], usage["completion_tokens"], choice["finish_reason"], choice["text"], latency
        )
    except (KeyError, IndexError, TypeError):
        raise failure(server, "malformed response", body, json.dumps(data)[:1000]) from None
    bad_length = result.finish_reason == "length" and result.completion_tokens != max_tokens
    if not 0 < result.completion_tokens <= max_tokens or bad_length or result.prompt_tokens <= 0:
        raise failure(server, "implausible usage", body, json.dumps(data)[:1000])
    return result


async def stream(client: httpx.AsyncClient, server: ServerProcess, prompt: str, max_tokens: int) -> Streamed:
    """A streamed completion; records the arrival of the first SSE chunk that carries text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    result = Streamed(sent_at=time.perf_counter())
    try:
        async with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise failure(server, "HTTP error", body, f"{response.status_code} {text[:1000]}")
            async for data in sse_events(response):
                payload = data.strip()
                if payload == "[DONE]":
                    result.done_at = time.perf_counter()
                    break
                read_chunk(server, body, result, payload)
    except httpx.HTTPError as error:
        raise failure(server, f"transport error {error!r}", body) from None
    if result.done_at is None or result.first_text_at is None:
        raise failure(server, "stream ended without [DONE] or without any text", body, repr(result))
    return result


def read_chunk(server: ServerProcess, body: dict, result: Streamed, payload: str) -> None:
    """Fold one SSE data payload into `result`; an error object is a BenchError."""
    now = time.perf_counter()
    try:
        data = json.loads(payload)
        if "error" in data:
            raise failure(server, "error event in the stream", body, payload[:1000])
        choice = data["choices"][0]
    except (json.JSONDecodeError, KeyError, IndexError, TypeError):
        raise failure(server, "malformed stream chunk", body, payload[:1000]) from None
    result.chunks += 1
    if choice.get("text"):
        if result.first_text_at is None:
            result.first_text_at = now
        result.text += choice["text"]
    if choice.get("finish_reason"):
        result.finish_reason = choice["finish_reason"]


# ---- trials -------------------------------------------------------------------------------------
async def throughput_trial(client: httpx.AsyncClient, server: ServerProcess, rep: int, cfg: Settings) -> dict:
    """`clients` different prompts at once; completion tokens over the wall time of the batch."""
    prompts = [p.format(name=name_for(rep, i)) for i, p in enumerate(THROUGHPUT_PROMPTS[: cfg.clients])]
    t0 = time.perf_counter()
    results = await with_timeout(
        server, "throughput batch",
        asyncio.gather(*(complete(client, server, p, cfg.max_tokens) for p in prompts)),
        cfg.trial_timeout_s,
    )
    wall = time.perf_counter() - t0
    tokens = sum(r.completion_tokens for r in results)
    return {
        "loadavg_1m_after": os.getloadavg()[0],
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "requests": [
            {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
             "finish_reason": r.finish_reason, "latency_s": r.latency_s, "text": r.text}
            for r in results
        ],
    }


async def short_burst(client: httpx.AsyncClient, server: ServerProcess, names: list[str], cfg: Settings) -> list[Streamed]:
    """The short probes, sent together."""
    prompts = [p.format(name=n) for p, n in zip(SHORT_PROMPTS, names)]
    return list(await asyncio.gather(*(stream(client, server, p, cfg.short_max_tokens) for p in prompts)))


async def ttft_trial(client: httpx.AsyncClient, server: ServerProcess, rep: int, prompt: str, cfg: Settings) -> dict:
    """Short probes on the idle server, then the same probes ~1 s after a long prompt was sent."""
    idle = await with_timeout(
        server, "idle TTFT probes",
        short_burst(client, server, [name_for(rep, 4 + i) for i in range(len(SHORT_PROMPTS))], cfg),
        cfg.trial_timeout_s,
    )

    async def busy() -> tuple[Streamed, list[Streamed]]:
        long_task = asyncio.create_task(stream(client, server, prompt, cfg.long_max_tokens))
        await asyncio.sleep(cfg.settle_s)
        if long_task.done():
            long_task.result()  # surfaces an error of the long request
        shorts = await short_burst(client, server, [name_for(rep, 7 + i) for i in range(len(SHORT_PROMPTS))], cfg)
        return await long_task, shorts

    long, shorts = await with_timeout(server, "TTFT probes beside a long prefill", busy(), cfg.trial_timeout_s)
    shorts_sent = min(s.sent_at for s in shorts)
    return {
        "loadavg_1m_after": os.getloadavg()[0],
        "idle_ttft_s": [s.ttft_s for s in idle],
        "busy_ttft_s": [s.ttft_s for s in shorts],
        "long_ttft_s": long.ttft_s,
        "long_total_s": (long.done_at or 0.0) - long.sent_at,
        "shorts_sent_after_s": shorts_sent - long.sent_at,
        # the probes really ran beside the prefill only if the long prompt had no token yet
        "overlapped_prefill": long.first_text_at is not None and long.first_text_at > shorts_sent,
        "shorts_first_before_long_first": sum(
            1 for s in shorts if long.first_text_at is not None and s.first_text_at is not None
            and s.first_text_at < long.first_text_at
        ),
    }


# ---- the run ------------------------------------------------------------------------------------
async def prepare(client: httpx.AsyncClient, servers: list[ServerProcess], cfg: Settings) -> dict:
    """Start both, wait for their routes, warm each with one request."""
    for server in servers:
        server.launch()
    info: dict[str, Any] = {}
    for server in servers:
        ready_s = wait_ready(server, cfg.ready_timeout_s)
        warm = await with_timeout(server, "warm-up", complete(client, server, "Hello, my name is", 8), cfg.trial_timeout_s)
        info[server.label] = {"ready_s": ready_s, "warmup_s": warm.latency_s, "argv": server.argv}
    return info


async def run_bench(cfg: Settings, servers: list[ServerProcess], code: dict) -> dict:
    """All trials, interleaved ours/stock within each rep and metric; notes the code the servers loaded."""
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.trial_timeout_s), limits=limits) as client:
        info = await prepare(client, servers, cfg)
        code["loaded"] = code_state()  # the servers import everything at startup: this is what runs
        reference = next(s for s in servers if s.label == REFERENCE)
        results: dict[str, Any] = {s.label: {"throughput": [], "ttft": []} for s in servers}
        for rep in range(cfg.reps):
            prompt, n_tokens = await long_prompt(client, reference, seed=1000 + rep, min_tokens=cfg.long_min_tokens)
            for server in servers:
                check_alive(server)
                trial = await throughput_trial(client, server, rep, cfg)
                results[server.label]["throughput"].append(trial)
                say(f"rep {rep + 1}/{cfg.reps} {server.label:5s} throughput {trial['tokens_per_s']:7.1f} tok/s")
            for server in servers:
                check_alive(server)
                trial = await ttft_trial(client, server, rep, prompt, cfg) | {"long_prompt_tokens": n_tokens}
                results[server.label]["ttft"].append(trial)
                say(f"rep {rep + 1}/{cfg.reps} {server.label:5s} TTFT idle {ms(median(trial['idle_ttft_s']))} "
                    f"beside {n_tokens}-token prefill {ms(median(trial['busy_ttft_s']))} "
                    f"(long TTFT {ms(trial['long_ttft_s'])}, overlapped={trial['overlapped_prefill']})")
        return {"servers": info, "trials": results}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def summarize(trials: dict) -> dict:
    """Medians over reps (of each rep's median probe) and the ratios the targets are about."""
    out: dict[str, Any] = {}
    for key, t in trials.items():
        out[key] = {
            "tokens_per_s": median([x["tokens_per_s"] for x in t["throughput"]]),
            "idle_ttft_s": median([median(x["idle_ttft_s"]) for x in t["ttft"]]),
            "busy_ttft_s": median([median(x["busy_ttft_s"]) for x in t["ttft"]]),
            "long_prompt_tokens": median([x["long_prompt_tokens"] for x in t["ttft"]]),
            "long_ttft_s": median([x["long_ttft_s"] for x in t["ttft"]]),
            "all_overlapped": all(x["overlapped_prefill"] for x in t["ttft"]),
            "probes_before_long_first_token": sum(x["shorts_first_before_long_first"] for x in t["ttft"]),
            "probes_beside_long": sum(len(x["busy_ttft_s"]) for x in t["ttft"]),
        }
        out[key]["ttft_ratio"] = out[key]["busy_ttft_s"] / out[key]["idle_ttft_s"]
    out["throughput_ratio"] = out["ours"]["tokens_per_s"] / out["stock"]["tokens_per_s"]
    if "upstream" in trials:
        out["upstream_throughput_ratio"] = out["ours"]["tokens_per_s"] / out["upstream"]["tokens_per_s"]
    out["targets"] = {
        "throughput_ratio>=2.5": out["throughput_ratio"] >= 2.5,
        "ours_ttft_ratio<=3": out["ours"]["ttft_ratio"] <= 3.0,
    }
    return out


def markdown_table(summary: dict, cfg: Settings) -> str:
    """A column per server measured, then ours over each of the others."""
    keys = [k for k in SHOWN if k in summary]
    ours, others = summary["ours"], keys[1:]
    n_long = int(ours["long_prompt_tokens"])

    def row(label: str, field_: str, scale: float, fmt: str, ratio_of_ours: bool = True) -> tuple[str, ...]:
        cells = [format(summary[k][field_] * scale, fmt) for k in keys]
        ratios = [f"{ours[field_] / summary[k][field_]:.2f}x" if ratio_of_ours else "" for k in others]
        return (label, *cells, *ratios)

    throughput = row(f"throughput, {cfg.clients} clients x {cfg.max_tokens} tokens (tok/s)", "tokens_per_s", 1, ".1f")
    throughput = (*throughput[:1 + len(keys)], *(f"**{r}**" for r in throughput[1 + len(keys):]))
    rows = [
        ("metric", *(f"{k} ({SHOWN[k]})" for k in keys), *(f"ours / {k}" for k in others)),
        ("---", *("---:" for _ in keys), *("---:" for _ in others)),
        throughput,
        row("TTFT, 3 short prompts, idle server (ms)", "idle_ttft_s", 1000, ".0f"),
        row(f"TTFT, same, beside a {n_long}-token prefill (ms)", "busy_ttft_s", 1000, ".0f"),
        row("TTFT beside prefill / idle", "ttft_ratio", 1, ".2f", ratio_of_ours=False),
    ]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


# ---- reporting ----------------------------------------------------------------------------------
def host_info() -> dict:
    """harness.machine() under the keys serving.json and docs/serving.md use, plus llama-cpp-python's version."""
    import llama_cpp

    host = machine()
    return {
        "nproc": len(os.sched_getaffinity(0)),  # the CPUs this process may use, not the host's count
        "cpu_model": host["cpu"],
        "platform": host["platform"],
        "python": host["python"],
        "llama_cpp_python": llama_cpp.__version__,
        "loadavg_at_start": list(host["load_at_start"]),
    }


def code_state() -> dict:
    """The commit and uncommitted edits of pflash_plugin: the tree may change, results must name their code."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout.rstrip("\n") if done.returncode == 0 else "unknown"

    digest = hashlib.sha256()
    for path in sorted((REPO / "pflash_plugin").rglob("*.py")):
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "subject": git("log", "-1", "--format=%s"),
        "uncommitted": [line[3:] for line in git("status", "--porcelain", "--", "pflash_plugin").splitlines()],
        "sha256": digest.hexdigest()[:16],
    }


def describe_code(code: dict) -> str:
    loaded = code["loaded"]
    text = f"`{loaded['commit']}` ({loaded['subject']})"
    if loaded["uncommitted"]:
        text += f" plus uncommitted changes to {', '.join(loaded['uncommitted'])}"
    text += f"; pflash_plugin sources sha256 {loaded['sha256']}"
    if code["changed_before_loaded"]:
        text += " -- WARNING: pflash_plugin changed while the servers started, the numbers may mix versions"
    elif code["changed_after_loaded"]:
        text += " (the tree was edited later in the run, after the servers had imported this version)"
    return text


def plot(summary: dict, trials: dict, path: Path) -> None:
    """Two panels: throughput, and TTFT idle vs beside the prefill; dots are the single reps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in SHOWN if k in summary]
    labels, colors = [SHOWN[k] for k in keys], ["tab:blue", "tab:gray", "tab:green"][:len(keys)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for i, key in enumerate(keys):
        left.bar(i, summary[key]["tokens_per_s"], color=colors[i])
        reps = [x["tokens_per_s"] for x in trials[key]["throughput"]]
        left.plot([i] * len(reps), reps, "k.", alpha=0.6)
    left.set_xticks(range(len(keys)), labels)
    left.set_ylabel("completion tokens/s")
    left.set_title(f"4 concurrent clients (ours/stock = {summary['throughput_ratio']:.2f}x)")
    width = 0.38
    for j, (field_, name) in enumerate((("idle_ttft_s", "idle"), ("busy_ttft_s", "beside long prefill"))):
        xs = [i + (j - 0.5) * width for i in range(len(keys))]
        right.bar(xs, [summary[k][field_] * 1000 for k in keys], width, label=name, edgecolor="k",
                  color=colors if j else "white", hatch=None if j else "//")
        for x, key in zip(xs, keys):
            reps = [median(t[field_]) * 1000 for t in trials[key]["ttft"]]
            right.plot([x] * len(reps), reps, "k.", alpha=0.6)
    right.set_xticks(range(len(keys)), labels)
    right.set_yscale("log")
    right.set_ylabel("TTFT (ms, log)")
    right.set_title("short streamed completions")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_docs(
    path: Path, table: str, summary: dict, host: dict, code: dict, command: str, cfg: Settings, png: Path
) -> None:
    """docs/serving.md: the table with what it takes to reproduce and to read it."""
    text = f"""# Serving benchmark: pflash_plugin vs llama_cpp.server{" and llama-cpp-python's example server" if "upstream" in summary else ""}

{table}

Targets: throughput ours/stock >= 2.5x: **{"met" if summary["targets"]["throughput_ratio>=2.5"] else "NOT met"}**;
ours TTFT beside a long prefill within 3x of idle: **{"met" if summary["targets"]["ours_ttft_ratio<=3"] else "NOT met"}**.

![serving benchmark]({png.name})

{details(summary)}

## Command

```
{command}
```

Code measured: {describe_code(code)}.

## Machine

- nproc: {host["nproc"]}, CPU: {host["cpu_model"]}
- {host["platform"]}, Python {host["python"]}, llama-cpp-python {host["llama_cpp_python"]}
- load average at start: {", ".join(f"{x:.2f}" for x in host["loadavg_at_start"])} (shared machine: expect noise)

## Method

- Model: the demo gemma-3-270m Q4_K_M. Ours: `python -m pflash_plugin.server --n_ctx 8192 --max_concurrency 4`;
  stock: `python -m llama_cpp.server --model <demo gguf> --n_ctx 8192 --interrupt_requests false`
  (one request at a time). Where its script is found (bench/upstream.py), llama-cpp-python's own batched
  example server too, as ours: 4 sequences of 8,192 cells, a KV stream each, n_batch 512, `store_logits`
  off. All on 127.0.0.1 with default thread settings, all up at once, only one driven at a time;
  trials interleaved ours, stock(, upstream), ours, ...; each warmed with one request.
- Throughput: {cfg.clients} async httpx clients each send one non-streamed `/v1/completions`
  (different short prompts that keep generating, `max_tokens={cfg.max_tokens}`, `temperature=0`);
  completion tokens from `usage`, summed, over the wall time from the first send to the last answer.
- TTFT: time from sending a streamed `/v1/completions` (~20-token prompt, `max_tokens={cfg.short_max_tokens}`)
  to the first SSE chunk that carries text. Three such probes are sent together, first on the idle server,
  then {cfg.settle_s:.0f} s after a streamed long prompt (>= {cfg.long_min_tokens} tokens of seeded pseudo-English,
  a different text each rep, `max_tokens={cfg.long_max_tokens}`) was sent, i.e. while it is being prefilled.
  Every probe prompt begins with a per-trial name, so no prefix cache helps either.
- Defaults the two commands leave in place: stock decodes on `n_threads` = nproc/2 and runs batches
  on `n_threads_batch` = nproc threads; ours runs a step that only decodes on half the physical cores
  or on all of them, whichever it measured faster for that many slots (`engine/threads.py`), and
  prefill batches on the physical cores; ours runs llama.cpp's flash attention (`flash_attn` auto),
  stock runs without it (its default `flash_attn=false`), which speeds up ours' long prefills.
- {cfg.reps} reps; each figure is the median over reps (of the median probe in a rep for TTFT).
  Raw numbers: `bench/results/serving.json`.
"""
    path.write_text(text)


def details(summary: dict) -> str:
    """What the medians hide: whether the probes ran beside the prefill and got served before it ended."""
    lines = ["## Details", ""]
    for key, label in ((k, SHOWN[k]) for k in SHOWN if k in summary):
        s = summary[key]
        lines.append(
            f"- {label}: the long prompt's own TTFT (about its prefill time, with the probes beside it) "
            f"{s['long_ttft_s'] * 1000:.0f} ms median; probes that got their first token before the long "
            f"prompt's first token: {s['probes_before_long_first_token']} of {s['probes_beside_long']}; "
            f"probes sent while the long prompt had no token yet, in every rep: {s['all_overlapped']}."
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="repetitions per measurement (medians over them)")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results/serving.json)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 rep, short outputs, no docs")
    parser.add_argument("--docs", type=Path, default=REPO / "docs", help="where serving.md/.png go")
    parser.add_argument("--log-dir", type=Path, default=REPO / "bench" / "results" / "logs", help="server logs")
    parser.add_argument("--ours-args", default="", help="extra flags for ours, e.g. '--n_threads 2'")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Settings(reps=1 if args.quick else args.reps)
    if args.quick:
        cfg.max_tokens, cfg.long_min_tokens = 16, 4096
    out: Path = args.out or REPO / "bench" / "results" / ("serving_quick.json" if args.quick else "serving.json")
    command = " ".join(["python", "bench/serving.py", *(argv if argv is not None else sys.argv[1:])])
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    host, code = host_info(), {"start": code_state()}
    servers = make_servers(demo_model_path(), args.log_dir, shlex.split(args.ours_args))
    try:
        measured = asyncio.run(run_bench(cfg, servers, code))
    except BenchError as error:
        say(f"\nBENCHMARK FAILED\n{error}")
        return 1
    finally:
        for server in servers:
            server.stop()
    code["end"] = code_state()
    code["changed_before_loaded"] = code["start"]["sha256"] != code["loaded"]["sha256"]
    code["changed_after_loaded"] = code["loaded"]["sha256"] != code["end"]["sha256"]
    if code["changed_before_loaded"]:
        say("WARNING: pflash_plugin changed while the servers started; the numbers may mix code versions")
    summary = summarize(measured["trials"])
    table = markdown_table(summary, cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": command, "machine": host, "code": code, "settings": cfg.__dict__, "summary": summary} | measured
    out.write_text(json.dumps(record, indent=2))
    print(table)
    if not args.quick:
        args.docs.mkdir(parents=True, exist_ok=True)
        png = args.docs / "serving.png"
        plot(summary, measured["trials"], png)
        write_docs(args.docs / "serving.md", table, summary, host, code, command, cfg, png)
    say(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
