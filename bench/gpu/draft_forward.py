"""The drafter's forward alone: seconds and microseconds per token, causal against windowed, per
prompt length, drafter ubatch and lanes. Linear cost shows as a flat per-token time.

    python bench/gpu/draft_forward.py --model D.gguf --layers 27 --out draft.json [--n_gpu_layers -1]
        [--plain D.gguf D10.gguf] [--cut] [--configs W2048-ub512 W2048-ub2112 W2048-ub512-l4 ...]

A configuration is named by what it sets: `causal-ub512` (one causal pass, ubatch 512), or
`W<window>-ub<tokens of a window per ubatch>[-l<lanes>][-nopin]`
(pflash_drafter_window, pflash_drafter_ubatch, pflash_drafter_lanes; sink
--sink; `-nopin`: without the pinned KV view of DraftLane._pin_view, as before it). Configurations run interleaved per
repetition (A, B, C, ... then again), on random tokens, after one warm-up draft each; every
configuration's mass is compared with the first one's on the same tokens (`max_diff`: largest
difference over the largest mass; `top10_overlap`: share of the top 10% tokens both keep).
`--plain` adds, per model, the same windows (W 2048, ubatch 512, no sink) decoded by a context
without the capture callback: every layer runs and nothing is captured. With a copy of the drafter
cut to the layers the draft runs (a model written with fewer layers), the gap to W2048-ub512 is
what the capture costs: the callback splits each ubatch's graph at the captured nodes and stops it.
`--cut` adds each configuration on the copy of the drafter cut after its last scoring layer, as the
server loads a --pflash_drafter (pflash_drafter_cut; labels end in `-cut`). `--flash_attn off` drafts
with llama.cpp's attention without flash attention (the server always drafts with it): a probe of
which kernels a wrong score comes from.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

from pflash_plugin.llama import Batch, Context, ContextConfig, Model
from pflash_plugin.llama.gguf_cut import cached_cut
from pflash_plugin.pflash import draft_lane
from pflash_plugin.pflash.drafter import DraftOptions, Drafter
from pflash_plugin.pflash.windows import DraftWindows

import numpy as np  # after llama_cpp (see pflash_gpu.py)

CONFIGS = ["causal-ub512", "W2048-ub512", "W2048-ub2048", "W4096-ub1024", "W1024-ub512"]
LABEL = re.compile(r"(?:causal|W(\d+))-ub(\d+)(?:-l(\d+))?(-nopin)?")


def options(label: str, sink: int) -> DraftOptions:
    """The drafter options a configuration label names; every window is drafted for every length
    (causal_max 0)."""
    match = LABEL.fullmatch(label)
    if match is None:
        raise SystemExit(f"configuration {label!r} is not causal-ub<N> or W<window>-ub<N>[-l<lanes>][-nopin]")
    *numbers, nopin = match.groups()
    window, n_batch, lanes = (int(group) if group else None for group in numbers)
    assert n_batch is not None
    return DraftOptions(n_batch=n_batch, windows=DraftWindows(window or 0, sink, causal_max=0),
                        pin_window_view=False if nopin else None, lanes=lanes or 1)


def agreement(mass: np.ndarray, base: np.ndarray) -> dict[str, float]:
    """How far a mass is from the first configuration's on the same tokens."""
    top = max(1, len(base) // 10)
    kept = set(np.argpartition(mass, -top)[-top:]) & set(np.argpartition(base, -top)[-top:])
    return {"max_diff": float(np.abs(mass - base).max() / np.abs(base).max()), "top10_overlap": len(kept) / top}


class Windows:
    """Windows of `window` tokens decoded without a callback, each in an emptied sequence: every layer
    runs and nothing is captured."""

    def __init__(self, model: Model, n_ubatch: int = 512, window: int = 2048) -> None:
        self.n_ubatch, self.window = n_ubatch, window
        self.ctx = Context(model, ContextConfig(n_ctx=window, n_batch=n_ubatch, n_ubatch=n_ubatch,
                                                flash_attn=True, n_outputs_max=1))
        self.batch = Batch(n_ubatch, 1)

    def run(self, tokens: list[int], synced: bool = False) -> dict[str, float]:
        """Decode every window; synced: wait for the GPU after each ubatch and time both sides
        (`submit`: the host inside llama_decode; `wait`: what the GPU still had to do)."""
        submit = wait = 0.0
        ubatches = 0
        start = time.perf_counter()
        for first in range(0, len(tokens), self.window):
            self.ctx.memory.clear()
            window = tokens[first:first + self.window]
            for done in range(0, len(window), self.n_ubatch):
                self.batch.clear()
                self.batch.add_sequence(window[done:done + self.n_ubatch], first + done, 0, False)
                before = time.perf_counter()
                self.ctx.decode(self.batch)
                if synced:
                    submitted = time.perf_counter()
                    self.ctx.synchronize()
                    submit += submitted - before
                    wait += time.perf_counter() - submitted
                ubatches += 1
        self.ctx.synchronize()
        wall = time.perf_counter() - start
        row = {"wall_ms": wall * 1e3, "ubatches": ubatches, "ms_per_ubatch": wall * 1e3 / ubatches}
        if synced:
            row |= {"submit_ms_per_ubatch": submit * 1e3 / ubatches, "wait_ms_per_ubatch": wait * 1e3 / ubatches}
        return row

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--layers", type=int, nargs="+", required=True, help="scoring layers (the draft stops after the last)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--sink", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8192, help="tokens of each configuration's warm-up draft")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--n_gpu_layers", type=int, default=-1)
    parser.add_argument("--plain", nargs="*", default=[], help="models to time without the capture callback")
    parser.add_argument("--cut", action="store_true", help="also draft on the copy cut after the last scoring layer")
    parser.add_argument("--flash_attn", choices=["on", "off"], default="on")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.flash_attn == "off":
        draft_lane.ContextConfig = lambda **given: ContextConfig(**{**given, "flash_attn": False})  # type: ignore
    model = Model(args.model, n_gpu_layers=args.n_gpu_layers)
    models = {"": model}
    if args.cut:
        cut = cached_cut(args.model, max(args.layers) + 1)
        assert cut is not None, "the cut copy could not be written (see the warning)"
        models["-cut"] = Model(cut, n_gpu_layers=args.n_gpu_layers)
    max_tokens = max(*args.lengths, args.warmup)
    drafters = {label + suffix: Drafter(drafted, args.layers, max_tokens, options(label, args.sink))
                for label in args.configs for suffix, drafted in models.items()}
    plain_models = {f"plain-{Path(path).stem}": Model(path, n_gpu_layers=args.n_gpu_layers) for path in args.plain}
    plain = {label: Windows(plain_model) for label, plain_model in plain_models.items()}
    rng = np.random.default_rng(0)
    warmup = [int(t) for t in rng.integers(100, model.n_vocab, args.warmup)]
    for drafter in drafters.values():
        drafter.run(warmup, len(warmup) - 8)
    rows = []
    for n in args.lengths:
        tokens = [int(t) for t in rng.integers(100, model.n_vocab, n)]
        for rep in range(args.reps):
            base = None
            for label, drafter in drafters.items():
                start = time.perf_counter()
                result = drafter.run(tokens, n - 8)
                wall = time.perf_counter() - start
                base = result.mass if base is None else base
                rows.append({"config": label, "tokens": n, "rep": rep, "wall_s": round(wall, 4),
                             "windows": result.windows, **result.timings, **agreement(result.mass, base)})
                print(json.dumps(rows[-1]), flush=True)
            for label, forward in plain.items():
                start = time.perf_counter()
                timings = forward.run(tokens)
                rows.append({"config": label, "tokens": n, "rep": rep, "wall_s": round(time.perf_counter() - start, 4),
                             "windows": -(-n // forward.window), "forward_ms": round(timings["wall_ms"], 3)})
                print(json.dumps(rows[-1]), flush=True)
    summary = []
    for label in [*drafters, *plain]:
        for n in args.lengths:
            walls = [r["wall_s"] for r in rows if r["config"] == label and r["tokens"] == n]
            forward = [r["forward_ms"] for r in rows if r["config"] == label and r["tokens"] == n]
            worst = [r["max_diff"] for r in rows if r["config"] == label and r["tokens"] == n and "max_diff" in r]
            summary.append({"config": label, "tokens": n, "wall_s": statistics.median(walls),
                            "forward_us_per_token": round(1000 * statistics.median(forward) / n, 2),
                            "wall_us_per_token": round(1e6 * statistics.median(walls) / n, 2),
                            **({"max_diff": max(worst)} if worst else {})})
            print(json.dumps(summary[-1]), flush=True)
    args.out.write_text(json.dumps({"model": args.model, "layers": args.layers, "rows": rows, "summary": summary}, indent=1))
    for closable in [*drafters.values(), *plain.values(), *plain_models.values(), *models.values()]:
        closable.close()


if __name__ == "__main__":
    main()
