"""The host's cost per decode step at 64 slots: the engine alone against the same engine behind HTTP.

On a GPU a decode step of 64 slots takes a few milliseconds of device time, so the Python around
it (scheduling, sampling calls, detokenization, handing events to the event loop, JSON) decides
how close the server gets to llama-server. This bench shows that cost on any machine: a tiny
model (a 2-layer generated GGUF, whose decode is cheap) with 64 slots, 64 clients x 128 tokens,
greedy, `min_tokens` 128 so that every request runs to the end.

Arms, interleaved per rep: the engine driven in this process (no HTTP: the ceiling), then each
server non-streamed and streamed. `--baseline REV` adds a server of another git revision (a
temporary worktree), for before/after comparisons in one run. `--model demo` runs the demo model
instead (a 262K-token vocabulary: sampling's share of the host's work shows), with `--slots`
clients of `--tokens` tokens.

    python bench/host_overhead.py [--reps 5] [--baseline HEAD~1] [--model demo --slots 16 --tokens 32]

Writes bench/results/host_overhead.json and docs/host_overhead.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from harness import REPO, ServerProcess, demo_model_path, machine, run_to_end
from pflash_plugin.engine.loader import EngineConfig, load_engine
from pflash_plugin.engine.request import Request, SamplingParams
from pflash_plugin.testing import cached_tiny_llama

MODELS = {"tiny": "the tiny generated model (2 layers, width 64, a 1,341-token vocabulary), whose decode is cheap so "
                  "that the host's work shows",
          "demo": "the demo model (Gemma 3 270M Q4_K_M, a 262,144-token vocabulary)"}
DOCS = {"tiny": "host_overhead.md", "demo": "host_overhead_demo.md"}  # --temperature > 0 adds "_sampled"



def server_flags(args: argparse.Namespace) -> list[str]:
    return ["--max_concurrency", str(args.slots), "--n_ctx", "512", "--n_threads", "1", "--n_threads_batch", "1",
            "--verbose", "false"]


def engine_alone(model_path: Path, args: argparse.Namespace) -> float:
    """Tokens/s of the engine in this process: requests submitted together, sinks that count."""
    config = EngineConfig(n_slots=args.slots, max_ctx=512, n_threads=1, n_threads_batch=1)
    model, engine = load_engine(model_path, config)
    try:
        requests = [Request(model.tokenize(f"prompt {i} about the weather"),
                            SamplingParams(max_tokens=args.tokens, temperature=args.temperature, min_tokens=args.tokens))
                    for i in range(args.slots)]
        wall = run_to_end(engine, requests, 600)
        return sum(len(r.output_tokens) for r in requests) / wall
    finally:
        engine.stop()


async def _one(client: httpx.AsyncClient, i: int, args: argparse.Namespace, stream: bool) -> int:
    body = {"prompt": f"prompt {i} about the weather", "max_tokens": args.tokens, "temperature": args.temperature,
            "min_tokens": args.tokens, "stream": stream}
    if not stream:
        return (await client.post("/v1/completions", json=body)).json()["usage"]["completion_tokens"]
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            chunks += line.startswith('data: {"')
    return chunks - 1  # the last chunk carries the finish reason, no token


async def _clients(url: str, args: argparse.Namespace, stream: bool) -> float:
    limits = httpx.Limits(max_connections=2 * args.slots)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(_one(client, i, args, stream) for i in range(args.slots))))
        return tokens / (time.perf_counter() - start)


def worktree(rev: str) -> Path:
    """A temporary checkout of `rev` (a baseline arm's tree); `remove_worktree` takes it away."""
    path = Path(tempfile.mkdtemp(prefix="pflash-baseline-"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)
    return path


def remove_worktree(tree: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    shutil.rmtree(tree, ignore_errors=True)


def run(args: argparse.Namespace) -> dict:
    model = Path(demo_model_path()) if args.model == "demo" else cached_tiny_llama()
    flags = ["--model", str(model), *server_flags(args)]
    servers = {"this": ServerProcess("host-this", flags)}
    tree = worktree(args.baseline) if args.baseline else None
    if tree is not None:
        servers[args.baseline] = ServerProcess("host-baseline", flags, cwd=tree)
    rows: list[dict] = []
    try:
        for server in servers.values():
            server.start()
            asyncio.run(_clients(server.url, args, False))  # warm-up
        for rep in range(args.reps):
            rows.append({"arm": "engine alone", "rep": rep, "tok_s": round(engine_alone(model, args))})
            print(json.dumps(rows[-1]), flush=True)
            for name, server in servers.items():
                for stream in (False, True):
                    arm = f"{name}, {'streamed' if stream else 'non-streamed'}"
                    rows.append({"arm": arm, "rep": rep, "tok_s": round(asyncio.run(_clients(server.url, args, stream)))})
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        for server in servers.values():
            server.stop()
        if tree is not None:
            remove_worktree(tree)
    return {"rows": rows, "machine": machine(), "clients": args.slots, "tokens": args.tokens, "baseline": args.baseline,
            "model": args.model, "temperature": args.temperature}


def doc_name(result: dict) -> str:
    name = DOCS[result["model"]]
    return name.replace(".md", "_sampled.md") if result.get("temperature") else name


def write_docs(result: dict, command: str) -> None:
    arms = list(dict.fromkeys(r["arm"] for r in result["rows"]))
    ceiling = statistics.median(r["tok_s"] for r in result["rows"] if r["arm"] == "engine alone")
    lines = ["# Host overhead per decode step: the engine alone and behind HTTP", "",
             f"{result['clients']} slots, {result['clients']} clients x {result['tokens']} tokens (temperature "
             f"{result['temperature']}, `min_tokens` = `max_tokens`), {MODELS[result['model']]} on 1 decode thread. "
             "Medians over reps; "
             "arms interleaved per rep.", "",
             f"| arm | tokens/s | ms per step of {result['clients']} tokens | of the engine alone | per rep |",
             "|---|---:|---:|---:|---|"]
    for arm in arms:
        values = [r["tok_s"] for r in result["rows"] if r["arm"] == arm]
        median = statistics.median(values)
        lines.append(f"| {arm} | {median:,.0f} | {1000 * result['clients'] / median:.1f} | {median / ceiling:.0%} "
                     f"| {', '.join(f'{v:,}' for v in values)} |")
    m = result["machine"]
    lines += ["", f"Machine: {m['nproc']} cores, {m['cpu']}, load at start {m['load_at_start']}. The clients run "
              "on the same cores as the server.", "", f"Command: `{command}`", ""]
    (REPO / "docs" / doc_name(result)).write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--model", choices=list(MODELS), default="tiny")
    parser.add_argument("--slots", type=int, default=64, help="slots, and clients sent at once")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per client")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; above 0, llama_cpp.server's other sampling defaults (top-k 40, ...)")
    parser.add_argument("--baseline", help="a git revision whose server runs beside this one")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "host_overhead.json")
    args = parser.parse_args()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    command = "python bench/host_overhead.py " + " ".join(sys.argv[1:])
    write_docs(result, command.strip())
    print((REPO / "docs" / doc_name(result)).read_text())


if __name__ == "__main__":
    main()
