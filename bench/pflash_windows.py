"""Windowed against causal drafting on the demo model: needle retrieval, kept-segment overlap, draft time.

Every prompt is compressed twice by the same model (the target stopped at its first global layer):
once in one causal pass and once in windows beside a sink. Each compressed prompt is then answered
by the target (greedy, in-process, no HTTP), and the 4-digit code must be in the answer. The
overlap is |kept windowed ∩ kept causal| / |kept causal|. Arms alternate per prompt.

Usage: python bench/pflash_windows.py [--lengths 8192 16384] [--window 2048] [--sink 64] [--keep 0.1]
       [--n_gpu_layers 0] [--model PATH] [--ubatch 512] [--lanes 1]
Writes bench/results/pflash_windows.json (--out) and prints one JSON line per prompt and a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import llama_cpp  # noqa: F401  before numpy: numpy first made the CUDA model load segfault on the H200 machine
from pflash_plugin.pflash.compressor import CompressionJob, Compressor
from pflash_plugin.pflash.drafter import DraftOptions, Drafter, scoring_layers
from pflash_plugin.pflash.query import plan_query
from pflash_plugin.pflash.windows import DraftWindows
from pflash_plugin.server.runtime.models import ServedModel
from pflash_plugin.server.config.settings import ModelSettings
from pflash_plugin.testing.haystack import fit_needle_prompt
from pflash_plugin.server.runtime.inprocess import Run

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [("prose", 0.1), ("prose", 0.5), ("prose", 0.9), ("code", 0.1), ("code", 0.5), ("code", 0.9), ("multi", 0.5)]


def fit(served: ServedModel, n_tokens: int, kind: str, depth: float, seed: int) -> tuple[list[int], str]:
    """Prompt tokens of about n_tokens and the hidden code."""
    prompt, code, _ = fit_needle_prompt(lambda text: len(served.model.tokenize(text)), n_tokens, kind, depth, seed,
                                        attempts=4)
    return served.model.tokenize(prompt), code


def compressors(served: ServedModel, args: argparse.Namespace, max_tokens: int) -> dict[str, Compressor]:
    model = served.model
    layers = scoring_layers(model, None)
    windowed = DraftWindows(args.window, args.sink, causal_max=0)
    arms = {"causal": DraftOptions(n_batch=512, n_threads=args.n_threads),
            "windowed": DraftOptions(n_batch=args.ubatch, n_threads=args.n_threads, windows=windowed,
                                     lanes=args.lanes)}
    out = {}
    for arm, options in arms.items():
        out[arm] = Compressor(served.pflash, model.piece,
                              lambda options=options: Drafter(model, layers, max_tokens, options), persistent=True)
    return out


def one_prompt(served: ServedModel, arms: dict[str, Compressor], n: int, kind: str, depth: float, seed: int,
               keep: float) -> dict:
    """Both arms on one prompt, in an order that alternates with the seed."""
    tokens, code = fit(served, n, kind, depth, seed)
    plan = plan_query(len(tokens), served.pflash.query_tokens,
                      min_head=served.pflash.segment_min)
    row: dict = {"tokens": n, "prompt_tokens": len(tokens), "kind": kind, "depth": depth, "code": code}
    kept: dict[str, set[int]] = {}
    for arm in (("causal", "windowed") if seed % 2 == 0 else ("windowed", "causal")):
        result = arms[arm].compress(CompressionJob(tokens, plan, keep))
        assert result.selection is not None, result.report
        kept[arm] = set(result.selection.token_indices())
        answer = Run(served, result.tokens, "off", max_tokens=8).wait()
        row[arm] = {"ok": code in answer.text, "answer": answer.text, "draft_ms": result.report.draft_ms,
                    "forward_ms": result.report.draft_timings["forward_ms"],
                    "windows": result.report.draft_windows, "kept_tokens": result.report.kept_tokens}
    row["overlap"] = round(len(kept["windowed"] & kept["causal"]) / len(kept["causal"]), 3)
    return row


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for n in sorted({r["tokens"] for r in rows}):
        group = [r for r in rows if r["tokens"] == n]
        causal_ms = statistics.median(r["causal"]["forward_ms"] for r in group)
        windowed_ms = statistics.median(r["windowed"]["forward_ms"] for r in group)
        out.append({"tokens": n, "prompts": len(group),
                    "causal_retrieved": sum(r["causal"]["ok"] for r in group),
                    "windowed_retrieved": sum(r["windowed"]["ok"] for r in group),
                    "overlap_median": statistics.median(r["overlap"] for r in group),
                    "overlap_min": min(r["overlap"] for r in group),
                    "causal_forward_s": round(causal_ms / 1000, 3), "windowed_forward_s": round(windowed_ms / 1000, 3),
                    "forward_speedup": round(causal_ms / windowed_ms, 2)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--sink", type=int, default=64)
    parser.add_argument("--ubatch", type=int, default=512, help="tokens of a window per drafter ubatch (windowed arm)")
    parser.add_argument("--lanes", type=int, default=1, help="drafter contexts drafting windows at once (windowed arm)")
    parser.add_argument("--keep", type=float, default=0.1)
    parser.add_argument("--n_gpu_layers", type=int, default=0)
    parser.add_argument("--n_threads", type=int, default=0, help="0: llama.cpp's default")
    parser.add_argument("--model", default=None, help="default: the demo model")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "pflash_windows.json")
    args = parser.parse_args()
    max_tokens = max(args.lengths) + 512  # the prompt, the answer, and room for the tokenizer's fit
    threads = {"n_threads": args.n_threads, "n_threads_batch": args.n_threads} if args.n_threads else {}
    served = ServedModel(ModelSettings(model=args.model, n_ctx=max_tokens, max_concurrency=1,
                                       n_gpu_layers=args.n_gpu_layers, verbose=False, **threads))
    arms = compressors(served, args, max_tokens)
    rows = []
    started = {"load": os.getloadavg(), "at": time.strftime("%Y-%m-%d %H:%M")}
    try:
        for n in args.lengths:
            for i, (kind, depth) in enumerate(PROMPTS):
                rows.append(one_prompt(served, arms, n, kind, depth, seed=1000 + 7 * i + n % 5, keep=args.keep))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for compressor in arms.values():
            compressor.close()
        served.close()
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": platform.platform(), "nproc": os.cpu_count(),
              "started": started, "load_at_end": os.getloadavg(), "rows": rows, "summary": summarize(rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for line in result["summary"]:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
