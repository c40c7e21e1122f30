"""Structured output at decode speed: C clients with a JSON schema (a three-field pydantic-like
object, and a larger one) against plain rows, through llama.cpp's grammar sampler
(`--constraint_engine llama`, the path before issue 49) and llguidance (`llguidance`).

    python bench/constrained.py                 # the demo model on the CPU, 4 clients, 3 reps
    python bench/constrained.py --table-only    # the docs table again from docs/data/constrained_cpu.json

Each trial: C clients at once send one streamed /v1/completions each (distinct prompts, seeded
sampling at temperature 0.8; plain rows generate all of `--max-tokens` (min_tokens), schema rows
until their JSON closes or `--max-tokens`); tokens/s is every completion token over the trial's wall
time, ms/token the median over clients of each one's latency over its tokens (prefill included),
TTFT the median first text. /status is read before and after each trial: the engine's steps (decode
ms/step = wall over steps: person rows end at ~40 tokens, plain ones at 128, so rows of different
lengths compare by the step) and the constraint phases' ms a step (engine/constraint_masks.py
ConstraintCounts: bind, fill beside the decode (on its own thread) and the sampling's wait for it,
fill on the critical path, apply, settle/commit, the wait for the device's logits, host sampling;
docs/metrics.md), masked rows a step, dense share; and once every client has its first text, again:
"all started: ms/step" is the wall from there to the end over the steps from there, the decode
alone (wall over all steps carries the arrivals and prefills, over 40 steps for person rows and
128 for plain ones). All servers loaded at once, one driven at a time, reps interleaved kind by
kind (each rep starting at the next kind) and arm by arm; the load average before each trial and
`uptime` at the start and end are kept. Medians over reps go
to `--out` and to the table between the markers of `--docs`. bench/gpu/constrained_gpu.py runs it
on a GPU at 64 clients.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.append(sys.path.pop(0))  # as in bench/serving.py: bench/ must not shadow the standard library

import httpx
from harness import REPO, ServerProcess, arm_items, demo_model_path, machine, uptime
from host_overhead import remove_worktree, worktree

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "email": {"type": "string", "maxLength": 32}},
          "required": ["name", "age", "email"], "additionalProperties": False}
ITEM = {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 12},
                                         "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                                         "price": {"type": "number"}},
        "required": ["sku", "quantity", "price"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0},
    "customer": PERSON,
    "status": {"enum": ["new", "paid", "packed", "shipped", "delivered", "returned"]},
    "items": {"type": "array", "items": ITEM, "minItems": 1, "maxItems": 3},
    "express": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["gift", "fragile", "bulk", "priority"]}, "maxItems": 3},
    "notes": {"type": "string", "maxLength": 40},
    "discount": {"type": "number", "minimum": 0, "maximum": 1},
}, "required": ["id", "customer", "status", "items", "express"], "additionalProperties": False}
# plain_as_person: plain rows each as long as the same client's person row of the same rep on the same
# server (run right after it), so the two trials have the same answer lengths and the same rows
# ending step by step: the fair plain for person rows, which end at ~40 tokens against plain's 128
KINDS = {"plain": None, "person": PERSON, "order": ORDER, "plain_as_person": None}
SAME_LENGTHS = {"plain_as_person": "person"}
MARK = "<!-- bench/constrained.py: {} -->"
# /status's constraint phases (engine/constraint_masks.py ConstraintCounts), reported in ms per engine step
PHASES = ("bind_s", "fill_ahead_s", "fill_start_s", "fill_wait_s", "fill_due_s", "apply_s", "commit_s", "logits_wait_s", "sample_s")
PHASE_MS = [key.removesuffix("_s") + "_ms" for key in PHASES]
MEDIANS = ("tok_s", "ms_per_token", "tokens", "valid_json", "ttft_ms", "steps", "step_ms", "decode_step_ms", *PHASE_MS,
           "median_prepare_ms", "median_queue_ms", "median_prefill_ms",
           "masked_rows", "dense_share", "forced_share")


def body(kind: str, prompt: str, max_tokens: int, seed: int, llama_server: bool = False) -> dict[str, Any]:
    """One client's request: a plain row generates every token, a schema row until its JSON closes.
    llama-server takes the schema as `json_schema` on /v1/completions (its `response_format` is read on
    chat only) and generates every token with `ignore_eos`."""
    request: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed}
    schema = KINDS[kind]
    if llama_server:
        return {**request, "cache_prompt": False, **({"ignore_eos": True} if schema is None else {"json_schema": schema})}
    if schema is None:
        return {**request, "min_tokens": max_tokens}
    return {**request, "response_format": {"type": "json_schema", "json_schema": {"name": kind, "schema": schema}}}


def is_llama_server(server: ServerProcess) -> bool:
    """llama.cpp's llama-server (`--llama-server`): no /status, its own request fields."""
    return server.program is not None


