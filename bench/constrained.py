"""Structured output at decode speed: C clients with a JSON schema (a three-field pydantic-like
object, and a larger one) against plain rows, through llama.cpp's grammar sampler
(`--constraint_engine llama`, the path before issue 49) and llguidance (`llguidance`).

    python bench/constrained.py                 # the demo model on the CPU, 4 clients, 3 reps
    python bench/constrained.py --table-only    # the docs table again from docs/data/constrained_cpu.json

Each trial: C clients at once send one /v1/completions each (distinct prompts, seeded sampling at
temperature 0.8; plain rows generate all of `--max-tokens` (min_tokens), schema rows until their
JSON closes or `--max-tokens`); tokens/s is every completion token over the trial's wall time,
ms/token the median over clients of each one's latency over its tokens (prefill included). All
servers loaded at once, one driven at a time, reps interleaved kind by kind and arm by arm; the
load average before each trial and `uptime` at the start and end are kept. Medians over reps go
to `--out` and to the table between the markers of `--docs`. bench/gpu/constrained_gpu.py runs it
on a GPU at 64 clients.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.append(sys.path.pop(0))  # as in bench/serving.py: bench/ must not shadow the standard library

import httpx
from harness import REPO, ServerProcess, demo_model_path, machine

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
KINDS = {"plain": None, "person": PERSON, "order": ORDER}
MARK = "<!-- bench/constrained.py: {} -->"


def body(kind: str, prompt: str, max_tokens: int, seed: int) -> dict[str, Any]:
    """One client's request: a plain row generates every token, a schema row until its JSON closes."""
    request: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed}
    schema = KINDS[kind]
    if schema is None:
        return {**request, "min_tokens": max_tokens}
    return {**request, "response_format": {"type": "json_schema", "json_schema": {"name": kind, "schema": schema}}}


async def trial(server: ServerProcess, kind: str, clients: int, max_tokens: int, rep: int) -> dict[str, Any]:
    """C clients at once; tokens/s over the wall time, median ms/token, JSON that parses."""
    async def one(i: int, http: httpx.AsyncClient) -> tuple[int, float, bool]:
        started = time.perf_counter()
        reply = await http.post(server.url + "/v1/completions", json=body(
            kind, f"Record {rep}.{i} of the shop's database, as JSON:", max_tokens, 1000 * (rep + 1) + i))
        reply.raise_for_status()
        answer = reply.json()
        tokens = answer["usage"]["completion_tokens"]
        return tokens, time.perf_counter() - started, _parses(answer["choices"][0]["text"])

    async with httpx.AsyncClient(timeout=1800) as http:
        load = os.getloadavg()[0]
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i, http) for i in range(clients)))
        wall = time.perf_counter() - start
    tokens = sum(r[0] for r in results)
    return {"tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2),
            "ms_per_token": round(statistics.median(1000 * s / max(t, 1) for t, s, _ in results), 1),
            "valid_json": sum(ok for _, _, ok in results), "load_1m": load}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def run(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--model", args.model or demo_model_path(), "--n_ctx", str(args.n_ctx), "--max_concurrency",
             str(args.slots), "--n_gpu_layers", str(args.gpu_layers), "--verbose", "false", *args.server_flags]
    servers = {arm: ServerProcess(f"constrained-{arm}", [*flags, "--constraint_engine", arm]) for arm in args.arms}
    rows: list[dict[str, Any]] = []
    started = uptime()
    try:
        for server in servers.values():
            server.start(600)
            for kind in args.kinds:  # warm-up: the tokenizer, the schema's compile, the first decode
                asyncio.run(trial(server, kind, 1, 8, -1))
        for rep in range(args.reps):
            for kind in args.kinds:
                for arm, server in servers.items():
                    row = {"arm": arm, "kind": kind, "rep": rep,
                           **asyncio.run(trial(server, kind, args.clients, args.max_tokens, rep))}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    medians = {f"{arm}/{kind}": {key: statistics.median(r[key] for r in rows if r["arm"] == arm and r["kind"] == kind)
                                 for key in ("tok_s", "ms_per_token", "tokens", "valid_json")}
               for arm in args.arms for kind in args.kinds}
    return {"command": " ".join(sys.argv), "clients": args.clients, "max_tokens": args.max_tokens,
            "reps": args.reps, "uptime_start": started, "uptime_end": uptime(), "machine": machine(),
            "medians": medians, "rows": rows}


def table(result: dict[str, Any]) -> str:
    """The medians as a markdown table: per kind, each arm's tokens/s and ms/token, and the
    schema rows' throughput against the plain rows' on the same arm."""
    medians = result["medians"]
    arms = sorted({key.split("/")[0] for key in medians})
    kinds = [kind for kind in KINDS if any(key.endswith("/" + kind) for key in medians)]
    lines = ["| rows | " + " | ".join(f"{arm}: tok/s | {arm}: ms/token | {arm}: x plain" for arm in arms) + " |",
             "|---|" + "---:|" * (3 * len(arms))]
    for kind in kinds:
        cells = []
        for arm in arms:
            m, plain = medians.get(f"{arm}/{kind}"), medians.get(f"{arm}/plain")
            ratio = f"{m['tok_s'] / plain['tok_s']:.2f}x" if m and plain else "-"
            cells += [f"{m['tok_s']:.1f}", f"{m['ms_per_token']:.0f}", ratio] if m else ["-", "-", "-"]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    p.add_argument("--arms", nargs="+", default=["llama", "llguidance"], choices=["llama", "llguidance"])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
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
