"""PFlash quality gate on the demo model: one needle, one key among others, several values of one key;
full prefill against PFlash drafting in one context and in lanes.

Arms, a server each (the demo model as its own drafter, greedy, one request at a time): full
(--pflash off), and PFlash (--pflash always) with --pflash_drafter_lanes 1 and with each of --lanes.
Every prompt goes to every arm in turn, the order rotated per prompt. Kinds (haystack.quality_prompt):
single (a vault code in prose), multikey (the vault's code among two other doors' codes), multivalue
(three codes under the one key, all to be found). A prompt's score is the fraction of its values in
the answer; a kind's score is the mean over its prompts, whose needles sit at depths spread over
0.1-0.9.

Lanes need windows: on a GPU a 32K prompt is drafted in windows by default (over
--pflash_drafter_causal_max 16384); at the small sizes of a CPU run force them with --window and
--causal_max 0.

Usage: python bench/pflash_quality.py [--length 4096] [--prompts 3] [--keep 0.1] [--lanes 4]
       [--window 512 --causal_max 0] [--n_gpu_layers -1] [--kinds single multikey multivalue]
  CPU (docs/pflash_quality.md): --length 6144 --prompts 3 --window 512 --causal_max 0
  GPU: --length 31000 --prompts 20 --n_gpu_layers -1 (the demo model's training context is 32768);
       on the CUDA machine, with the model carried in pieces: bench/gpu/quality_gpu.sh
Writes bench/results/pflash_quality.json (--out) and prints the markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from harness import REPO, ServerProcess, machine
from pflash_plugin.testing.haystack import QUALITY_KINDS, TOKENS_PER_VALUE, quality_grid, quality_prompt, values_found

def arm_flags(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each arm's server flags beyond the common ones."""
    pflash = ["--pflash", "always", "--pflash_keep_ratio", str(args.keep)]
    if args.window is not None:
        pflash += ["--pflash_drafter_window", str(args.window)]
    if args.causal_max is not None:
        pflash += ["--pflash_drafter_causal_max", str(args.causal_max)]
    arms = {} if args.no_full else {"full": ["--pflash", "off"]}
    for lanes in (1, *args.lanes):
        arms[f"lanes{lanes}"] = [*pflash, "--pflash_drafter_lanes", str(lanes)]
    return arms


def ask(client: httpx.Client, url: str, prompt: str, values: list[str]) -> dict:
    """One greedy completion, scored, with its TTFT and PFlash report."""
    body = {"prompt": prompt, "max_tokens": TOKENS_PER_VALUE * len(values), "temperature": 0}
    reply = client.post(url + "/v1/completions", json=body)
    reply.raise_for_status()
    data = reply.json()
    text, timings = data["choices"][0]["text"], data["usage"]["timings"]
    pflash = timings.get("pflash") or {}
    return {"answer": text, "score": values_found(values, text), "ttft_ms": timings["ttft_ms"],
            "status": pflash.get("status", "off"), "kept_tokens": pflash.get("kept_tokens"),
            "draft_windows": pflash.get("draft_windows"), "draft_ms": pflash.get("draft_ms")}


def run(args: argparse.Namespace) -> list[dict]:
    """Every prompt of every kind through every arm; one row per prompt."""
    common = ["--n_ctx", str(int(args.length * 1.04) + 256), "--max_concurrency", "1", "--verbose", "false",
              "--n_gpu_layers", str(args.n_gpu_layers), *(["--model", args.model] if args.model else [])]
    servers = {arm: ServerProcess(f"quality-{arm}", common + flags) for arm, flags in arm_flags(args).items()}
    rows = []
    try:
        for server in servers.values():
            server.start(timeout_s=300)
        names = list(servers)
        url = servers[names[0]].url
        with httpx.Client(timeout=3600) as client:
            def count(text: str) -> int:
                return client.post(url + "/extras/tokenize/count", json={"input": text}).json()["count"]

            for turn, (kind, depth, seed) in enumerate(quality_grid(args.kinds, args.prompts, args.seed)):
                prompt, values, n = quality_prompt(count, args.length, kind, depth, seed)
                row: dict = {"kind": kind, "depth": depth, "seed": seed, "prompt_tokens": n, "values": values}
                turn %= len(names)
                for arm in names[turn:] + names[:turn]:
                    row[arm] = ask(client, servers[arm].url, prompt, values)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return rows


def summarize(rows: list[dict], arms: list[str]) -> dict[str, dict[str, float]]:
    """Mean score per kind (and over all prompts) and arm."""
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    groups = {kind: [r for r in rows if r["kind"] == kind] for kind in kinds} | {"all": rows}
    return {kind: {arm: round(statistics.mean(r[arm]["score"] for r in group), 3) for arm in arms}
            for kind, group in groups.items()}


def table(summary: dict[str, dict[str, float]], rows: list[dict]) -> str:
    """The summary as a markdown table: a row per kind, a column per arm."""
    arms = list(next(iter(summary.values())))
    lines = ["| kind | prompts | " + " | ".join(arms) + " |", "|---|---:|" + "---:|" * len(arms)]
    for kind, scores in summary.items():
        n = len(rows) if kind == "all" else sum(r["kind"] == kind for r in rows)
        lines.append(f"| {kind} | {n} | " + " | ".join(f"{scores[arm]:.3f}" for arm in arms) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="the demo GGUF (default: the server's, from the demo package)")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per kind")
    parser.add_argument("--kinds", nargs="+", default=list(QUALITY_KINDS), choices=QUALITY_KINDS)
    parser.add_argument("--keep", type=float, default=0.1)
    parser.add_argument("--lanes", type=int, nargs="*", default=[4], help="lane counts to set against one context")
    parser.add_argument("--window", type=int, default=None, help="--pflash_drafter_window (default: the server's)")
    parser.add_argument("--causal_max", type=int, default=None, help="--pflash_drafter_causal_max")
    parser.add_argument("--n_gpu_layers", type=int, default=0)
    parser.add_argument("--no_full", action="store_true", help="leave out the full-prefill arm")
    parser.add_argument("--seed", type=int, default=7000)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "pflash_quality.json")
    args = parser.parse_args()
    started = {"at": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine()}
    t0 = time.perf_counter()
    rows = run(args)
    arms = list(arm_flags(args))
    summary = summarize(rows, arms)
    result = {"command": "python " + " ".join(sys.argv), "args": vars(args) | {"out": str(args.out)},
              "started": started, "wall_s": round(time.perf_counter() - t0, 1),
              "load_at_end": os.getloadavg(), "rows": rows, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary))
    print(table(summary, rows))


if __name__ == "__main__":
    main()