async def trial(server: ServerProcess, kind: str, clients: int, max_tokens: int, rep: int,
                lengths: list[int] | None = None) -> dict[str, Any]:
    """C clients at once, streamed; tokens/s over the wall time, median ms/token and TTFT, JSON that
    parses, and from /status before and after: the engine's steps and the constraint phases' ms a
    step; and once every client has its first text, /status again: the decode's ms a step from there
    to the end (`decode_step_ms`), without the arrivals and prefills, which a trial of short rows
    spreads over fewer steps. `lengths`: client i asks for lengths[i] tokens (plain_as_person);
    each client's tokens are kept (`lengths`) for such a trial after this one. llama-server has no
    /status: tokens/s, ms/token and TTFT only."""
    all_started = asyncio.Event()
    firsts: list[float] = []
    spans: list[dict[str, float]] = []  # each request's usage.timings (ours)
    ours = not is_llama_server(server)

    async def one(i: int, http: httpx.AsyncClient) -> tuple[int, float, bool, float]:
        wanted = lengths[i] if lengths else max_tokens
        request = {**body(kind, f"Record {rep}.{i} of the shop's database, as JSON:", wanted, 1000 * (rep + 1) + i,
                          not ours),
                   "stream": True, "stream_options": {"include_usage": True}}
        started, first, text, tokens, timings = time.perf_counter(), None, "", 0, {}
        async with http.stream("POST", server.url + "/v1/completions", json=request) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    text += chunk["choices"][0].get("text") or ""
                    if first is None and text:
                        first = time.perf_counter()
                        firsts.append(first)
                        if len(firsts) == clients:
                            all_started.set()
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                timings = (chunk.get("usage") or {}).get("timings") or timings
        done = time.perf_counter()
        spans.append(timings)
        return tokens, done - started, _parses(text), (first or done) - started

    async def decoding(http: httpx.AsyncClient) -> tuple[float, dict[str, Any]]:
        await all_started.wait()
        return time.perf_counter(), await engine_counts(http, server.url)

    async with httpx.AsyncClient(timeout=1800) as http:
        load = os.getloadavg()[0]
        before = await engine_counts(http, server.url) if ours else {}
        start = time.perf_counter()
        mark = asyncio.create_task(decoding(http)) if ours else None
        results = await asyncio.gather(*(one(i, http) for i in range(clients)))
        wall = time.perf_counter() - start
        after = await engine_counts(http, server.url) if ours else {}
        if mark is not None and not mark.done():  # a client without text
            mark.cancel()
    tokens = sum(r[0] for r in results)
    row = {"tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2),
           "ms_per_token": round(statistics.median(1000 * s / max(t, 1) for t, s, _, _ in results), 1),
           "ttft_ms": round(1000 * statistics.median(r[3] for r in results), 1),
           "valid_json": sum(r[2] for r in results), "load_1m": load, "lengths": [r[0] for r in results],
           **(per_step(before, after, wall) if ours else {}), **span_medians(spans)}
    if mark is not None and mark.done() and not mark.cancelled():
        at, middle = mark.result()
        steps = after["steps"] - middle["steps"]
        row["decode_step_ms"] = round(1000 * (start + wall - at) / steps, 2) if steps > 0 else None
    return row


SPANS = ("prepare_ms", "queue_ms", "prefill_ms")  # where a request's first token waited (usage.timings)


def span_medians(spans: list[dict[str, float]]) -> dict[str, float]:
    """The median over the trial's requests of each of SPANS (the server reports them: ours)."""
    return {f"median_{key}": round(statistics.median(t[key] for t in spans), 1)
            for key in SPANS if spans and all(key in t for t in spans)}


async def engine_counts(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """The served model's steps and constraint counters (sums since start) from /status."""
    model = next(iter((await http.get(url + "/status")).json()["models"].values()))
    return {"steps": model["steps"], **(model.get("constraints") or {})}


def per_step(before: dict[str, Any], after: dict[str, Any], wall: float) -> dict[str, Any]:
    """The trial's engine steps, its wall ms a step, each phase's ms a step (PHASES), constrained
    rows masked a step and the shares of filled rows that were dense and forced (one token allowed)."""
    steps = max(after["steps"] - before["steps"], 1)
    row: dict[str, Any] = {"steps": after["steps"] - before["steps"], "step_ms": round(1000 * wall / steps, 2)}
    for key in PHASES:
        if key in after:
            row[key.removesuffix("_s") + "_ms"] = round(1000 * (after[key] - before[key]) / steps, 3)
    if "rows_masked" in after:
        row["fill_threads"] = after.get("fill_threads", 0)
        row["masked_rows"] = round((after["rows_masked"] - before["rows_masked"]) / steps, 1)
        filled = after["rows_filled"] - before["rows_filled"]
        row["dense_share"] = round((after["dense_rows"] - before["dense_rows"]) / filled, 3) if filled else 0.0
        if "rows_forced" in after:
            row["forced_share"] = round((after["rows_forced"] - before["rows_forced"]) / filled, 3) if filled else 0.0
    return row


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or demo_model_path()
    flags = ["--model", model, "--n_ctx", str(args.n_ctx), "--max_concurrency",
             str(args.slots), "--n_gpu_layers", str(args.gpu_layers), "--verbose", "false", *args.server_flags]
    ours = [arm for arm in args.arms if arm != "llama-server"]
    servers = {arm: ServerProcess(f"constrained-{arm}", [*flags, "--constraint_engine", arm]) for arm in ours}
    for arm in args.ours_arms:  # NAME=ITEMS: llguidance with those flags and environment too (harness.arm_items)
        name, extra, env = arm_items(arm)
        servers[name] = ServerProcess(f"constrained-{name}", [*flags, "--constraint_engine", "llguidance", *extra],
                                      env=env)
    if "llama-server" in args.arms:
        servers.update(llama_server(args, model))
    tree = worktree(args.baseline) if args.baseline else None
    if tree is not None:  # the same arms on another revision's code, for a before/after in one run
        base = Path(args.baseline).name.removesuffix(".tgz")  # a revision, or its archive's name
        servers.update({f"{arm}@{base}": ServerProcess(f"constrained-{arm}-base", [
            *flags, "--constraint_engine", arm], cwd=tree) for arm in ours})
    check_kinds(args.kinds)
    rows: list[dict[str, Any]] = []
    started = uptime()
    try:
        for server in servers.values():
            server.start(600)
            for kind in args.kinds:  # warm-up: the tokenizer, the schema's compile, the first decode
                asyncio.run(trial(server, kind, 1, 8, -1))
        for rep in range(args.reps):
            rows += one_rep(args, servers, rep)
    finally:
        for server in servers.values():
            server.stop()
        if tree is not None:
            remove_worktree(tree)
    medians = {f"{arm}/{kind}": _medians([r for r in rows if r["arm"] == arm and r["kind"] == kind])
               for arm in servers for kind in args.kinds}
    return {"command": " ".join(sys.argv), "clients": args.clients, "max_tokens": args.max_tokens,
            "reps": args.reps, "uptime_start": started, "uptime_end": uptime(), "machine": machine(),
            "medians": medians, "rows": rows}


def check_kinds(kinds: list[str]) -> None:
    """A same-lengths kind needs the kind whose lengths it takes (SAME_LENGTHS)."""
    for kind, source in SAME_LENGTHS.items():
        if kind in kinds and source not in kinds:
            raise SystemExit(f"--kinds {kind} takes its lengths from {source}: add {source}")


def one_rep(args: argparse.Namespace, servers: dict[str, ServerProcess], rep: int) -> list[dict[str, Any]]:
    """Every kind on every server once: each kind first after another in turn (the KV and caches the
    last left), each server first in turn; a same-lengths kind right after its source on the same
    server, with the lengths its clients got (SAME_LENGTHS)."""
    kinds = [kind for kind in args.kinds if kind not in SAME_LENGTHS]
    turn = rep % len(kinds)
    rows: list[dict[str, Any]] = []
    for kind in kinds[turn:] + kinds[:turn]:
        for arm, server in list(servers.items())[:: 1 if rep % 2 == 0 else -1]:
            lengths = None
            for name in [kind, *(k for k in args.kinds if SAME_LENGTHS.get(k) == kind)]:
                row = {"arm": arm, "kind": name, "rep": rep,
                       **asyncio.run(trial(server, name, args.clients, args.max_tokens, rep, lengths))}
                lengths = row["lengths"]
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "lengths"}), flush=True)
    return rows


def llama_server(args: argparse.Namespace, model: str) -> dict[str, ServerProcess]:
    """llama.cpp's llama-server (`--llama-server PATH`) with as many slots and cells a slot as ours,
    its schema through its own grammar sampler; none (and a message) without a binary here."""
    path = getattr(args, "llama_server", None)
    program = shutil.which(path) if path and path != "none" else None
    if program is None:
        print(f"llama-server arm skipped: no llama-server binary ({path or 'no --llama-server'})", file=sys.stderr)
        return {}
    layers = 999 if args.gpu_layers < 0 else args.gpu_layers
    return {"llama-server": ServerProcess("constrained-llama-server", [
        "-m", model, "--host", "127.0.0.1", "-c", str(args.slots * args.n_ctx), "-np", str(args.slots),
        "-ngl", str(layers), "-fa", "on", "--cache-ram", "0"], program=[program], ready_paths=("/health",))}


def _medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each of MEDIANS' median over the trials that have it."""
    values = {key: [r[key] for r in rows if r.get(key) is not None] for key in MEDIANS}
    return {key: statistics.median(found) for key, found in values.items() if found}


def table(result: dict[str, Any]) -> str:
    """The medians as a markdown table: per kind and arm, tokens/s and the engine's wall ms a step,
    each against the plain rows' on the same arm (rows of different lengths compare by the step),
    and against plain rows of the same lengths (SAME_LENGTHS: person rows against plain_as_person),
    TTFT, and where the run has them the constraint phases' ms a step."""
    medians = result["medians"]
    arms = sorted({key.split("/")[0] for key in medians})
    kinds = [kind for kind in KINDS if any(key.endswith("/" + kind) for key in medians)]
    phases = [key for key in PHASE_MS if any(key in m for m in medians.values())]
    same = {source: kind for kind, source in SAME_LENGTHS.items()}
    lines = ["| rows | arm | tok/s | x plain | x plain, same lengths | ms/token | decode ms/step | x plain "
             "| all started: ms/step | x plain | TTFT ms | steps | " + " | ".join(phases)
             + (" | masked rows | dense | forced |" if phases else ""),
             "|---|---|" + "---:|" * (10 + len(phases) + (3 if phases else 0))]
    for kind in kinds:
        for arm in arms:
            m, plain = medians.get(f"{arm}/{kind}"), medians.get(f"{arm}/plain")
            if not m:
                continue
            ratio = f"{m['tok_s'] / plain['tok_s']:.2f}x" if plain else "-"
            twin = medians.get(f"{arm}/{same[kind]}") if kind in same else None
            cells = [f"{m['tok_s']:.1f}", ratio, f"{m['tok_s'] / twin['tok_s']:.2f}x" if twin else "-",
                     f"{m['ms_per_token']:.0f}", _cell(m, "step_ms", 2),
                     _by_step(m, plain, "step_ms"), _cell(m, "decode_step_ms", 2), _by_step(m, plain, "decode_step_ms"),
                     _cell(m, "ttft_ms", 0), _cell(m, "steps", 0), *(_cell(m, key, 2) for key in phases)]
            if phases:
                cells += [_cell(m, "masked_rows", 1), _cell(m, "dense_share", 2), _cell(m, "forced_share", 2)]
            lines.append(f"| {kind} | {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _by_step(m: dict[str, Any], plain: dict[str, Any] | None, key: str) -> str:
    """Plain rows' ms a step over these rows' (a speed: >1 faster than plain)."""
    return f"{plain[key] / m[key]:.2f}x" if plain and plain.get(key) and m.get(key) else "-"


def _cell(m: dict[str, Any], key: str, digits: int) -> str:
    return f"{m[key]:.{digits}f}" if key in m else "-"


def write_docs(result: dict[str, Any], docs: Path, name: str) -> None:
    """The table between this benchmark's markers in `docs` (left alone where they are missing)."""
    text = docs.read_text()
    begin, end = MARK.format(f"{name} begin"), MARK.format(f"{name} end")
    if begin not in text or end not in text:
        print(f"no markers for {name} in {docs}: table not written", file=sys.stderr)
        return
    head, rest = text.split(begin, 1)
    docs.write_text(f"{head}{begin}\n{table(result)}\n{end}{rest.split(end, 1)[1]}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF (default: the demo model)")
    p.add_argument("--arms", nargs="+", default=["llama", "llguidance"], choices=["llama", "llguidance", "llama-server"])
    p.add_argument("--llama-server", dest="llama_server", help="llama-server's binary, for the llama-server arm")
    p.add_argument("--ours-arms", dest="ours_arms", nargs="*", default=[], metavar="NAME=FLAGS",
                   help="more arms: llguidance with these server flags (commas for spaces; ENV:KEY=VALUE for its "
                        "environment), e.g. unsteady=--steady_decode,off")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--baseline", help="also each arm on this git revision's code (arm@REV), trials interleaved; or "
                                      "on a `git archive --format=tar.gz REV pflash_plugin` saved as NAME.tgz (arm@NAME)")
    p.add_argument("--n-ctx", dest="n_ctx", type=int, default=4096)
    p.add_argument("--gpu-layers", dest="gpu_layers", type=int, default=0)
    p.add_argument("--server-flags", dest="server_flags", nargs=argparse.REMAINDER, default=[],
                   help="more flags for both servers (last on the line)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "data" / "constrained_cpu.json")
    p.add_argument("--docs", default=str(REPO / "docs" / "sampling.md"), help="the page with the table ('': none)")
    p.add_argument("--table-name", dest="table_name", default="constrained_cpu")
    p.add_argument("--table-only", dest="table_only", action="store_true", help="the table from --out, no runs")
    return p


def main() -> None:
    args = parser().parse_args()
    if args.table_only:
        result = json.loads(args.out.read_text())
    else:
        result = run(args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    if args.docs:
        write_docs(result, Path(args.docs), args.table_name)


if __name__ == "__main__":
    main()
